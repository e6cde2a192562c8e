"""Builds a worker's latency Profile by measuring the real engine on this machine.

measure_profile: load the model as a worker does (resolve_model_path, load_engine_model, warm_up)
-> time step shapes (profile_steps) -> time KV transfers over UCX (profile_transfer) -> fit both
models -> add the worker's defaults (KV capacity of a decode worker, prefill token budget).
The caller has pinned the process (distserve.cpus.apply_cpus) before torch did parallel work, so
the times are those of a worker with the same cores.

fit_errors / format_report say how well the fitted models reproduce their own samples.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
from pathlib import Path

import torch

from distserve.engine.kv_cache import blocks_in_budget
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner
from distserve.engine.dtype import torch_dtype
from distserve.model_spec import load_model_spec
from distserve.engine.prefill_batcher import saturation_tokens
from distserve.planner.profile import (
    STEP_FEATURES,
    Profile,
    StepShape,
    fit_step_model,
    fit_transfer_model,
)
from distserve.planner.profile_steps import measure_steps, step_plan
from distserve.planner.profile_transfer import measure_transfers, transfer_token_counts

log = logging.getLogger(__name__)

GROUPS = ("prefill", "decode", "mixed", "transfer")


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """What to measure and the worker defaults to record."""

    model: str  # as a worker's --model: default[:<preset>] or a Hugging Face folder
    dtype: str  # resolved: one of DTYPE_NAMES
    device: str = "cpu"
    cpus: tuple[int, ...] = ()  # the cores this process is pinned to (empty: its affinity mask)
    quick: bool = False  # few shapes: a smoke test, not a profile to plan with
    max_tokens: int = 2048  # most packed prompt tokens in one prefill step
    repeats: int = 5
    transfer: bool = True  # measure UCX transfers; without, transfer is modelled as free
    kv_cache_mb: int = 1024  # a decode worker's default KV cache (DecodeConfig.kv_cache_mb)
    block_size: int = 16  # DecodeConfig.block_size


def model_label(model: str) -> str:
    """The profile's name for a model: default:<preset> as given, else the folder's name."""
    if not model or model.startswith("default"):
        return f"default:{model.partition(':')[2] or 'small'}"
    return Path(model).name


def kv_capacity_tokens(kv_bytes_per_token: int, kv_cache_mb: int, block_size: int) -> int:
    """Tokens a decode worker's paged cache holds (sized by the engine's blocks_in_budget, as the workers do)."""
    return blocks_in_budget(kv_cache_mb, kv_bytes_per_token, block_size) * block_size


def host_description(device: str, cpus: tuple[int, ...]) -> str:
    """CPU model and the cores used (plus the GPU on CUDA), for the reader of a profile."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.partition(":")[2].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    text = (f"{cpu}; {len(cpus)} of {os.cpu_count()} cores ({','.join(map(str, cpus))}), "
            f"{torch.get_num_threads()} torch threads; torch {torch.__version__}")
    if device.startswith("cuda"):
        text = f"{torch.cuda.get_device_name(torch.device(device))}; {text}"
    return text


def measure_profile(settings: ProfileSettings) -> Profile:
    """Measures and fits (see the module docstring)."""
    path = resolve_model_path(settings.model)
    spec = load_model_spec(path)
    runner = ModelRunner(load_engine_model(path, settings.dtype, settings.device))
    runner.warm_up()
    plan = step_plan(settings.quick, settings.max_tokens, spec.max_context)
    shapes = [*plan.prefill, *plan.decode, *plan.mixed]
    log.info("timing %d step shapes, %d repeats each", len(shapes), settings.repeats)
    samples = measure_steps(runner, shapes, settings.repeats, settings.block_size)
    kv_bytes_per_token = spec.kv_bytes_per_token(torch_dtype(settings.dtype))
    transfers = []
    if settings.transfer:
        counts = transfer_token_counts(kv_bytes_per_token, settings.quick)
        log.info("timing %d KV transfers over UCX", len(counts))
        transfers = measure_transfers((spec.num_layers, spec.num_kv_heads, spec.head_dim), torch_dtype(settings.dtype),
                                      counts, settings.repeats)
    latency, bandwidth = fit_transfer_model(transfers) if transfers else (0.0, float("inf"))
    cpus = settings.cpus or tuple(sorted(os.sched_getaffinity(0)))
    return Profile(
        model=model_label(settings.model), dtype=settings.dtype, device=settings.device,
        cores_per_worker=1 if settings.device.startswith("cuda") else len(cpus),
        kv_bytes_per_token=kv_bytes_per_token,
        kv_capacity_tokens=kv_capacity_tokens(kv_bytes_per_token, settings.kv_cache_mb, settings.block_size),
        max_batch_tokens=saturation_tokens(settings.device), step_coeffs=fit_step_model(samples),
        transfer_latency_s=latency, transfer_bytes_per_s=bandwidth, step_samples=samples,
        transfer_samples=transfers, host=host_description(settings.device, cpus))


def step_group(shape: StepShape) -> str:
    if shape.chunks and shape.decode_contexts:
        return "mixed"
    return "prefill" if shape.chunks else "decode"


@dataclasses.dataclass(frozen=True)
class GroupError:
    """Absolute relative error |predicted / measured - 1| of a group's samples."""

    num_samples: int
    median: float
    max: float


def fit_errors(profile: Profile) -> dict[str, GroupError]:
    """Per group (GROUPS) with samples: how far the profile's fit is from its own samples."""
    errors: dict[str, list[float]] = {group: [] for group in GROUPS}
    for sample in profile.step_samples:
        errors[step_group(sample.shape)].append(abs(profile.step_time(sample.shape) / sample.seconds - 1))
    for num_bytes, seconds in profile.transfer_samples:
        errors["transfer"].append(abs(profile.transfer_time(num_bytes) / seconds - 1))
    return {group: GroupError(len(values), statistics.median(values), max(values))
            for group, values in errors.items() if values}


def format_report(profile: Profile) -> str:
    """The fit and its errors, in lines a reader can judge."""
    coeffs = dict(zip(STEP_FEATURES, profile.step_coeffs))
    lines = [f"profile {profile.model} {profile.dtype} {profile.device} x{profile.cores_per_worker}: {profile.host}",
             "step time = {:.3f} ms + {:.4f} ms/token + {:.3e} ms/prompt attn pair + {:.3e} ms/decode context "
             "token + {:.4f} ms/decode seq".format(
                 coeffs["const"] * 1e3, coeffs["num_tokens"] * 1e3, coeffs["prompt_attn"] * 1e3,
                 coeffs["decode_context"] * 1e3, coeffs["num_decode"] * 1e3),
             f"transfer   = {profile.transfer_latency_s * 1e3:.3f} ms + bytes / "
             f"{profile.transfer_bytes_per_s / 1e9:.3f} GB/s",
             f"kv_bytes_per_token {profile.kv_bytes_per_token}, kv_capacity_tokens {profile.kv_capacity_tokens}, "
             f"max_batch_tokens {profile.max_batch_tokens}",
             "fit error |predicted/measured - 1|:"]
    for group, error in fit_errors(profile).items():
        lines.append(f"  {group:<9} n={error.num_samples:<3} median {error.median:6.1%}  max {error.max:6.1%}")
    lines.append("samples (measured ms, predicted ms):")
    for sample in profile.step_samples:
        lines.append(f"  {step_group(sample.shape):<8} {_describe(sample.shape):<40} "
                     f"{sample.seconds * 1e3:9.2f} {profile.step_time(sample.shape) * 1e3:9.2f}")
    for num_bytes, seconds in profile.transfer_samples:
        lines.append(f"  transfer {num_bytes:>10} bytes{'':<25} {seconds * 1e3:9.3f} "
                     f"{profile.transfer_time(num_bytes) * 1e3:9.3f}")
    return "\n".join(lines)


def _describe(shape: StepShape) -> str:
    parts = []
    if shape.chunks:
        lengths = {n for n, _ in shape.chunks}
        positions = {p for _, p in shape.chunks}
        parts.append(f"{len(shape.chunks)}x{'/'.join(map(str, sorted(lengths)))}"
                     + (f"@{'/'.join(map(str, sorted(positions)))}" if positions != {0} else ""))
    if shape.decode_contexts:
        parts.append(f"decode {len(shape.decode_contexts)}x{max(shape.decode_contexts)}")
    return " + ".join(parts)
