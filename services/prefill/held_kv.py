"""KV buffers this worker holds for decode workers, each until released or expired.

Each buffer is held with the secret a puller must present (never sent to the broker) and the CRC32C
of its bytes, computed once here; the bytes held stay under a cap (`can_hold` before `add`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time

import torch

from distserve.transfer.checksum import ChunkChecksums, kv_crc32c

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Held:
    kv: torch.Tensor
    secret: str
    crc32c: int
    chunks: ChunkChecksums
    expires_at: float

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class HeldKv:
    """handle id -> KV tensor [L, 2, T, H, D], its secret and checksum. Freeing is idempotent."""

    def __init__(self, max_bytes: int) -> None:
        """max_bytes: the most KV bytes held at once."""
        self.max_bytes = max_bytes
        self._held: dict[str, _Held] = {}
        self._num_bytes = 0

    def can_hold(self, num_bytes: int) -> bool:
        return self._num_bytes + num_bytes <= self.max_bytes

    def is_holding(self, handle_id: str) -> bool:
        return handle_id in self._held

    def add(self, handle_id: str, kv: torch.Tensor, lease_s: float, secret: str = "") -> int:
        """Holds kv for pullers presenting `secret` ("": for none: a local use) until freed or lease_s has passed;
        returns its CRC32C (its chunk checksums: chunk_checksums). The caller checks `is_holding` and `can_hold` first."""
        num_bytes = kv.numel() * kv.element_size()
        if self.is_holding(handle_id) or not self.can_hold(num_bytes):
            raise ValueError(f"cannot hold {handle_id}: already held, or {num_bytes} bytes over the cap")
        held = _Held(kv, secret, kv_crc32c(kv), ChunkChecksums.of(kv), time.monotonic() + lease_s)
        self._held[handle_id] = held
        self._num_bytes += held.num_bytes
        return held.crc32c

    def chunk_checksums(self, handle_id: str) -> ChunkChecksums | None:
        """The held KV's chunk checksums, for pullers of a part of it."""
        held = self._held.get(handle_id)
        return held.chunks if held else None

    def lookup(self, handle_id: str) -> torch.Tensor | None:
        held = self._held.get(handle_id)
        return held.kv if held else None

    def admits(self, handle_id: str, secret: str) -> bool:
        """Whether a puller presenting `secret` may pull the handle (constant-time compare); a handle held
        without a secret admits no puller, so an empty secret never opens one."""
        held = self._held.get(handle_id)
        return held is not None and bool(held.secret) and hmac.compare_digest(held.secret.encode(), secret.encode())

    def free(self, handle_id: str) -> bool:
        held = self._held.pop(handle_id, None)
        if held is None:
            return False
        self._num_bytes -= held.num_bytes
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

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
