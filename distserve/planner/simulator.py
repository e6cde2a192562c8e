"""A discrete-event simulator of the serving system: router, prefill, decode and colocated workers.

Deterministic: the same config and requests give the same result. A request's lifecycle:
  arrive -> router -> prefill worker (chunks) -> first token -> decode blocks reserved
         -> KV transfer (one at a time per prefill worker) -> decode steps -> finished
  or, on a colocated worker: arrive -> router -> prefill chunks beside decode rows -> first token
         -> decode rows -> finished.

Router (services/router/picker.py):
- prefill: the worker with the fewest outstanding prompt tokens (ties: lowest index);
- decode, chosen at arrival like the real router: among workers whose cache could ever hold the
  request, those with enough free blocks now first, then fewest routed-and-unfinished sequences
  (the registry's running + waiting plus the router's in-flight count), then most free blocks;
- colocated: fewest outstanding prompt tokens, then fewest running sequences;
- mixed fleets: the least-loaded colocated worker takes the request when its outstanding prompt
  tokens are fewer than the least-loaded prefill worker's (ties go to the prefill/decode pair).
Load figures are exact here; the real router's are up to a heartbeat old plus its own in-flight count.
A fleet of only prefill workers ends each request at its first token (TTFT only); only decode
workers, its requests arrive with their first token and KV (TPOT only): phase-wise planning uses both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

from distserve.planner.profile import Profile
from distserve.planner.sim_decode import ColocatedSim, DecodeSim
from distserve.planner.sim_metrics import RequestResult, SimSummary, Slo, summarize
from distserve.planner.sim_workers import EventLoop, PrefillSim, SimRequest

ROLES = ("prefill", "decode", "colocated")


class Request(NamedTuple):
    arrival_s: float
    input_len: int
    output_len: int


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    role: str
    """prefill | decode | colocated"""
    profile: Profile
    """The latency model of this worker's hardware share (its cores_per_worker)."""
    max_batch_tokens: int = 0
    """Prefill/colocated token budget per step; 0: the profile's max_batch_tokens."""
    max_running: int = 64
    """Decode/colocated: most sequences decoding at once."""
    node: int = 0
    """Which machine the worker runs on; KV moving between machines uses the inter-node link."""
    chunked_prefill: bool = True
    """Colocated: prompts chunked into steps beside decode rows (ours, vLLM today); False: whole prompts
    in prefill-only steps that decode rows wait for (vLLM before chunked prefill, see ColocatedSim)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"WorkerSpec.role: {self.role!r} is not one of {ROLES}")

    @property
    def budget(self) -> int:
        return self.max_batch_tokens or self.profile.max_batch_tokens

    @property
    def devices(self) -> int:
        return self.profile.cores_per_worker


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    workers: tuple[WorkerSpec, ...]
    inter_node_bytes_per_s: float = math.inf
    """KV bandwidth between workers on different nodes (within a node: the prefill profile's)."""
    inter_node_latency_s: float = 0.0
    is_node_local: bool = False
    """Route each request to a decode worker on its prefill worker's node when there is one."""
    router_overhead_s: float = 0.0
    """Added to every TTFT and end-to-end latency (the router's own hop)."""
    frontend_s_per_token: float = 0.0
    """CPU time the router, gateway and client spend per streamed token, where they share the workers'
    cores (this 2-core box; 0 where the front end has cores of its own). The OS runs them on an idle
    core when there is one, so a decode (or colocated) step costs this much more per decoding
    sequence only when no other worker of its node is idle at the step's start."""
    block_size: int = 16

    @property
    def devices(self) -> int:
        """Cores (CPU) or GPUs the workers use."""
        return sum(w.devices for w in self.workers)

    def count(self, role: str) -> int:
        return sum(w.role == role for w in self.workers)


@dataclasses.dataclass
class SimResult:
    results: list[RequestResult]
    summary: SimSummary


def simulate(config: ClusterConfig, requests: list[Request], slo: Slo | None = None,
             stop_below: float | None = None) -> SimResult:
    """Runs `requests` (sorted or not) through `config`. With `slo` and `stop_below`, stops as soon
    as attainment can no longer reach `stop_below` (the summary then says is_complete=False)."""
    return _Simulation(config, requests, slo, stop_below).run()


class _Simulation:
    def __init__(self, config: ClusterConfig, requests: list[Request], slo: Slo | None,
                 stop_below: float | None):
        self.config, self.slo, self.loop = config, slo, EventLoop()
        self.reqs = [SimRequest(i, *r) for i, r in enumerate(requests)]
        self.is_miss = [False] * len(self.reqs)
        self.num_misses = 0
        self.max_misses = math.inf if slo is None or stop_below is None else (1 - stop_below) * len(self.reqs)
        self.prefill, self.decode, self.colocated = [], [], []
        for spec in config.workers:
            self._add_worker(spec)

    def _add_worker(self, spec: WorkerSpec) -> None:
        bs = self.config.block_size
        if spec.role == "prefill":
            self.prefill.append(PrefillSim(self.loop, spec.profile, spec.budget, spec.node, self._prefilled))
            return
        if spec.role == "decode":
            worker = DecodeSim(self.loop, spec.profile, spec.max_running, spec.node, bs, self._finished)
            self.decode.append(worker)
        else:
            worker = ColocatedSim(self.loop, spec.profile, spec.budget, spec.max_running, spec.node, bs,
                                  self._first_token, self._finished, spec.chunked_prefill)
            self.colocated.append(worker)
        if self.config.frontend_s_per_token:
            worker.frontend_charge = functools.partial(self._frontend_charge, worker)

    def _frontend_charge(self, worker) -> float:
        """Front-end seconds per decoding sequence for `worker`'s step starting now: none while another
        worker of its node is idle (the front end runs there), else config.frontend_s_per_token."""
        for other in (*self.prefill, *self.decode, *self.colocated):
            if other is not worker and other.node == worker.node and not other.is_busy:
                return 0.0
        return self.config.frontend_s_per_token

    def run(self) -> SimResult:
        for req in self.reqs:
            self.loop.call_at(req.arrival_s, self._arrive, req)
        self.loop.run()
        overhead = self.config.router_overhead_s
        results = [_result(req, overhead) for req in self.reqs]
        start = min((r.arrival_s for r in self.reqs), default=0.0)
        end = max((r.finish_s for r in self.reqs if r.finish_s is not None), default=start)
        return SimResult(results, summarize(results, self.slo, not self.loop.is_stopped, end - start))

    # routing
    def _arrive(self, req: SimRequest) -> None:
        prefill = min(self.prefill, key=lambda w: w.outstanding_tokens, default=None)
        colocated = min((w for w in self.colocated if w.blocks.blocks_for(req) <= w.blocks.num_total),
                        key=lambda w: (w.outstanding_tokens, w.num_running), default=None)
        if colocated and (prefill is None or colocated.outstanding_tokens < prefill.outstanding_tokens):
            colocated.submit(req)
        elif prefill and not self.decode:
            prefill.submit(req)
        elif (decode := self._pick_decode(req, prefill.node if prefill else None)) is None:
            self._miss(req)  # no worker could ever hold its KV: the router refuses it
        elif prefill:
            req.decode_worker = decode
            decode.num_assigned += 1
            prefill.submit(req)
        else:  # decode-only fleet: the request arrives with its first token and KV
            req.decode_worker = decode
            decode.num_assigned += 1
            req.first_token_s, req.num_generated = self.loop.now, 1
            self._first_token(req)
            self._to_decode(req, decode, None)

    def _pick_decode(self, req: SimRequest, node: int | None) -> DecodeSim | None:
        fits = [w for w in self.decode if w.blocks.blocks_for(req) <= w.blocks.num_total]
        if self.config.is_node_local and node is not None:
            fits = [w for w in fits if w.node == node] or fits
        return min(fits, default=None,
                   key=lambda w: (not w.blocks.can_allocate(req), w.num_assigned, -w.blocks.num_free))

    # lifecycle events
    def _prefilled(self, req: SimRequest, prefill: PrefillSim) -> None:
        req.first_token_s, req.num_generated = self.loop.now, 1
        self._first_token(req)
        if req.decode_worker is None:  # prefill-only fleet
            self._finish_at_first_token(req)
        else:
            self._to_decode(req, req.decode_worker, prefill)

    def _to_decode(self, req: SimRequest, decode: DecodeSim, prefill: PrefillSim | None) -> None:
        if req.output_len <= 1:
            decode.num_assigned -= 1
            self._finish_at_first_token(req)
        elif prefill is None:
            decode.blocks.reserve(req, lambda: decode.add(req))
        else:
            seconds = self._transfer_seconds(req, prefill, decode)
            decode.blocks.reserve(req, lambda: prefill.send(seconds, lambda: decode.add(req)))

    def _transfer_seconds(self, req: SimRequest, prefill: PrefillSim, decode: DecodeSim) -> float:
        num_bytes = req.input_len * prefill.profile.kv_bytes_per_token
        if prefill.node == decode.node:
            return prefill.profile.transfer_time(num_bytes)
        return self.config.inter_node_latency_s + num_bytes / self.config.inter_node_bytes_per_s

    def _finish_at_first_token(self, req: SimRequest) -> None:
        req.finish_s = self.loop.now
        self._finished(req)

    # SLO bookkeeping, for stopping early
    def _first_token(self, req: SimRequest) -> None:
        if self.slo and req.first_token_s - req.arrival_s + self.config.router_overhead_s > self.slo.ttft_s:
            self._miss(req)

    def _finished(self, req: SimRequest) -> None:
        if self.slo and _tpot(req) > self.slo.tpot_s:
            self._miss(req)

    def _miss(self, req: SimRequest) -> None:
        if not self.is_miss[req.index]:
            self.is_miss[req.index] = True
            self.num_misses += 1
            if self.num_misses > self.max_misses:
                self.loop.is_stopped = True


def _tpot(req: SimRequest) -> float:
    if req.output_len <= 1 or req.finish_s == req.first_token_s:  # one token, or a prefill-only fleet
        return 0.0
    return (req.finish_s - req.first_token_s) / (req.output_len - 1)


def _result(req: SimRequest, overhead_s: float) -> RequestResult:
    if req.first_token_s is None:
        return RequestResult(math.inf, math.inf, math.inf)
    ttft = req.first_token_s - req.arrival_s + overhead_s
    if req.finish_s is None:
        return RequestResult(ttft, math.inf, math.inf)
    return RequestResult(ttft, _tpot(req), req.finish_s - req.arrival_s + overhead_s)
