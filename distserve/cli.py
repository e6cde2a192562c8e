"""The `distserve` command: up (start everything, supervised), status (its children, health and load),
demo (start, answer, stop), generate (stream an answer), trace (a request's waterfall), explain (where
its time went, against the SLOs), bench (goodput), profile and plan (placement search)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from distserve import cluster_state
from distserve.client import Chunk, DistServeClient, DistServeError, Sampling, Timings, Usage
from distserve.config import ConfigError
from distserve.convert import finish_to_proto
from distserve.engine.default_model import MODEL_HELP
from distserve.engine.dtype import DTYPE_CHOICES
from distserve.engine.model_loader import resolve_model_path
from distserve.dev_certs import make_dev_certs
from distserve.grpc_server import PLAINTEXT, TlsConfig
from distserve.launcher import Cluster, ClusterSpec, StartError
from distserve.redact import redact_url
from distserve.v1 import common_pb2


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: bfloat16 on CUDA or on CPUs with bf16 instructions, else float32")
    parser.add_argument("--device", default="cpu", help="torch device of the workers, e.g. cpu or cuda")
    parser.add_argument("--gpus", default="", help="GPUs to deal the workers over, one each in start order, e.g. 0,1 "
                                                   "(each sees only its own, as cuda; workers sharing one split its "
                                                   "memory): implies --device cuda")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                        help="with --gpus: the fraction of each GPU's memory its workers may use, weights, "
                             "activations and KV cache together (the KV cache gets what is left)")
    parser.add_argument("--cpus", default="", help="cores to split among the workers, one share each, e.g. 0-3 "
                                                   "(default: all cores this process may use)")
    parser.add_argument("--share-cores", action="store_true", help="do not split: every worker may use all cores")
    parser.add_argument("--take-turns", action="store_true",
                        help="prefill workers get every core, decode workers their share, and one forward runs at "
                             "a time, in turn: lower TTFT at light bf16 load, decode stalls while prefill is "
                             "busy (measured trade: docs/benchmarks.md)")
    parser.add_argument("--lend-cores", action="store_true",
                        help="prefill and decode workers run on every core, decode and the control plane at a "
                             "lower CPU priority, so a prefill forward takes every core while it runs and decode "
                             "steps and the control plane share what it leaves "
                             "(measured trade: docs/benchmarks.md)")
    parser.add_argument("--spill", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill and decode workers also serve whole requests, prefilled and decoded in one "
                             "worker, which the router sends them only while the prefill/decode pairs are "
                             "saturated: under a burst every core prefills and decodes (default: on; docs/goodput.md, "
                             "Spilling, for the measured trade)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="workers reuse the KV of prompt prefixes they computed before, in whole blocks "
                             "(default: on; --no-prefix-caching computes every prompt whole)")
    parser.add_argument("--control-cpus", default="auto",
                        help="cores for the router, gateway, kvbroker and Redis, e.g. 3; auto (default): cores no "
                             "worker was given, else the decode workers'; any: not pinned. On 2 cores, 1+1, bf16, "
                             "4 req/s, the decode core measured TTFT p50 -6 to -19 ms at the same TPOT "
                             "(docs/engine.md, Cores)")
    parser.add_argument("--prefill", type=int, default=None,
                        help="number of prefill workers (default: 1, or 0 with --colocated)")
    parser.add_argument("--decode", type=int, default=None,
                        help="number of decode workers (default: 1, or 0 with --colocated)")
    parser.add_argument("--colocated", type=int, default=0,
                        help="number of colocated workers, each prefilling and decoding in one process (the "
                             "baseline disaggregation is compared with); mixed fleets are allowed")
    parser.add_argument("--router-port", type=int, default=50051)
    parser.add_argument("--free-ports", action="store_true",
                        help="every port (Redis, kvbroker, workers, router, gateway, metrics) a free one instead "
                             "of the defaults, e.g. for a second system on this machine; the addresses are printed")
    parser.add_argument("--redis-url", default=os.environ.get("DISTSERVE_REDIS_URL", ""),
                        help="use this Redis instead of starting one (redis:// or rediss://); one with a password "
                             "is better given as env DISTSERVE_REDIS_URL, which `ps` does not show")
    parser.add_argument("--gateway-port", type=int, default=8000, help="HTTP gateway port; -1: no gateway")
    parser.add_argument("--routers", type=int, default=1,
                        help="routers to run (ports --router-port + i): the gateway spreads requests over them and "
                             "resumes a stream whose router dies on another")
    parser.add_argument("--kvbrokers", type=int, default=1,
                        help="kvbrokers to run (ports 50060 + i): the router and workers move a call to another "
                             "when one is down or stalled")
    parser.add_argument("--served-model-name", default="", help="model name in the OpenAI API (default: folder)")
    parser.add_argument("--api-key-file", default="",
                        help="require `Authorization: Bearer KEY` on the gateway and the router's gRPC API, "
                             "KEY read from this file (or set DISTSERVE_API_KEY; never on the command line, "
                             "where `ps` shows it)")
    parser.add_argument("--chat-template", default="", metavar="FILE_OR_STRING",
                        help="the gateway's chat template: a Jinja file, or the template text; overrides the "
                             "tokenizer's (needed for a model without one)")
    parser.add_argument("--tool-call-parser", default="", choices=("", "hermes", "llama3_json", "mistral"),
                        help="the format tool_choice \"auto\" reads the model's calls in (default: the one its "
                             "chat template shows, if any)")
    parser.add_argument("--reasoning-parser", default="", choices=("", "deepseek_r1", "qwen3"),
                        help="return <think> text apart, as reasoning_content (default: off)")
    parser.add_argument("--log-dir", default="", help="where each process writes its log")
    parser.add_argument("--tls-dir", default="", help="mutual TLS between all services with a self-signed CA and "
                                                      "certificate kept in this folder (made on first use)")


def _spec(args) -> ClusterSpec:
    # Build (or find) the model once here, so the workers only load it.
    gateway_args = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    gateway_args += ["--chat-template", _absolute_if_file(args.chat_template)] if args.chat_template else []
    for flag, value in (("--tool-call-parser", args.tool_call_parser), ("--reasoning-parser", args.reasoning_parser)):
        gateway_args += [flag, value] if value else []
    if args.routers < 1:
        raise ConfigError(f"routers: must be >= 1, got {args.routers}")
    if args.kvbrokers < 1:
        raise ConfigError(f"kvbrokers: must be >= 1, got {args.kvbrokers}")
    default = 0 if args.colocated else 1
    num_prefill = default if args.prefill is None else args.prefill
    num_decode = default if args.decode is None else args.decode
    if num_prefill + num_decode + args.colocated == 0 or (num_prefill == 0) != (num_decode == 0):
        raise ConfigError("prefill/decode: need at least one prefill and one decode worker, or --colocated N")
    if args.spill and args.take_turns:
        raise ConfigError("spill: cannot be combined with --take-turns (a spilling worker's loop takes no turns); "
                          "add --no-spill")
    if args.spill and args.lend_cores:
        raise ConfigError("spill: cannot be combined with --lend-cores (a prompt spilled to a decode worker would run "
                          "at its lowered priority, behind every prefill forward); add --no-spill")
    if args.take_turns and args.lend_cores:
        raise ConfigError("lend_cores: cannot be combined with --take-turns (pick one way to share the cores)")
    spec = ClusterSpec(model=resolve_model_path(args.model), num_prefill=num_prefill, num_decode=num_decode,
                       num_colocated=args.colocated,
                       router_port=args.router_port, num_routers=args.routers, num_kvbrokers=args.kvbrokers, redis_url=args.redis_url,
                       log_dir=args.log_dir,
                       gateway_port=None if args.gateway_port < 0 else args.gateway_port, gateway_args=gateway_args,
                       cpus=args.cpus, share_cores=args.share_cores, take_turns=args.take_turns,
                       lend_cores=args.lend_cores, spill=args.spill,
                       control_cpus=args.control_cpus, gpus=args.gpus, gpu_memory_fraction=args.gpu_memory_fraction,
                       tls=make_dev_certs(args.tls_dir) if args.tls_dir else PLAINTEXT,
                       env={"DISTSERVE_DTYPE": args.dtype, "DISTSERVE_DEVICE": "cuda" if args.gpus else args.device,
                            # the gateway and the router both take the key (the router from the gateway)
                            **({"DISTSERVE_API_KEY_FILE": os.path.abspath(args.api_key_file)}
                               if args.api_key_file else {}),
                            **({} if args.prefix_caching else {"DISTSERVE_PREFIX_CACHING": "0"})})
    return _on_free_ports(spec) if args.free_ports else spec


def _on_free_ports(spec: ClusterSpec) -> ClusterSpec:
    """spec with every port 0, which the launcher replaces by a free one (no gateway stays no gateway)."""
    ports = [field.name for field in dataclasses.fields(ClusterSpec) if field.name.endswith("_port")]
    return dataclasses.replace(spec, **{name: 0 for name in ports if getattr(spec, name) is not None})


def _absolute_if_file(value: str) -> str:
    """A file's absolute path (a supervised restart must find it whatever its working directory); other text
    as it is."""
    return os.path.abspath(value) if os.path.isfile(value) else value


def _print_cores(cluster: Cluster) -> None:
    control = f", control plane -> {cluster.control_cpus}" if cluster.control_cpus is not None else ""
    sharing = (" (prefill and decode take turns)" if cluster.spec.take_turns else
               " (decode and control plane at a lower priority: prefill forwards first)" if cluster.spec.lend_cores
               else "")
    print("cores: " + ", ".join(f"{name} -> {cpus}" for name, cpus in cluster.worker_cpus.items()) + control + sharing,
          flush=True)


def _print_progress(line: str) -> None:
    """A line of the start's progress (distserve.launcher.StartReport), with the banner on stdout."""
    print(line, flush=True)


def _print_addresses(cluster: Cluster) -> None:
    print(f"redis     {redact_url(cluster.redis_url)}")
    for name, process in cluster.processes.items():
        if process.address:
            print(f"{name:<9} grpc://{process.address}")
    if cluster.gateway_url:
        print(f"gateway   {cluster.gateway_url}  (OpenAI-compatible HTTP)")
    print(f"logs      {cluster.log_dir}", flush=True)


async def stream_generate(address: str, prompt: str, sampling: Sampling, tls: TlsConfig | None = None,
                          out: TextIO | None = None) -> Chunk:
    """Streams one answer to `out` (default: sys.stdout); returns the last chunk (finish reason, usage, timings)."""
    out, last = out or sys.stdout, None
    async with DistServeClient(address, tls) as client:
        async for chunk in client.generate(prompt, sampling):
            out.write(chunk.text)
            out.flush()
            last = chunk
    out.write("\n")
    return last


def _print_summary(last: Chunk, wall_s: float) -> None:
    t, usage = last.timings or Timings(0, 0, 0, 0, 0, 0), last.usage or Usage(0, 0)
    reason = common_pb2.FinishReason.Name(finish_to_proto(last.finish_reason))
    print(f"[{reason} | prompt {usage.prompt_tokens} tokens, completion {usage.completion_tokens} "
          f"| first token {t.first_token_s * 1000:.1f} ms (queue {t.queue_s * 1000:.1f}, prefill "
          f"{t.prefill_s * 1000:.1f}), transfer {t.transfer_s * 1000:.1f} ms, decode {t.decode_s * 1000:.1f} ms, "
          f"end to end {wall_s * 1000:.1f} ms]", file=sys.stderr)


def _client_tls(tls_dir: str) -> TlsConfig | None:
    """The certificates `distserve up --tls-dir` made in tls_dir (read here, never made)."""
    if not tls_dir:
        return None
    folder = Path(tls_dir)
    return TlsConfig(tls_cert=str(folder / "cert.pem"), tls_key=str(folder / "key.pem"), tls_ca=str(folder / "ca.pem"))


def _generate(args) -> int:
    started = time.monotonic()
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        last = asyncio.run(stream_generate(args.router, args.prompt, sampling, _client_tls(args.tls_dir)))
    except DistServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print_summary(last, time.monotonic() - started)
    return 0


def _up(args) -> int:
    spec = dataclasses.replace(_spec(args), supervise=not args.no_supervise, state_file=str(args.state_file))
    cluster = Cluster(spec, progress=_print_progress)
    started = stop = False

    def on_signal(*_):
        nonlocal stop
        if not started and not stop:  # abandon the start, once: Cluster.start stops what it began
            stop = True
            raise KeyboardInterrupt
        stop = True

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # HUP: the terminal closed
        signal.signal(signum, on_signal)
    _print_cores(cluster)
    try:
        cluster.start()
        started = True
        _print_addresses(cluster)
        print(f"state     {args.state_file}  (`distserve status` reads it)")
        print("ready; Ctrl-C stops everything", flush=True)
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:  # a signal during the start
        return 130
    finally:
        cluster.stop()  # idempotent; children also die with this process (see launcher._die_with_launcher)
    return 0


def _status(args) -> int:
    from distserve.status import collect, render

    state = _read_state(args.state_file)
    if state is None:
        return 1
    print(render(asyncio.run(collect(state, cluster_state.redis_url(state)))))
    return 0


def _read_state(path: Path) -> dict | None:
    try:
        return cluster_state.read(path)
    except FileNotFoundError:
        print(f"error: no running `distserve up` found ({path} does not exist)", file=sys.stderr)
        return None


def _drain(args) -> int:
    import grpc

    from distserve import rolling

    state = _read_state(args.state_file)
    if state is None:
        return 1
    failed = 0
    for name in args.names:
        try:
            drained = asyncio.run(rolling.drain(state, name, args.reason, args.grace_s))
        except KeyError:
            print(f"error: {name}: no such gRPC service in this `distserve up` (see `distserve status`)",
                  file=sys.stderr)
            failed += 1
            continue
        except grpc.aio.AioRpcError as exc:
            print(f"error: {name}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: {'already ' if drained.already_draining else ''}draining: deregistered, accepting calls for "
              f"{drained.drain_s:g} s, then finishing them for up to {drained.grace_s:g} s (the rest migrate)")
    return 1 if failed else 0


def _restart(args) -> int:
    import grpc

    from distserve import rolling

    if _read_state(args.state_file) is None:
        return 1
    roles = tuple(args.role or ("prefill", "decode", "colocated"))
    try:
        names = asyncio.run(rolling.rolling_restart(args.state_file, roles, "distserve restart",
                                                    lambda text: print(text, flush=True)))
    except (TimeoutError, RuntimeError, grpc.aio.AioRpcError) as exc:
        details = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        print(f"error: rolling restart stopped: {details}", file=sys.stderr)
        return 1
    print(f"restarted {len(names)} worker(s)" if names else "no worker of those roles")
    return 0


def _demo(args) -> int:
    cluster = Cluster(_spec(args), progress=_print_progress)
    _print_cores(cluster)
    cluster.start()
    try:
        _print_addresses(cluster)
        args.router = cluster.router_address
        print(f"\n> {args.prompt}", flush=True)
        return _generate(args)
    finally:
        cluster.stop()


def _trace(args) -> int:
    from distserve.trace_view import fetch_trace, render_waterfall, rows_from_jaeger

    try:
        reply = fetch_trace(args.jaeger, args.service, args.request_id)
    except OSError as exc:
        print(f"error: cannot query {args.jaeger}: {exc}", file=sys.stderr)
        return 1
    traces = reply.get("data") or []
    if not traces:
        print(f"no trace found for request id {args.request_id}", file=sys.stderr)
        return 1
    for trace in traces:
        print(render_waterfall(rows_from_jaeger(trace)))
    return 0


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=None)


def _add_tool_commands(commands) -> dict:
    """bench, profile, plan, explain and compose-secrets: each module owns its flags (add_arguments) and its
    run(args)."""
    from distserve import compose_secrets, explain
    from distserve.bench import cli as bench
    from distserve.planner import plan_cli, profile_cli

    tools = {"bench": (bench, "drive an OpenAI endpoint with Poisson arrivals: TTFT, TPOT, SLO attainment, goodput"),
             "profile": (profile_cli, "measure this machine's step and KV-transfer latency models for the planner"),
             "plan": (plan_cli, "search worker counts, cores and batch budget for the best goodput, by simulation"),
             "explain": (explain, "say where a request's time went and which stage broke which SLO, from its trace"),
             "compose-secrets": (compose_secrets, "write a Redis user per role for deploy/compose: .env with their "
                                                  "passwords, redis.acl with their grants")}
    for name, (module, summary) in tools.items():
        module.add_arguments(commands.add_parser(name, help=summary, description=summary))
    return {name: module.run for name, (module, _) in tools.items()}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="distserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start Redis, kvbroker, workers and router; run until Ctrl-C")
    _add_cluster_args(up)
    up.add_argument("--no-supervise", action="store_true", help="do not restart children that die")
    up.add_argument("--state-file", type=Path, default=cluster_state.default_path(),
                    help="where to describe the running system for `distserve status` [env DISTSERVE_STATE_FILE]")
    status = commands.add_parser("status", help="every service of a running `distserve up`: pid, address, "
                                                "restarts, health and load (Redis URL: env DISTSERVE_REDIS_URL "
                                                "when it has a password)")
    status.add_argument("--state-file", type=Path, default=cluster_state.default_path())
    drain = commands.add_parser("drain", help="drain services of a running `distserve up` by name (as `status` "
                                              "lists them): they deregister, finish or migrate their work, "
                                              "exit, and the supervisor starts them again")
    drain.add_argument("names", nargs="+", metavar="NAME")
    drain.add_argument("--reason", default="distserve drain")
    drain.add_argument("--grace-s", type=float, default=0.0,
                       help="finish in-flight work within this many seconds, then migrate the rest (at most "
                            "each service's own --grace-s; default: its own)")
    drain.add_argument("--state-file", type=Path, default=cluster_state.default_path())
    restart = commands.add_parser("restart", help="rolling restart of a running `distserve up`'s workers: "
                                                  "drain one, wait until it is back, then the next")
    restart.add_argument("--role", action="append", choices=("prefill", "decode", "colocated"),
                         help="only workers of this role (repeatable; default: all)")
    restart.add_argument("--state-file", type=Path, default=cluster_state.default_path())
    demo = commands.add_parser("demo", help="start everything, stream one answer, stop")
    _add_cluster_args(demo)
    demo.add_argument("prompt", nargs="?", default="Once upon a time")
    _add_generate_args(demo)
    gen = commands.add_parser("generate", help="stream an answer from a running router")
    gen.add_argument("prompt")
    gen.add_argument("--router", default="127.0.0.1:50051")
    gen.add_argument("--tls-dir", default="", help="the folder of `distserve up --tls-dir`: its CA and client "
                                                   "certificate, for a router that requires mutual TLS")
    _add_generate_args(gen)
    trace = commands.add_parser("trace", help="print a request's trace from Jaeger as a waterfall")
    trace.add_argument("request_id")
    trace.add_argument("--jaeger", default="http://127.0.0.1:16686", help="Jaeger query (UI) base URL")
    trace.add_argument("--service", default="distserve-router", help="service to search the request id in")
    tools = _add_tool_commands(commands)
    args = parser.parse_args(argv)
    try:
        if args.command in tools:
            return tools[args.command](args)
        commands = {"up": _up, "status": _status, "drain": _drain, "restart": _restart, "demo": _demo,
                    "generate": _generate, "trace": _trace}
        return commands[args.command](args)
    except ConfigError as exc:  # e.g. --cpus naming cores this machine lacks
        parser.error(str(exc))
    except StartError as exc:  # a child that did not start: what happened and its last log lines
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
