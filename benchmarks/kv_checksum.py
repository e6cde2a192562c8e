"""What KV integrity costs: CRC32C of a held KV buffer (prefill, once when holding) and its check after
a pull (decode, before the bytes enter the cache), per MiB, and a real UCX pull with and without it.

    python -m benchmarks.kv_checksum --out benchmarks/results/kv_checksum.json

The checksum reads the tensor's memory in place (a uint8 numpy view); copying it to bytes first, as
google_crc32c's read-only-buffer rule would suggest, is measured too.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import google_crc32c
import torch

from benchmarks.results_io import write_results
from distserve.transfer.checksum import byte_view, kv_crc32c

MIB = 1 << 20


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm: page in the buffer
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def checksum_costs(size_mib: int, dtype: torch.dtype, repeats: int) -> dict:
    kv = torch.randn(size_mib * MIB // 4).to(dtype)  # a prompt's KV of size_mib (bf16: half)
    num_mib = kv.numel() * kv.element_size() / MIB
    compute = best_seconds(lambda: kv_crc32c(kv), repeats)
    expected = kv_crc32c(kv)
    verify = best_seconds(lambda: kv_crc32c(kv) == expected, repeats)
    copying = best_seconds(lambda: google_crc32c.value(bytes(byte_view(kv))), repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "mib": num_mib,
            "compute_us_per_mib": compute / num_mib * 1e6, "verify_us_per_mib": verify / num_mib * 1e6,
            "via_bytes_copy_us_per_mib": copying / num_mib * 1e6}


async def pull_costs(size_mib: int, repeats: int) -> dict:
    from distserve.transfer.ucx_transfer import KvReceiver, KvSender, init_ucx

    init_ucx()
    kv = torch.randn(size_mib * MIB // 4)
    sender = KvSender(lookup=lambda handle_id: kv, on_sent=lambda *args: None)
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    out = torch.empty_like(kv)
    try:
        async def best(crc32c):
            await receiver.fetch(address, "h", out, 60, crc32c=crc32c)  # warm: endpoint open
            return min([await receiver.fetch(address, "h", out, 60, crc32c=crc32c) for _ in range(repeats)])

        plain, checked = await best(None), await best(kv_crc32c(kv))
    finally:
        await receiver.close()
        sender.stop()
    return {"mib": size_mib, "pull_ms": plain * 1e3, "pull_with_verify_ms": checked * 1e3,
            "verify_share": (checked - plain) / checked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,4,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/kv_checksum.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    torch.set_num_threads(1)
    checksums = [checksum_costs(s, dtype, args.repeats) for s in sizes for dtype in (torch.float32, torch.bfloat16)]
    pulls = asyncio.run(_pulls(sizes, args.repeats))
    result = {"checksum": checksums, "ucx_loopback_pull": pulls, "implementation": google_crc32c.implementation,
              "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_results(args.out, result)


async def _pulls(sizes: list[int], repeats: int) -> list[dict]:
    from distserve.transfer.ucx_transfer import stop_ucx

    try:
        return [await pull_costs(s, repeats) for s in sizes]
    finally:
        stop_ucx()


if __name__ == "__main__":
    main()
