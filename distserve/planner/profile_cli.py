"""`distserve profile`: measure one worker's latency models on this machine and save a Profile.

    distserve profile --model default:small --dtype auto --cpus 0 \
        --out benchmarks/results/profiles/small-bfloat16-1core.json [--quick] [--max-tokens 2048] [--no-transfer]

The measurement runs as a worker would: pinned to --cpus (one torch thread per core), with the
environment the launcher gives workers (OMP_NUM_THREADS and the malloc settings, which glibc
reads only at process start). So unless --in-process is given, `run` starts a child process
with that environment and waits for it. Writes the profile JSON and, beside it, <out>.fit.txt
with the fit and its error per sample group (also printed).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from distserve.config import ConfigError
from distserve.cpus import apply_cpus, parse_cpu_list
from distserve.engine.default_model import MODEL_HELP
from distserve.engine.dtype import DTYPE_CHOICES, resolve_dtype
from distserve.launcher import WORKER_MALLOC_ENV
from distserve.planner.profile import Profile, fit_step_model
from distserve.planner.profiler import ProfileSettings, format_report, measure_profile
from distserve.transfer import connector

log = logging.getLogger(__name__)

DEFAULTS = ProfileSettings(model="default", dtype="auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULTS.model, help=MODEL_HELP)
    parser.add_argument("--dtype", default=DEFAULTS.dtype, choices=DTYPE_CHOICES,
                        help="auto: bfloat16 on CUDA or on CPUs with bf16 instructions, else float32")
    parser.add_argument("--device", default=DEFAULTS.device, help="torch device, e.g. cpu or cuda")
    parser.add_argument("--cpus", default="", help="cores to pin to as a worker would, e.g. 0 or 0-1 "
                                                   "(default: all cores this process may use)")
    parser.add_argument("--out", default="", help="profile JSON (default: "
                                                  "profile-<model>-<dtype>-<device>-<N>core.json here)")
    parser.add_argument("--quick", action="store_true", help="few shapes, 1 repeat: a smoke test")
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens,
                        help="most packed prompt tokens in one prefill step")
    parser.add_argument("--repeats", type=int, default=DEFAULTS.repeats, help="timed runs per shape (median)")
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip UCX transfers; the profile then models transfer as free")
    parser.add_argument("--kv-cache-mb", type=int, default=DEFAULTS.kv_cache_mb,
                        help="decode worker KV cache the capacity is computed for")
    parser.add_argument("--block-size", type=int, default=DEFAULTS.block_size, help="decode worker KV block size")
    parser.add_argument("--refit", default="", metavar="PROFILE",
                        help="measure nothing: refit PROFILE's stored samples with this version's step model "
                             "and rewrite it (and its .fit.txt)")
    parser.add_argument("--in-process", action="store_true",
                        help="measure in this process as it is, without re-starting with a worker's environment")


def run(args: argparse.Namespace) -> int:
    """Measures and saves (see the module docstring); returns an exit status."""
    if args.refit:
        return _refit(Path(args.refit))
    if not args.in_process:
        return _run_child(args)
    try:
        cpus = apply_cpus(args.cpus)  # before torch does parallel work
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = ProfileSettings(
        model=args.model, dtype=resolve_dtype(args.dtype, args.device), device=args.device, cpus=tuple(cpus),
        quick=args.quick, max_tokens=args.max_tokens, repeats=1 if args.quick else args.repeats,
        transfer=not args.no_transfer, kv_cache_mb=args.kv_cache_mb, block_size=args.block_size)
    try:
        profile = measure_profile(settings)
    finally:
        connector.shutdown("ucx")  # UCX's notifier thread would keep the process alive
    out = Path(args.out or default_out_name(profile.model, profile.dtype, profile.device, profile.cores_per_worker))
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    report = format_report(profile)
    fit_path = out.with_suffix(".fit.txt")
    fit_path.write_text(report + "\n")
    print(report)
    print(f"wrote {out} and {fit_path}")
    return 0


def _refit(path: Path) -> int:
    profile = Profile.load(path)
    profile.step_coeffs = fit_step_model(profile.step_samples)
    profile.save(path)
    report = format_report(profile)
    path.with_suffix(".fit.txt").write_text(report + "\n")
    print(report)
    return 0


def default_out_name(model: str, dtype: str, device: str, num_cores: int) -> str:
    name = model.replace("default:", "").replace("/", "-").replace(":", "-")
    return f"profile-{name}-{dtype}-{device}-{num_cores}core.json"


def child_argv(args: argparse.Namespace) -> list[str]:
    """This command's arguments, for the child that measures (with --in-process)."""
    argv = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--cpus", args.cpus,
            "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
            "--kv-cache-mb", str(args.kv_cache_mb), "--block-size", str(args.block_size), "--in-process"]
    argv += ["--out", args.out] if args.out else []
    argv += ["--quick"] if args.quick else []
    argv += ["--no-transfer"] if args.no_transfer else []
    return argv


def worker_env(cpus: str) -> dict[str, str]:
    """The environment the launcher gives a worker pinned to `cpus` (see Cluster.start_service)."""
    env = {**os.environ, **{k: v for k, v in WORKER_MALLOC_ENV.items() if k not in os.environ}}
    if cpus:
        env["OMP_NUM_THREADS"] = str(len(parse_cpu_list(cpus)))  # torch's OpenMP pool is sized at import
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _run_child(args: argparse.Namespace) -> int:
    try:
        env = worker_env(args.cpus)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "distserve.planner.profile_cli", *child_argv(args)]
    return subprocess.run(command, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="distserve profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
