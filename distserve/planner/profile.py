"""Latency models of one worker on one piece of hardware: what `distserve profile` writes and
`distserve plan` reads.

A profile holds, for one (model, dtype, device, cores per worker), least-squares fits of:

- a forward step's time from its shape. One model covers prefill, decode and mixed (colocated)
  steps: every step is a packed batch of rows through the same weights, then attention:

      t = c_step + c_token * num_tokens + c_prompt_attn * prompt_attn
          + c_decode_context * decode_context + c_decode * num_decode

  `num_tokens` counts every row (prompt-chunk tokens plus one per decoding sequence);
  `prompt_attn` is the number of (query, key) pairs prompt attention computes (compute-bound; see
  `chunk_attn_pairs`); `decode_context` is the sum of the decoding
  sequences' context lengths (each token's K/V is read once: memory-bound, measured 6-14x the
  cost of a prompt pair, hence its own term); `num_decode` is the number of decoding sequences
  (per-sequence bookkeeping: sampling, block tables). The constant is the weight-streaming floor,
  paid once per step whatever its size.
- a KV transfer's time from its bytes: t = c_latency + num_bytes / bytes_per_s.

Fits and their raw samples are kept side by side, so a reader can judge the fit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

STEP_FEATURES = ("const", "num_tokens", "prompt_attn", "decode_context", "num_decode")
PROFILE_VERSION = 2  # 1 had one attention term for prompt pairs and decode context alike


def chunk_attn_pairs(length: int, position: int) -> int:
    """(query, key) pairs the engine's prompt attention computes for a chunk of `length` tokens at
    `position`: a first chunk runs SDPA with is_causal, which skips the masked half (n^2 / 2); a later
    chunk runs it with an explicit mask over all n * (p + n) pairs (engine/attention.py)."""
    return length * (length + 1) // 2 if position == 0 else length * (position + length)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The shape of one forward step."""

    chunks: tuple[tuple[int, int], ...] = ()  # prompt chunks as (length, position)
    decode_contexts: tuple[int, ...] = ()  # context length of each decoding sequence

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.chunks) + len(self.decode_contexts)

    @property
    def prompt_attn(self) -> int:
        return sum(chunk_attn_pairs(n, p) for n, p in self.chunks)

    @property
    def decode_context(self) -> int:
        return sum(self.decode_contexts)

    @property
    def attn_work(self) -> int:
        return self.prompt_attn + self.decode_context

    def features(self) -> list[float]:
        return [1.0, float(self.num_tokens), float(self.prompt_attn), float(self.decode_context),
                float(len(self.decode_contexts))]


@dataclasses.dataclass(frozen=True)
class StepSample:
    shape: StepShape
    seconds: float


def fit_step_model(samples: list[StepSample]) -> tuple[float, ...]:
    """Non-negative least squares over STEP_FEATURES, weighted by 1/seconds (relative error)."""
    x = np.array([s.shape.features() for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / np.maximum(y, 1e-6)
    coeffs = _nnls(x * w[:, None], y * w)
    return tuple(float(c) for c in coeffs)


def fit_transfer_model(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) from (num_bytes, seconds) samples."""
    x = np.array([[1.0, b] for b, _ in samples])
    y = np.array([s for _, s in samples])
    w = 1.0 / np.maximum(y, 1e-6)
    latency, per_byte = _nnls(x * w[:, None], y * w)
    return float(latency), float(1.0 / per_byte) if per_byte > 0 else float("inf")


def _nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Least squares with coefficients clamped at zero (active-set by repeated refits: the
    feature count is tiny, so this converges in a few rounds)."""
    active = np.ones(a.shape[1], dtype=bool)
    coeffs = np.zeros(a.shape[1])
    for _ in range(iterations):
        coeffs[:] = 0.0
        coeffs[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = active & (coeffs < 0)
        if not negative.any():
            return coeffs
        active &= ~negative
    return np.maximum(coeffs, 0.0)


@dataclasses.dataclass
class Profile:
    """Measured latency models of one worker. Times are seconds."""

    model: str  # model folder name (or default:small, ...)
    dtype: str  # float32 | bfloat16
    device: str  # cpu | cuda
    cores_per_worker: int  # CPU cores (torch threads) the worker ran on; GPUs per worker on CUDA
    kv_bytes_per_token: int  # bytes of K and V for one token, all layers
    kv_capacity_tokens: int  # tokens a decode worker's KV cache holds at its default size
    max_batch_tokens: int  # the prefill token budget the worker uses by default (saturation length)
    step_coeffs: tuple[float, ...]  # over STEP_FEATURES (a version-1 4-tuple is upgraded)
    transfer_latency_s: float
    transfer_bytes_per_s: float
    step_samples: list[StepSample] = dataclasses.field(default_factory=list)
    transfer_samples: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    host: str = ""  # machine description, for the reader
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if len(self.step_coeffs) == 4:  # version 1: one attention coefficient for both kinds
            const, token, attn, decode = self.step_coeffs
            self.step_coeffs = (const, token, attn, attn, decode)
        if len(self.step_coeffs) != len(STEP_FEATURES):
            raise ValueError(f"step_coeffs: {len(self.step_coeffs)} values, expected {len(STEP_FEATURES)} "
                             f"({', '.join(STEP_FEATURES)})")
        self.version = PROFILE_VERSION

    def step_time(self, shape: StepShape) -> float:
        return float(np.dot(self.step_coeffs, shape.features()))

    def prefill_time(self, chunks: list[tuple[int, int]]) -> float:
        """A packed prefill step of (length, position) chunks."""
        return self.step_time(StepShape(chunks=tuple(chunks)))

    def decode_time(self, contexts: list[int]) -> float:
        """A decode step over sequences with these context lengths."""
        return self.step_time(StepShape(decode_contexts=tuple(contexts)))

    def transfer_time(self, num_bytes: int) -> float:
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s

    def save(self, path: str | Path) -> None:
        data = dataclasses.asdict(self)
        data["step_features"] = list(STEP_FEATURES)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        data = json.loads(Path(path).read_text())
        if data.get("version") not in (1, PROFILE_VERSION):
            raise ValueError(f"{path}: profile version {data.get('version')} is not 1 or {PROFILE_VERSION}")
        data.pop("step_features", None)
        data["step_coeffs"] = tuple(data["step_coeffs"])
        data["step_samples"] = [StepSample(StepShape(tuple(map(tuple, s["shape"]["chunks"])),
                                                     tuple(s["shape"]["decode_contexts"])), s["seconds"])
                                for s in data.get("step_samples", [])]
        data["transfer_samples"] = [tuple(s) for s in data.get("transfer_samples", [])]
        return cls(**data)
