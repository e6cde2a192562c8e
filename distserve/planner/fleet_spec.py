"""Fleet strings: a compact name for a configuration, on the command line and in reports.

Grammar: one or more groups, optionally separated by '+', ',' or spaces:

    <count><role>[@<devices>][:<budget>]

- role: p (prefill), d (decode), c (colocated);
- devices: cores (CPU) or GPUs per worker; picks the profile measured at that size
  (default: the smallest size among the profiles given);
- budget: the prefill/colocated token budget per step (default: the profile's max_batch_tokens).

Examples: "1p1d", "2c", "1p1d1c", "2p@1:512+1d@2", "1p@4 2d@2".
"""

from __future__ import annotations

import itertools
import re

from distserve.planner.profile import Profile
from distserve.planner.simulator import WorkerSpec

ROLE_LETTERS = {"p": "prefill", "d": "decode", "c": "colocated"}
_GROUP = re.compile(r"(\d+)([pdc])(?:@(\d+))?(?::(\d+))?")
_SEPARATORS = re.compile(r"[\s+,]*")


def profiles_by_size(profiles: list[Profile]) -> dict[int, Profile]:
    """Profiles keyed by cores (GPUs) per worker; two profiles of one size are an error."""
    by_size: dict[int, Profile] = {}
    for profile in profiles:
        if profile.cores_per_worker in by_size:
            raise ValueError(f"two profiles for {profile.cores_per_worker} cores per worker")
        by_size[profile.cores_per_worker] = profile
    if not by_size:
        raise ValueError("no profiles given")
    return by_size


def parse_workers(text: str, profiles: list[Profile], max_running: int = 64) -> list[WorkerSpec]:
    """The workers a fleet string names, in the order written."""
    by_size = profiles_by_size(profiles)
    workers, pos = [], _SEPARATORS.match(text).end()
    while pos < len(text):
        match = _GROUP.match(text, pos)
        if not match:
            raise ValueError(f"fleet {text!r}: cannot read {text[pos:]!r}; expected e.g. 1p1d, 2c, 2p@1:512+1d@2")
        count, letter, size, budget = match.groups()
        size = int(size) if size else min(by_size)
        if size not in by_size:
            raise ValueError(f"fleet {text!r}: no profile for {size} per worker (have {sorted(by_size)})")
        spec = WorkerSpec(ROLE_LETTERS[letter], by_size[size], int(budget or 0), max_running)
        workers += [spec] * int(count)
        pos = _SEPARATORS.match(text, match.end()).end()
    if not workers:
        raise ValueError(f"fleet {text!r} names no workers")
    return workers


def _group_key(w: WorkerSpec) -> tuple:
    return w.role, w.devices, w.budget if w.role != "decode" else 0


def format_workers(workers: list[WorkerSpec] | tuple[WorkerSpec, ...]) -> str:
    """The canonical fleet string (parse_workers reads it back), e.g. "2p@1:512+1d@1"."""
    groups = []
    for (role, devices, budget), same in itertools.groupby(workers, key=_group_key):
        suffix = f":{budget}" if role != "decode" else ""
        groups.append(f"{len(list(same))}{role[0]}@{devices}{suffix}")
    return "+".join(groups)


def describe_workers(workers: list[WorkerSpec] | tuple[WorkerSpec, ...], unit: str = "core") -> str:
    """For people, e.g. "2 prefill x 1 core (512-token batches) + 1 decode x 1 core"."""
    parts = []
    for (role, devices, budget), same in itertools.groupby(workers, key=_group_key):
        text = f"{len(list(same))} {role} x {devices} {unit}{'s' if devices > 1 else ''}"
        parts.append(text + (f" ({budget}-token batches)" if role != "decode" else ""))
    return " + ".join(parts)
