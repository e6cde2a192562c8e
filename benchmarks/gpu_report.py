"""The engine on one CUDA device against its limits: a report, no thresholds (scripts/gpu_check.sh runs it).

    python -m benchmarks.gpu_report --models default:small default:qwen-0.5b-shape --dtype bfloat16 \
        --out benchmarks/results/gpu/report.json

Per model, on the current device:
- HBM bandwidth: reading a 2 GiB tensor (sum), best of several;
- decode steps at batch 1 and 32 (context 256): the weight-streaming roofline is weight bytes / bandwidth,
  and the step reaches roofline / step time of it (batch 32 also reads 32 sequences' KV);
- prefill tokens/s against prompt length (256 .. 8192): where it stops growing is the device's
  saturation length (the engine's CUDA_SATURATION_TOKENS guess is 8192, never measured before);
- the KV transfer path as it stands: a prompt's KV copied device -> host -> device (what host staging
  costs a prefill/decode pair on one node), GB/s.
Times are CUDA-synchronised wall times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.engine_roofline import decode_batch
from benchmarks.results_io import write_results
from distserve.engine.model_loader import load_engine_model, resolve_model_path
from distserve.engine.model_runner import ModelRunner


def timed(fn, repeats: int, warmup: int = 2, stat=statistics.median) -> float:
    """stat of fn's wall time over repeats, after warmup calls, each waited for on the device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return stat(times)


def hbm_bandwidth_gbps() -> float:
    data = torch.ones(512 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 2 GiB
    return data.numel() * 4 / timed(data.sum, 10, stat=min) / 1e9


def host_staging_gbps(num_bytes: int) -> float:
    """A KV buffer of num_bytes copied device -> pinned host -> device, as prefill and decode stage it."""
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(device)
    return num_bytes / timed(lambda: (host.copy_(device), back.copy_(host)), 5) / 1e9


def model_report(model: str, dtype: str, bandwidth: float) -> dict:
    runner = ModelRunner(load_engine_model(resolve_model_path(model), dtype, "cuda"))
    weight_bytes = runner.model.weights.num_bytes
    roofline_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    steps = {str(b): timed(decode_batch(runner, b, 256), 20) * 1e3 for b in (1, 32)}
    prefill = {}
    for length in (256, 1024, 2048, 4096, 8192):
        prompt = list(range(10, 10 + length))
        prefill[str(length)] = length / timed(lambda: runner.prefill([prompt]), 3, warmup=1)
    a = runner.model.args
    kv_bytes_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * runner.model.dtype.itemsize
    return {
        "weight_bytes": weight_bytes, "decode_roofline_ms": roofline_ms,
        "decode_step_ms_at_context_256": steps,
        "decode_fraction_of_roofline": {b: roofline_ms / ms for b, ms in steps.items()},
        "prefill_tokens_per_s_by_prompt_length": prefill,
        "kv_bytes_per_token": kv_bytes_per_token,
        "host_staging_gbps_1024_token_prompt": host_staging_gbps(1024 * kv_bytes_per_token),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default:small", "default:qwen-0.5b-shape"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_report needs a CUDA device")
    bandwidth = hbm_bandwidth_gbps()
    write_results(args.out, {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
        "hbm_bandwidth_gbps": bandwidth,
        "models": {model: model_report(model, args.dtype, bandwidth) for model in args.models},
        "not_measured": "device-to-device KV transfer (UCX cuda_ipc): not built yet; KV is staged through the host",
    })


if __name__ == "__main__":
    main()
