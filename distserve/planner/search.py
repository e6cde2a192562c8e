"""DistServe's placement search: which fleet gives the most goodput per device within a budget.

Candidates (enumerate_candidates): every fleet that fits the device budget, from
- disaggregated: n_p prefill x s_p devices + n_d decode x s_d devices, s_p and s_d any measured size
  (for GPU profiles the size is the tensor-parallel degree);
- colocated: n_c colocated x s_c devices;
- mixed: n_p prefill + n_d decode + n_c colocated, all one size and the default budget;
each prefill/colocated kind at a few token budgets (the profile's, times `budget_factors`), and on
more than one node at both placements ("local", "spread": see placement.py).

Ranking (plan): each candidate's goodput (goodput.find_goodput), per device, best first; fleets
within the rate search's tolerance of the best are a tie, which the larger goodput wins. When there are more candidates than `max_simulated`, a phase-wise screen comes
first, as DistServe's does: the goodput of one worker of each kind alone (prefill against the TTFT
target only, decode against the TPOT target only, colocated against both) gives each candidate an
estimate, min(sum over prefill, sum over decode) + sum over colocated; only the best estimates
(and the best max_simulated/4 of each family) are simulated whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from distserve.planner.fleet_spec import describe_workers, format_workers
from distserve.planner.goodput import Goodput, RateSearch, Trace, find_goodput
from distserve.planner.placement import DeviceBudget, place
from distserve.planner.profile import Profile
from distserve.planner.sim_metrics import Slo
from distserve.planner.simulator import ClusterConfig, WorkerSpec


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    budget_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    """Prefill/colocated token budgets tried, as multiples of each profile's max_batch_tokens."""
    max_running: int = 64
    include_mixed: bool = True
    max_simulated: int = 32
    """Candidates simulated whole; beyond this the phase-wise screen picks them."""
    objective: str = "per-device"
    """per-device: goodput / devices used (DistServe's); total: goodput of the fleet."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    config: ClusterConfig
    family: str  # disaggregated | colocated | mixed
    placement: str  # single node | local | spread | any (no KV transfer)

    @property
    def fleet(self) -> str:
        return format_workers(self.config.workers)


@dataclasses.dataclass
class Ranked:
    candidate: Candidate
    goodput: Goodput
    estimate: float | None = None  # the phase-wise screen's goodput estimate, when screened

    @property
    def per_device(self) -> float:
        return self.goodput.rate / self.candidate.config.devices

    def to_dict(self, unit: str = "core") -> dict:
        config = self.candidate.config
        return {"fleet": self.candidate.fleet, "description": describe_workers(config.workers, unit),
                "family": self.candidate.family, "placement": self.candidate.placement,
                "devices": config.devices, "goodput_rps": self.goodput.rate,
                "goodput_per_device_rps": self.per_device, "attainment_at_goodput": self.goodput.attainment,
                "screen_estimate_rps": self.estimate, "probes": [list(p) for p in self.goodput.probes]}


def _budgets(profile: Profile, space: SearchSpace) -> list[int]:
    return sorted({max(16, int(profile.max_batch_tokens * f)) for f in space.budget_factors})


def _kinds(profiles: list[Profile], budget: DeviceBudget, role: str, space: SearchSpace) -> list[WorkerSpec]:
    """One WorkerSpec per (size, token budget) a worker of `role` may take."""
    fits = [p for p in profiles if p.cores_per_worker <= budget.per_node]
    if role == "decode":
        return [WorkerSpec(role, p, max_running=space.max_running) for p in fits]
    return [WorkerSpec(role, p, b, space.max_running) for p in fits for b in _budgets(p, space)]


def _fleets(profiles: list[Profile], budget: DeviceBudget, space: SearchSpace):
    """(family, workers) for every fleet whose device count fits the budget."""
    total = budget.total
    prefill, decode = _kinds(profiles, budget, "prefill", space), _kinds(profiles, budget, "decode", space)
    for p, d in itertools.product(prefill, decode):
        for n_p in range(1, total // p.devices + 1):
            for n_d in range(1, (total - n_p * p.devices) // d.devices + 1):
                yield "disaggregated", [p] * n_p + [d] * n_d
    for c in _kinds(profiles, budget, "colocated", space):
        for n_c in range(1, total // c.devices + 1):
            yield "colocated", [c] * n_c
    if space.include_mixed:
        for prof in profiles:
            p, d, c = (WorkerSpec(r, prof, 0, space.max_running) for r in ("prefill", "decode", "colocated"))
            for n_p, n_d, n_c in itertools.product(range(1, total // prof.cores_per_worker + 1), repeat=3):
                if (n_p + n_d + n_c) * prof.cores_per_worker <= total:
                    yield "mixed", [p] * n_p + [d] * n_d + [c] * n_c


def enumerate_candidates(profiles: list[Profile], budget: DeviceBudget,
                         space: SearchSpace = SearchSpace()) -> list[Candidate]:
    """Every fleet that fits `budget`, placed (see the module docstring)."""
    placements = ["local", "spread"] if budget.num_nodes > 1 else ["local"]
    candidates = []
    for family, workers in _fleets(profiles, budget, space):
        for placement in placements if family != "colocated" else placements[:1]:
            config = place(workers, budget, placement)
            if config is not None:
                candidates.append(Candidate(config, family, _placement_label(family, placement, budget)))
    return candidates


def _placement_label(family: str, placement: str, budget: DeviceBudget) -> str:
    if budget.num_nodes == 1:
        return "single node"
    return "any (no KV transfer)" if family == "colocated" else placement


def plan(profiles: list[Profile], budget: DeviceBudget, trace: Trace, slo: Slo,
         space: SearchSpace = SearchSpace(), search: RateSearch = RateSearch()) -> list[Ranked]:
    """Every simulated candidate, best first (see the module docstring)."""
    candidates = enumerate_candidates(profiles, budget, space)
    estimates: dict[int, float] = {}
    if len(candidates) > space.max_simulated:
        candidates, estimates = _screen(candidates, trace, slo, space, search)
    ranked = [Ranked(c, find_goodput(c.config, trace, slo, search), estimates.get(id(c))) for c in candidates]
    ranked.sort(key=lambda r: _score(r.goodput.rate, r.candidate, space))
    return _break_ties(ranked, space, search.rel_tol)


def _break_ties(ranked: list[Ranked], space: SearchSpace, rel_tol: float) -> list[Ranked]:
    """Per device, fleets within the rate search's tolerance of the best are a tie: of those, the
    one with the most goodput goes first (it uses more of the budget for the same efficiency)."""
    if space.objective != "per-device" or not ranked:
        return ranked
    floor = ranked[0].per_device * (1 - rel_tol)
    tied = [r for r in ranked if r.per_device >= floor]
    tied.sort(key=lambda r: (-r.goodput.rate, r.candidate.config.devices, r.candidate.fleet))
    return tied + [r for r in ranked if r.per_device < floor]


def _score(rate: float, candidate: Candidate, space: SearchSpace) -> tuple:
    devices = candidate.config.devices
    if space.objective == "total":
        return -rate, devices, candidate.fleet
    return -rate / devices, -rate, candidate.fleet


def _screen(candidates: list[Candidate], trace: Trace, slo: Slo, space: SearchSpace,
            search: RateSearch) -> tuple[list[Candidate], dict[int, float]]:
    """The phase-wise screen: the candidates worth simulating whole, and every candidate's estimate."""
    unit_goodput: dict[tuple, float] = {}
    frontend = candidates[0].config.frontend_s_per_token if candidates else 0.0  # one budget for all
    phase_slo = {"prefill": Slo(ttft_s=slo.ttft_s), "decode": Slo(tpot_s=slo.tpot_s), "colocated": slo}

    def unit(w: WorkerSpec) -> float:
        key = (w.role, w.devices, w.budget)
        if key not in unit_goodput:
            alone = ClusterConfig((dataclasses.replace(w, node=0),), frontend_s_per_token=frontend)
            unit_goodput[key] = find_goodput(alone, trace, phase_slo[w.role], search).rate
        return unit_goodput[key]

    estimates = {}
    for c in candidates:
        sums = {role: sum(unit(w) for w in c.config.workers if w.role == role)
                for role in ("prefill", "decode", "colocated")}
        disaggregated = min(sums["prefill"], sums["decode"]) if c.family != "colocated" else 0.0
        estimates[id(c)] = disaggregated + sums["colocated"]
    order = sorted(candidates, key=lambda c: _score(estimates[id(c)], c, space))
    keep = order[:space.max_simulated]
    for family in ("disaggregated", "colocated", "mixed"):  # the screen's estimates are rough: keep a few each
        keep += [c for c in order if c.family == family][:max(2, space.max_simulated // 4)]
    unique = list({id(c): c for c in keep}.values())
    return unique, estimates


def devices_label(count: int, unit: str) -> str:
    return f"{count} {unit}{'s' if count != 1 else ''}"


def replicas_to_fill(ranked: Ranked, budget: DeviceBudget) -> int:
    """How many copies of this fleet the budget holds (DistServe replicates the best unit)."""
    return max(1, math.floor(budget.total / ranked.candidate.config.devices))
