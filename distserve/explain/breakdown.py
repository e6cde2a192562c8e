"""Where a request's time went: its trace cut into consecutive stretches, before and after the first token.

Time to first token runs from the first span's start (the gateway's, else the router's) to the router's
first_token_sent mark (in traces without one, the end of the prefill call), or to the end of the
colocated forward that produced the first token:
  gateway -> router accept (validate, tokenize) -> routing -> [failed attempts] -> hop to the prefill
  worker -> prefill queue -> prefill forward -> first-token sampling -> return to the router
The rest of the request, spread over the output tokens after the first, is its time per output token:
  KV handle registration (the prefill worker's, after the first token went out) -> [failed attempts
  -> routing -> re-prefill] -> hop to the decode worker -> waiting for KV blocks -> KV claim -> KV
  transfer -> cache write -> decode queue -> decoding -> return
Each stretch runs from where the previous one ended to a span boundary, so they add up to the whole
and the largest is the one to blame.
"""

from __future__ import annotations

import dataclasses

from distserve.explain.spans import STATUS_MESSAGE
from distserve.trace_view import SpanRow
from distserve.tracing import FIRST_TOKEN_SENT


@dataclasses.dataclass
class Part:
    label: str  # e.g. "prefill queue"
    seconds: float
    detail: str = ""  # its numbers in words, e.g. "at prefill-0, behind 7 prompts (2,048 tokens)"

    @property
    def words(self) -> str:
        return f"{self.label} {ms(self.seconds)}" + (f" ({self.detail})" if self.detail else "")


@dataclasses.dataclass
class Breakdown:
    request_id: str
    e2e_s: float
    num_output_tokens: int
    ttft_s: float | None  # None: no first token came (the request failed before it)
    ttft_parts: list[Part]
    tpot_s: float | None  # None: fewer than two output tokens
    tpot_parts: list[Part]  # seconds after the first token (not per token)
    retries: list[str]
    errors: list[str]
    failure: str  # why the request itself failed; "" when it finished


def ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"


class _Trace:
    def __init__(self, rows: list[SpanRow]):
        self.rows = sorted(rows, key=lambda r: r.start_us)
        self._children: dict[str, list[SpanRow]] = {}
        for row in self.rows:
            self._children.setdefault(row.parent_id, []).append(row)

    def named(self, name: str, service: str = "") -> list[SpanRow]:
        return [r for r in self.rows if r.name == name and r.service.endswith(service)]

    def under(self, row: SpanRow | None, name: str) -> SpanRow | None:
        """The first span called `name` below `row`, at any depth."""
        level = [row] if row else []
        while level:
            level = [c for r in level for c in self._children.get(r.span_id, [])]
            found = [c for c in level if c.name == name]
            if found:
                return found[0]
        return None

    def worker(self, row: SpanRow) -> str:
        """The worker a span ran on: its own or its nearest ancestor's distserve.worker, else its service."""
        by_id = {r.span_id: r for r in self.rows}
        at: SpanRow | None = row
        while at is not None and at.service == row.service:
            if at.attributes.get("distserve.worker"):
                return str(at.attributes["distserve.worker"])
            at = by_id.get(at.parent_id)
        return row.service

    def has_failed_child(self, row: SpanRow) -> bool:
        return any(c.failed for c in self._children.get(row.span_id, []))


def _end(row: SpanRow) -> int:
    return row.start_us + row.duration_us


def _worker(row: SpanRow) -> str:
    return str(row.attributes.get("distserve.worker") or row.service)


def _num(row: SpanRow | None, key: str) -> float | None:
    try:
        return float(row.attributes[key]) if row is not None else None
    except (KeyError, TypeError, ValueError):
        return None


class _Timeline:
    """Parts laid end to end from `start_us`: each `to(boundary)` closes the stretch up to it."""

    def __init__(self, start_us: int):
        self.cursor = start_us
        self.parts: list[Part] = []

    def to(self, span_boundary_us: int | None, label: str, words: str = "") -> float:
        if span_boundary_us is None or span_boundary_us <= self.cursor:
            return 0.0
        seconds = (span_boundary_us - self.cursor) / 1e6
        self.parts.append(Part(label, seconds, words))
        self.cursor = span_boundary_us
        return seconds


def _first_token(trace: _Trace) -> tuple[SpanRow, int] | None:
    """The span of the stage that produced the first token, and when the router sent it on: the
    router's first_token_sent mark, or, in traces without one, the end of the prefill call."""
    candidates = [(_first_token_sent(trace, p) or _end(p), p) for p in trace.named("prefill", "prefill")
                  if not p.failed]
    candidates += [(_end(f), c) for c in trace.named("colocated") if (f := trace.under(c, "forward"))]
    return min(candidates, key=lambda c: c[0])[::-1] if candidates else None


def _first_token_sent(trace: _Trace, prefill: SpanRow) -> int | None:
    """The router's first mark of sending a first token on after `prefill` began, if any."""
    marks = [r.start_us for r in trace.named(FIRST_TOKEN_SENT) if r.start_us >= prefill.start_us]
    return min(marks) if marks else None


def _routes_before(trace: _Trace, us: int) -> list[SpanRow]:
    return [r for r in trace.named("route") if r.start_us <= us]


def _prefill_parts(trace: _Trace, line: _Timeline, stage: SpanRow, until_us: int, name: str = "prefill") -> None:
    queue, forward = trace.under(stage, "queue"), trace.under(stage, "forward")
    worker, ahead = _worker(stage), _num(stage, "distserve.prefill.queue.prompts_ahead")
    behind = "" if ahead is None else (f", behind {ahead:.0f} prompts "
                                       f"({_num(stage, 'distserve.prefill.queue.tokens_ahead') or 0:,.0f} tokens)")
    line.to(_start(queue), f"{name} admission", f"at {worker}")
    line.to(queue and _end(queue), f"{name} queue", f"at {worker}{behind}")
    line.to(forward and _end(forward), f"{name} forward", _forward_words(stage, forward, worker))
    line.to(_end(ft) if (ft := trace.under(stage, "first_token")) else None, f"{name} sampling", "first token")
    reg = trace.under(stage, "register")
    if reg and _end(reg) <= until_us:  # traces without the router's first_token_sent mark
        line.to(_end(reg), f"{name} KV registration", "with the kvbroker")
    line.to(until_us, f"{name} return")


def _registration_after_first_token(trace: _Trace, line: _Timeline, prefill: SpanRow) -> None:
    """The KV registration the prefill worker did after the router had sent the first token on."""
    reg = trace.under(prefill, "register")
    line.to(reg and _end(reg), "KV registration", f"with the kvbroker, at {_worker(prefill)}, after the first token")


def _forward_words(stage: SpanRow, forward: SpanRow | None, worker: str) -> str:
    if forward is None:
        return ""
    prompt = f"{_num(stage, 'gen_ai.usage.input_tokens') or 0:,.0f}-token prompt at {worker}"
    cached = _num(forward, "distserve.prefill.cached_tokens") or 0
    if cached:
        prompt += f" ({cached:,.0f} of its tokens from the prefix cache)"
    batch = (f"{_num(forward, 'distserve.batch.size') or 0:.0f} prompt(s), "
             f"{_num(forward, 'distserve.batch.tokens') or 0:,.0f} tokens")
    chunks = _num(forward, "distserve.prefill.chunks") or 1
    if chunks <= 1:
        return f"{prompt}, in one forward of {batch}"
    # from the first chunk's start to the last one's end: the forwards between were shared with other prompts
    return f"{prompt} in {chunks:.0f} chunks, between them forwards of other prompts; the last: {batch}"


def _ttft(trace: _Trace, root: SpanRow, router: SpanRow, stage: SpanRow, first_us: int) -> list[Part]:
    line = _Timeline(root.start_us)
    line.to(router.start_us, "gateway", "HTTP, request parsing")
    routes = _routes_before(trace, stage.start_us)
    if routes:
        line.to(routes[0].start_us, "router accept", "validation, tokenization")
        line.to(_end(routes[0]), "routing")
        line.to(routes[-1].start_us, "failed attempts", _failed_between(trace, line.cursor, routes[-1].start_us))
        line.to(_end(routes[-1]), "routing again")
    line.to(stage.start_us, "hop to the worker", f"router -> {_worker(stage)}")
    if stage.name == "colocated":
        line.to(_start(trace.under(stage, "queue")), "KV block admission", f"at {_worker(stage)}")
    _prefill_parts(trace, line, stage, first_us)
    return line.parts


def _start(row: SpanRow | None) -> int | None:
    return row.start_us if row else None


def _failed_between(trace: _Trace, begin_us: int, end_us: int) -> str:
    retries = [r for r in trace.named("retry") if begin_us <= r.start_us <= end_us]
    return "; ".join(_retry_words(r) for r in retries)


def _retry_words(retry: SpanRow) -> str:
    a = retry.attributes
    return (f"retry {a.get('distserve.retry.number', '?')}: {a.get('distserve.retry.stage', '?')} at "
            f"{a.get('distserve.retry.failed_worker', '?')} failed with {a.get('distserve.retry.code', '?')}"
            f" ({a.get('distserve.retry.reason', '')}); moved on with "
            f"{a.get('distserve.retry.completion_tokens', 0)} completion token(s)")


def _after_first_token(trace: _Trace, stage: SpanRow, first_us: int, end_us: int) -> list[Part]:
    line = _Timeline(first_us)
    if stage.name == "colocated":
        generate = trace.under(stage, "generate")
        line.to(_start(generate), "hand-off to decoding", f"at {_worker(stage)}")
        _decoding(line, generate, stage)
    elif decodes := trace.named("decode", "decode"):
        _registration_after_first_token(trace, line, stage)
        decode = next((d for d in reversed(decodes) if not d.failed), decodes[-1])
        route = _routes_before(trace, decode.start_us)[-1:]
        if route and route[0].start_us > first_us:  # moved after its first token: failed, re-routed, re-prefilled
            line.to(route[0].start_us, "failed attempts", _failed_between(trace, first_us, route[0].start_us))
            line.to(_end(route[0]), "routing again")
            again = [p for p in trace.named("prefill", "prefill") if p.start_us >= route[0].start_us]
            if again:
                line.to(again[0].start_us, "hop to the worker", f"router -> {_worker(again[0])}")
                _prefill_parts(trace, line, again[0], _end(again[0]), name="re-prefill")
        made = [p for p in trace.named("prefill", "prefill") if not p.failed and p.start_us <= decode.start_us]
        _handoff(trace, line, decode, made[-1] if made else stage)
        _decoding(line, trace.under(decode, "generate"), decode)
    line.to(end_us, "return", "the last tokens' way back to the client")
    return line.parts


def _handoff(trace: _Trace, line: _Timeline, decode: SpanRow, prefill: SpanRow) -> None:
    worker = _worker(decode)
    line.to(decode.start_us, "hop to decode", f"router -> {worker}")
    load = trace.under(decode, "kv_load")
    claim, recv = trace.under(load, "claim"), trace.under(load, "kv_transfer.recv")
    line.to(_start(claim), "waiting for KV blocks", f"at {worker}")
    line.to(claim and _end(claim), "KV claim", "at the kvbroker")
    nbytes, seconds = _num(recv, "distserve.kv.bytes"), _num(recv, "distserve.kv.transfer_seconds")
    rate = f", {_size(nbytes)} at {_size(nbytes / max(seconds, 1e-9))}/s" if nbytes and seconds else ""
    peer = f" (UCX {recv.attributes['distserve.kv.peer']})" if recv and recv.attributes.get("distserve.kv.peer") else ""
    line.to(recv and _end(recv), "KV transfer", f"from {_worker(prefill)}{peer}{rate}"
            + (", failed" if recv and recv.failed else ""))
    line.to(load and _end(load), "KV cache write", f"at {worker}")
    queue = trace.under(decode, "queue")
    line.to(_start(queue), "decode admission", f"at {worker}")
    line.to(queue and _end(queue), "decode queue", f"at {worker}, before joining its running batch")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _decoding(line: _Timeline, generate: SpanRow | None, stage: SpanRow) -> None:
    if generate is None:
        return
    # gen_ai.usage.output_tokens counts the prefill's first token too: the steps made one fewer
    steps = max((_num(generate, "gen_ai.usage.output_tokens") or 1) - 1, 1)
    per_step = generate.duration_us / 1e6 / steps
    batch = _num(generate, "distserve.decode.mean_batch_size")
    batch_note = (f"in batches of {batch:.1f} sequences on average" if batch
                  else "its batch size is not in the trace")
    line.to(_end(generate), "decoding", f"{ms(per_step)} per token at {_worker(stage)}, {steps:.0f} tokens; "
                                        + batch_note)


def _failure_message(row: SpanRow) -> str:
    """Why a span failed: the router's own reason (distserve.error.message, with its code) where it gave
    one, else the span's status message."""
    if row.attributes.get("distserve.error.message"):
        return f"{row.attributes.get('distserve.error.code', 'error')}: {row.attributes['distserve.error.message']}"
    return str(row.attributes.get(STATUS_MESSAGE) or "")


def _errors(trace: _Trace) -> list[str]:
    """The failed spans that no failed child explains (a failure shows on every span it unwinds)."""
    return [f"{r.name} at {trace.worker(r)} failed" + (f": {_failure_message(r)}" if _failure_message(r) else "")
            for r in trace.rows if r.failed and not trace.has_failed_child(r)]


def explain_rows(rows: list[SpanRow], request_id: str) -> Breakdown:
    """The breakdown of one request's trace (the rows of trace_view, any order)."""
    trace = _Trace(rows)
    root = trace.rows[0]
    router = next(iter(trace.named("router.generate")), root)
    end_us, num_output = _end(root), int(_num(router, "gen_ai.usage.output_tokens") or 0)
    failure = ""
    if router.failed or root.failed:
        failed = router if router.failed else root
        failure = str(_failure_message(failed) or f"{failed.name} failed")
    first = _first_token(trace)
    ttft_s = tpot_s = None
    ttft_parts, tpot_parts = [], []
    if first:
        stage, first_us = first
        ttft_s, ttft_parts = (first_us - root.start_us) / 1e6, _ttft(trace, root, router, stage, first_us)
        if num_output >= 2:
            tpot_s = (end_us - first_us) / 1e6 / (num_output - 1)
            tpot_parts = _after_first_token(trace, stage, first_us, end_us)
    return Breakdown(request_id, root.duration_us / 1e6, num_output, ttft_s, ttft_parts, tpot_s, tpot_parts,
                     [_retry_words(r) for r in trace.named("retry")], _errors(trace), failure)
