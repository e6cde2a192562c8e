"""KV buffers this worker holds for decode workers, each until released or expired."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Held:
    kv: torch.Tensor
    expires_at: float


class HeldKv:
    """handle id -> KV tensor [L, 2, H, T, D]. Freeing is idempotent."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def add(self, handle_id: str, kv: torch.Tensor, lease_s: float) -> None:
        self._held[handle_id] = _Held(kv, time.monotonic() + lease_s)

    def lookup(self, handle_id: str) -> torch.Tensor | None:
        held = self._held.get(handle_id)
        return held.kv if held else None

    def free(self, handle_id: str) -> bool:
        return self._held.pop(handle_id, None) is not None

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_bytes(self) -> int:
        return sum(h.kv.numel() * h.kv.element_size() for h in self._held.values())

    def expire(self, now: float | None = None) -> list[str]:
        """Frees every buffer whose lease has passed; returns their handle ids."""
        now = time.monotonic() if now is None else now
        expired = [h for h, held in self._held.items() if held.expires_at <= now]
        for handle_id in expired:
            self.free(handle_id)
        return expired

    async def run_expiry(self, interval_s: float = 1.0) -> None:
        while True:
            for handle_id in self.expire():
                log.warning("kv handle=%s lease expired unclaimed; freed", handle_id)
            await asyncio.sleep(interval_s)
