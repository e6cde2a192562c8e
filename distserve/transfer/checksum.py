"""CRC32C of a KV buffer: the prefill worker computes it once when it holds the KV, the decode worker
verifies the bytes it pulled against it before they enter its cache. Chunk checksums (ChunkChecksums)
verify a pull of part of the buffer: a suffix, when the puller holds the prompt's first tokens already.

Reads the tensor's memory in place (no copy): ~44 µs per MiB on one core with the hardware
instruction (benchmarks/kv_checksum.py, results in benchmarks/results/kv_checksum.json).
"""

from __future__ import annotations

import dataclasses

import google_crc32c
import numpy as np
import torch


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor, for any dtype (bf16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def kv_crc32c(tensor: torch.Tensor) -> int:
    """CRC32C (Castagnoli) of the tensor's bytes."""
    return google_crc32c.value(byte_view(tensor))


# Tokens per checksummed chunk of a held KV buffer. A puller that already holds a prompt's first tokens
# (a cached prefix) pulls from a chunk boundary on and verifies each chunk it pulled.
CHUNK_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class ChunkChecksums:
    """CRC32C of each run of `chunk_tokens` tokens of a KV buffer [L, 2, T, Hkv, D] (the last run may be
    shorter), each over the run's bytes in (layer, key/value) order: any suffix that starts at a chunk
    boundary can be verified chunk by chunk, against checksums computed where the KV was made."""

    chunk_tokens: int
    crcs: tuple[int, ...]

    @classmethod
    def of(cls, kv: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS) -> "ChunkChecksums":
        return cls(chunk_tokens, tuple(_chunk_crcs(kv, chunk_tokens)))

    def matches(self, suffix: torch.Tensor, from_token: int) -> bool:
        """Whether suffix [L, 2, T - from_token, Hkv, D] holds tokens [from_token, T) of the buffer these
        checksums were computed on; from_token must be a chunk boundary."""
        if from_token % self.chunk_tokens:
            raise ValueError(f"from_token {from_token} is not a multiple of {self.chunk_tokens}")
        first = from_token // self.chunk_tokens
        return _chunk_crcs(suffix, self.chunk_tokens) == list(self.crcs[first:])


def _chunk_crcs(kv: torch.Tensor, chunk_tokens: int) -> list[int]:
    planes = byte_view(kv).reshape(kv.shape[0] * kv.shape[1], -1)  # [L * 2, T * token bytes], in place
    token_bytes = planes.shape[1] // kv.shape[2]
    crcs = []
    for start in range(0, kv.shape[2], chunk_tokens):
        lo, hi, crc = start * token_bytes, min(start + chunk_tokens, kv.shape[2]) * token_bytes, 0
        for plane in planes:
            crc = google_crc32c.extend(crc, plane[lo:hi])
        crcs.append(crc)
    return crcs


def pulled_intact(out: torch.Tensor, expected: int | ChunkChecksums | None, from_token: int = 0) -> bool:
    """Whether bytes pulled into out match what the holder registered: the whole buffer's CRC32C, or the
    chunk checksums for a pull from from_token on (None: nothing to check)."""
    if expected is None:
        return True
    if isinstance(expected, ChunkChecksums):
        return expected.matches(out, from_token)
    if from_token:
        raise ValueError("a whole-buffer CRC32C cannot verify a partial pull")
    return kv_crc32c(out) == expected
