"""Profiles for hardware we do not have, from a roofline: SIMULATED, not measured.

A step's time on a worker with tensor-parallel degree tp (GPUs per worker):

    t = max(compute, memory) + all-reduce + overhead
    compute = (2 * params * rows + 4 * hidden * layers * attn_pairs) / (peak * mfu * tp)
    memory  = (weight_bytes + kv_bytes_per_token * decode_context) / (hbm_bandwidth * mbu * tp)
    all-reduce = tp > 1: 2 per layer, each latency + 2 (tp-1)/tp * rows * hidden * bytes / link_bandwidth

rows = prompt tokens + decoding sequences; attn_pairs = the (query, key) pairs prompt chunks touch
(chunk n at position p: n * (p + n)) plus each decoding sequence's context; decode attention reads
the whole KV cache, which is why its context also appears under memory. The weight-streaming floor
(weight_bytes / bandwidth / tp) is the constant term every step pays; prefill becomes compute-bound
past about peak*mfu / (bandwidth*mbu) rows. Pipeline parallelism is not modelled: one worker is one
tensor-parallel group inside one node.
"""

from __future__ import annotations

import dataclasses

from distserve.planner.profile import Profile, StepShape

ACTIVATION_RESERVE_BYTES = 4e9  # per GPU: activations, CUDA graphs, allocator slack
DEFAULT_GPU_BATCH_TOKENS = 2048  # prefill budget: past saturation on these GPUs, below a long prompt


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    kv_heads: int = 0  # 0: as many as heads (no grouped-query attention)
    bytes_per_param: int = 2  # bf16
    mlp_matrices: int = 3  # Llama's gate, up and down; 2 for OPT's fc1 and fc2

    @property
    def num_params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * (self.kv_heads or self.heads) * head_dim
        mlp = self.mlp_matrices * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden  # + embedding and LM head

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * (self.kv_heads or self.heads) * (self.hidden // self.heads) * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per GPU
    hbm_bytes_per_s: float
    hbm_bytes: float
    intra_node_bytes_per_s: float  # per GPU (NVLink)
    inter_node_bytes_per_s: float  # between two nodes
    mfu: float = 0.5  # achieved fraction of peak FLOP/s
    mbu: float = 0.8  # achieved fraction of HBM bandwidth
    allreduce_latency_s: float = 10e-6
    step_overhead_s: float = 1e-3  # scheduling, kernel launches, sampling per step
    transfer_latency_s: float = 100e-6


A100_80GB = Hardware("A100-80GB", peak_flops=312e12, hbm_bytes_per_s=2.0e12, hbm_bytes=80e9,
                     intra_node_bytes_per_s=300e9, inter_node_bytes_per_s=25e9)
LLAMA_13B = ModelShape("llama-13b", hidden=5120, layers=40, heads=40, intermediate=13824, vocab=32000)
HARDWARE = {"a100-80gb": A100_80GB}
# OPT-13B (the DistServe paper's chatbot model; facebook/opt-13b config.json). Its tied embedding is counted
# twice (as for the untied Llamas), 0.5 of ~26 GB: within the roofline's own error.
OPT_13B = ModelShape("opt-13b", hidden=5120, layers=40, heads=40, intermediate=20480, vocab=50272, mlp_matrices=2)
MODELS = {"llama-13b": LLAMA_13B, "opt-13b": OPT_13B,
          "llama-7b": ModelShape("llama-7b", hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32000)}


@dataclasses.dataclass(frozen=True)
class RooflineTerms:
    """Seconds per unit of work on one worker of `tp` GPUs."""

    weight_s: float  # streaming all weights once: weight_bytes / (bandwidth * mbu) / tp
    row_flop_s: float  # one row through every matmul: 2 * params / (peak * mfu) / tp
    pair_flop_s: float  # one (query, key) pair, all layers: 4 * hidden * layers / (peak * mfu) / tp
    kv_read_s: float  # one cached token's K and V read by a decode step
    allreduce_step_s: float  # all-reduce latency per step (2 per layer), 0 at tp=1
    allreduce_row_s: float  # all-reduce bytes per row, 0 at tp=1
    overhead_s: float

    @property
    def const_s(self) -> float:
        """What every step pays whatever its size (the linear model's c_step)."""
        return self.weight_s + self.allreduce_step_s + self.overhead_s

    def step_s(self, prompt_tokens: int, prompt_attn: int, num_decode: int, decode_context: int) -> float:
        rows = prompt_tokens + num_decode
        compute = rows * self.row_flop_s + (prompt_attn + decode_context) * self.pair_flop_s
        memory = self.weight_s + decode_context * self.kv_read_s
        return max(compute, memory) + self.allreduce_step_s + rows * self.allreduce_row_s + self.overhead_s


def roofline_terms(model: ModelShape, hw: Hardware, tp: int) -> RooflineTerms:
    flops, bandwidth = hw.peak_flops * hw.mfu * tp, hw.hbm_bytes_per_s * hw.mbu * tp
    ring = 2 * (tp - 1) / tp  # bytes each GPU moves per byte all-reduced (ring)
    return RooflineTerms(
        weight_s=model.weight_bytes / bandwidth,
        row_flop_s=2 * model.num_params / flops,
        pair_flop_s=4 * model.hidden * model.layers / flops,
        kv_read_s=model.kv_bytes_per_token / bandwidth,
        allreduce_step_s=2 * model.layers * hw.allreduce_latency_s if tp > 1 else 0.0,
        allreduce_row_s=2 * model.layers * ring * model.hidden * model.bytes_per_param / hw.intra_node_bytes_per_s,
        overhead_s=hw.step_overhead_s)


@dataclasses.dataclass
class RooflineProfile(Profile):
    """A Profile whose step time is the roofline above (step_coeffs hold its additive upper bound,
    for readers of the saved form). In memory only: Profile.load reads it back as a linear profile."""

    terms: RooflineTerms | None = None

    def step_time(self, shape: StepShape) -> float:
        prompt_attn = shape.prompt_attn
        return self.step_time_from_totals(shape.num_tokens - len(shape.decode_contexts), prompt_attn,
                                          len(shape.decode_contexts), sum(shape.decode_contexts))

    def step_time_from_totals(self, prompt_tokens: int, prompt_attn: int, num_decode: int,
                              decode_context: int) -> float:
        return self.terms.step_s(prompt_tokens, prompt_attn, num_decode, decode_context)

    def save(self, path) -> None:
        plain = Profile(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Profile)})
        plain.save(path)


def roofline_profile(model: ModelShape, hw: Hardware, tp: int,
                     max_batch_tokens: int = DEFAULT_GPU_BATCH_TOKENS) -> RooflineProfile | None:
    """A simulated profile of one worker of `tp` GPUs, or None when the weights do not fit."""
    kv_bytes = tp * (hw.hbm_bytes - ACTIVATION_RESERVE_BYTES) - model.weight_bytes
    if kv_bytes <= 0 or model.heads % tp:
        return None
    terms = roofline_terms(model, hw, tp)
    coeffs = (terms.const_s, terms.row_flop_s + terms.allreduce_row_s, terms.pair_flop_s,
              terms.pair_flop_s + terms.kv_read_s, 0.0)
    return RooflineProfile(
        model=model.name, dtype="bfloat16", device="cuda", cores_per_worker=tp,
        kv_bytes_per_token=model.kv_bytes_per_token, kv_capacity_tokens=int(kv_bytes // model.kv_bytes_per_token),
        max_batch_tokens=max_batch_tokens, step_coeffs=coeffs, transfer_latency_s=hw.transfer_latency_s,
        # each GPU of the prefill group sends its own KV shard over its own link
        transfer_bytes_per_s=hw.intra_node_bytes_per_s * tp,
        host=f"SIMULATED roofline: {hw.name} x{tp} (tensor parallel), mfu {hw.mfu}, mbu {hw.mbu}", terms=terms)


def roofline_profiles(model: ModelShape, hw: Hardware, tps: tuple[int, ...] = (1, 2, 4, 8),
                      max_batch_tokens: int = DEFAULT_GPU_BATCH_TOKENS) -> list[RooflineProfile]:
    """One simulated profile per tensor-parallel degree that fits the model."""
    profiles = [roofline_profile(model, hw, tp, max_batch_tokens) for tp in tps]
    return [p for p in profiles if p is not None]
