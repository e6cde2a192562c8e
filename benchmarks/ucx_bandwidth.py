"""UCX KV transfer bandwidth between two processes, through the project's KvSender/KvReceiver.

    python -m benchmarks.ucx_bandwidth --sizes-mb 1 16 64 256 --repeats 5 --out benchmarks/results/ucx_bandwidth.json

The sender process holds one buffer per size; the receiver pulls each `repeats`
times over one endpoint (as a decode worker does) and records seconds and GB/s.
The first pull of a run includes endpoint set-up and is reported separately.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch

from benchmarks.results_io import write_results


def _kv_shape(mb: int) -> tuple[int, ...]:
    """A KV buffer's shape ([L, 2, T, Hkv, D], as a prefill worker holds it) of `mb` MiB in float32: the
    sender reads its token axis (partial pulls)."""
    return (1, 2, mb * 1024 * 1024 // 4 // (2 * 8 * 64), 8, 64)


def _sender(sizes_mb: list[int], port_queue, stop_event) -> None:
    from distserve.transfer.ucx_transfer import KvSender, stop_ucx

    buffers = {f"h{mb}": torch.ones(_kv_shape(mb), dtype=torch.float32) for mb in sizes_mb}

    async def main():
        sender = KvSender(lookup=buffers.get, on_sent=lambda handle_id, num_bytes, seconds: None)
        port_queue.put(sender.start())
        while not stop_event.is_set():
            await asyncio.sleep(0.05)
        sender.stop()
        stop_ucx()

    asyncio.run(main())


async def _receive(port: int, sizes_mb: list[int], repeats: int) -> dict:
    from distserve.transfer.ucx_transfer import KvReceiver, init_ucx, stop_ucx

    init_ucx()  # as a decode worker does at start-up
    receiver = KvReceiver()
    address = f"127.0.0.1:{port}"
    warm = torch.empty(_kv_shape(1))
    results = {"first_pull_s_1mb_incl_connect": await receiver.fetch(address, "h1", warm, 60) if 1 in sizes_mb else None}
    rows = []
    for mb in sizes_mb:
        out = torch.empty(_kv_shape(mb), dtype=torch.float32)
        seconds = [await receiver.fetch(address, f"h{mb}", out, 120) for _ in range(repeats)]
        assert bool((out == 1).all()), "received bytes differ from the sent buffer"
        best = min(seconds)
        rows.append({"size_mb": mb, "median_s": statistics.median(seconds), "best_s": best,
                     "median_gbps": mb * 1024 * 1024 / statistics.median(seconds) / 1e9,
                     "best_gbps": mb * 1024 * 1024 / best / 1e9})
    await receiver.close()
    stop_ucx()
    results["rows"] = rows
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/ucx_bandwidth.json")
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_sender, args=(args.sizes_mb, port_queue, stop_event))
    proc.start()
    try:
        results = asyncio.run(_receive(port_queue.get(timeout=60), args.sizes_mb, args.repeats))
    finally:
        stop_event.set()
        proc.join(30)
    from distserve.transfer.ucx_transfer import UCX_DEFAULTS

    ucx_env = {**UCX_DEFAULTS, **{k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    results.update({"ucx_env": ucx_env, "machine": platform.machine(),
                    "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    write_results(args.out, results)


if __name__ == "__main__":
    main()
