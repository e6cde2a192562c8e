"""When the prefill/decode pairs count as saturated: the one rule the router and the launcher share.

The router sends whole requests to spill-only colocated workers (prefill and decode workers started
with also_colocated) only past these marks (services.router.picker); `distserve up` lets the control
plane leave its cores past them (distserve.control_placement).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class SpillPolicy:
    prefill_tokens: int = 1024  # the least-loaded prefill worker has this many prompt tokens outstanding (0: never)
    decode_running: int = 32  # or the least-loaded decode worker has this many sequences (0: never)

    ENV = {"prefill_tokens": "DISTSERVE_ROUTER_SPILL_PREFILL_TOKENS",
           "decode_running": "DISTSERVE_ROUTER_SPILL_DECODE_RUNNING"}

    def saturated(self, queued_tokens: float, running: float) -> bool:
        """Whether a pair whose prefill side has queued_tokens outstanding and whose decode side runs
        `running` sequences is past either mark."""
        return bool(self.saturated_sides(queued_tokens, running))

    def saturated_sides(self, queued_tokens: float, running: float) -> frozenset[str]:
        """Which of the pair's sides ("prefill", "decode") are past their marks (empty: neither)."""
        sides = set()
        if self.prefill_tokens and queued_tokens >= self.prefill_tokens:
            sides.add("prefill")
        if self.decode_running and running >= self.decode_running:
            sides.add("decode")
        return frozenset(sides)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SpillPolicy":
        """The router's marks as its environment sets them (the router's own settings, same names)."""
        return cls(**{field: int(env[name]) for field, name in cls.ENV.items() if name in env})
