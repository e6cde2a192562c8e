"""`distserve bench` / `python -m distserve.bench`: measure goodput, or compare earlier runs.

A run: check the endpoint -> sample lengths and prompts once (same for every rate)
-> for each rate, send all requests on its Poisson schedule and wait for them ->
DIR/results.json, DIR/attainment.png, DIR/latency_cdf.png and a summary table.
`--compare DIR ...` only reads results.json files: overlay chart and goodput table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from distserve.bench import adaptive, conversations, plots, stats, workload
from distserve.bench.client import (
    BenchRequest,
    Endpoint,
    EndpointError,
    list_models,
    open_session,
    pick_model,
    run_rate,
)

log = logging.getLogger("distserve.bench")
FALLBACK_VOCAB_SIZE = 32000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's flags, on a parser of its own or on the `distserve bench` subparser."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the OpenAI-compatible server")
    parser.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF folder whose tokenizer gives the vocabulary size for random prompts "
                             "(default: --model or the served model's root when a local folder, else 32000)")
    parser.add_argument("--rates", default="1,2,4",
                        help="request rates per second, comma-separated, inf allowed; or auto: from --auto-start, "
                             "doubled until the SLO attainment target is missed, then bisected around that knee")
    parser.add_argument("--auto-start", type=float, default=0.5, help="--rates auto: the first rate (req/s)")
    parser.add_argument("--num-prompts", type=int, default=50, help="requests per rate (per repeat)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per rate, each with its own prompts and arrivals; results pool them and "
                             "keep each one's attainment for the spread (error bars, goodput per repeat)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", default="fixed", choices=workload.WORKLOADS,
                        help="fixed lengths, or a mix shaped like ShareGPT (chat), HumanEval (code), "
                             "LongBench (summarize)")
    parser.add_argument("--input-len", default="256", help="fixed workload: N or A-B (uniform) prompt tokens")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="every prompt starts with the same this many tokens (a shared system prompt), "
                             "drawn anew for each rate; the input lengths come after it")
    chat = conversations.ChatShape()
    parser.add_argument("--conversations", type=int, default=chat.num_conversations,
                        help="multi-turn: conversations per rate (the rate counts conversations started per s)")
    parser.add_argument("--turns", type=int, default=chat.num_turns, help="multi-turn: turns per conversation")
    parser.add_argument("--system-len", type=int, default=chat.system_len,
                        help="multi-turn: tokens of the system prompt every conversation starts with")
    parser.add_argument("--user-len", type=int, default=chat.user_len, help="multi-turn: tokens of each user turn")
    parser.add_argument("--answer-len", type=int, default=chat.answer_len, help="multi-turn: tokens of each answer")
    parser.add_argument("--think-s", type=float, default=chat.think_s,
                        help="multi-turn: seconds between an answer's end and the next turn")
    parser.add_argument("--output-len", default="64", help="fixed workload: N or A-B (uniform) output tokens")
    parser.add_argument("--max-context", type=int, default=None, help="clip each request to input+output <= this")
    parser.add_argument("--slo-ttft-ms", type=float, default=300.0, help="time-to-first-token SLO")
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0, help="time-per-output-token SLO")
    parser.add_argument("--slo-itl-p99-ms", type=float, default=None,
                        help="also an SLO on each request's p99 inter-token gap (per token; default: none)")
    parser.add_argument("--slo-stall-ms", type=float, default=None,
                        help="also an SLO on each request's longest gap between chunks (default: none)")
    parser.add_argument("--out", default=None,
                        help="folder for results.json and the charts (optional with --compare: then only a table)")
    parser.add_argument("--label", default=None, help="name of this configuration (default: the --out folder name)")
    parser.add_argument("--compare", nargs="+", metavar="DIR", default=None,
                        help="print the goodput of earlier result folders and overlay them in --out/attainment.png; "
                             "sends no request")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                        help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")


def parse_rates(text: str) -> list[float]:
    """"1,2,inf" -> [1.0, 2.0, inf]. Raises ValueError naming --rates unless every rate is > 0."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or not all(rate > 0 for rate in rates):
        raise ValueError(f"--rates: expected comma-separated rates > 0 (inf allowed), or auto; got {text!r}")
    return rates


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark (or the comparison) that `args` describe; returns the exit code."""
    try:
        if args.compare:
            return _compare(args)
        _check_args(args)
        results = asyncio.run(_bench(args))
    except (ValueError, EndpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    plots.plot_attainment([results], out / "attainment.png")
    plots.plot_latency_cdf(results, out / "latency_cdf.png")
    print(stats.format_summary(results))
    print(f"results: {out / 'results.json'}")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if not args.out:
        raise ValueError("--out: a folder for results.json is required")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts: must be at least 1, got {args.num_prompts}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len: must be >= 0, got {args.prefix_len}")
    if args.workload == workload.MULTI_TURN:
        for name in ("conversations", "turns", "user_len", "answer_len"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
        if args.system_len < 0 or args.think_s < 0:
            raise ValueError("--system-len / --think-s: must be >= 0")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms / --slo-tpot-ms: must be > 0")
    for name in ("slo_itl_p99_ms", "slo_stall_ms"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
    Path(args.out).mkdir(parents=True, exist_ok=True)


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    auto = args.rates.strip() == "auto"
    if auto and not args.auto_start > 0:
        raise ValueError(f"--auto-start: must be > 0, got {args.auto_start}")
    fixed_rates = [] if auto else parse_rates(args.rates)
    url = args.url.rstrip("/")
    multi_turn = args.workload == workload.MULTI_TURN
    lengths = [] if multi_turn else workload.sample_lengths(args.workload, args.num_prompts, args.seed,
                                                            args.input_len, args.output_len, args.max_context)
    async with open_session() as session:
        card = pick_model(url, await list_models(session, url, args.api_key), args.model)
        endpoint = Endpoint(url, card["id"], args.api_key)
        vocab_size = _vocab_size(args, card)
        summaries = []
        index = 0
        while (rate := _next_rate(auto, fixed_rates, summaries, args.auto_start, index)) is not None:
            runs = []
            for repeat in range(args.repeats):  # each run draws prompts the server has never seen
                run, arrival_seed = index * args.repeats + repeat, args.seed + repeat
                if multi_turn:
                    records, duration_s = await _run_chats(session, endpoint, args, vocab_size, run, rate,
                                                           arrival_seed)
                else:
                    prompts = workload.synthetic_prompts(lengths, vocab_size, args.seed, run, args.prefix_len)
                    requests = [BenchRequest(p, out_len) for p, (_, out_len) in zip(prompts, lengths)]
                    arrivals = workload.poisson_arrivals(rate, len(requests), arrival_seed)
                    desc = f"rate {rate:g}" + (f" ({repeat + 1}/{args.repeats})" if args.repeats > 1 else "")
                    records, duration_s = await run_rate(session, endpoint, requests, arrivals, desc=desc)
                runs.append((duration_s, records))
            summaries.append(stats.summarize_repeats(rate, runs, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                                                     *_seconds(args.slo_itl_p99_ms, args.slo_stall_ms)))
            index += 1
    fixed = args.workload == "fixed"
    spec = {"name": args.workload, "input_len": args.input_len if fixed else None,
            "output_len": args.output_len if fixed else None, "num_prompts": args.num_prompts, "seed": args.seed,
            "prefix_len": args.prefix_len, "repeats": args.repeats}
    if multi_turn:
        spec.update(dataclasses.asdict(_chat_shape(args)), num_prompts=args.conversations * args.turns)
    label = args.label or Path(args.out).resolve().name
    return stats.results_document(label, url, endpoint.model, spec, args.slo_ttft_ms, args.slo_tpot_ms, summaries,
                                  args.slo_itl_p99_ms, args.slo_stall_ms)


def _next_rate(auto: bool, fixed: list[float], summaries: list[dict[str, Any]], start: float,
               index: int) -> float | None:
    if not auto:
        return fixed[index] if index < len(fixed) else None
    measured = [(stats.rate_from_json(s["rate"]), s["attainment"]) for s in summaries]
    return adaptive.next_rate(measured, stats.ATTAINMENT_TARGET, start)


def _seconds(*values_ms: float | None) -> list[float | None]:
    return [None if value is None else value / 1000 for value in values_ms]


def _chat_shape(args: argparse.Namespace) -> conversations.ChatShape:
    return conversations.ChatShape(args.conversations, args.turns, args.system_len, args.user_len,
                                   args.answer_len, args.think_s)


async def _run_chats(session, endpoint: Endpoint, args: argparse.Namespace, vocab_size: int, run: int,
                     rate: float, arrival_seed: int):
    """One run of the multi-turn workload: `rate` conversations started per second."""
    shape = _chat_shape(args)
    chats = conversations.sample_conversations(shape, vocab_size, args.seed, run)
    arrivals = workload.poisson_arrivals(rate, len(chats), arrival_seed)
    return await conversations.run_conversations(session, endpoint, chats, arrivals, shape)


def _vocab_size(args: argparse.Namespace, card: dict[str, Any]) -> int:
    """len(tokenizer) of --tokenizer, else of --model or the card's root (vLLM's) when a local folder."""
    folder = args.tokenizer or next((c for c in (args.model, card.get("root")) if c and Path(c).is_dir()), None)
    if folder is None:
        log.warning("no local tokenizer (--tokenizer): random prompts use token ids below %d; "
                    "pass --tokenizer if the model's vocabulary is smaller", FALLBACK_VOCAB_SIZE)
        return FALLBACK_VOCAB_SIZE
    from transformers import AutoTokenizer  # slow to import: only when a tokenizer is used

    return len(AutoTokenizer.from_pretrained(folder))


def _compare(args: argparse.Namespace) -> int:
    """Prints each folder's goodput; with --out, also overlays their attainment curves in one chart."""
    runs = [json.loads((Path(d) / "results.json").read_text()) for d in args.compare]
    width = max(len("label"), *(len(r["label"]) for r in runs))
    print(f"{'label':<{width}}  goodput (req/s)  SLO (TTFT/TPOT ms)")
    for r in runs:
        bound = ">= " if r["goodput_is_lower_bound"] else ""
        print(f"{r['label']:<{width}}  {bound + format(r['goodput_rps'], '.2f'):>15}  "
              f"{r['slo']['ttft_ms']:g}/{r['slo']['tpot_ms']:g}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plots.plot_attainment(runs, out / "attainment.png")
        print(f"chart: {out / 'attainment.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distserve bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))

