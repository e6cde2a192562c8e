"""`distserve trace REQUEST_ID`: fetch a request's trace from Jaeger's query API and draw a waterfall.

Jaeger answers `/api/traces?service=S&tags={"gen_ai.request.id":"ID"}` with
{"data": [{"traceID", "spans": [{spanID, operationName, references, startTime,
duration (microseconds), processID, tags}], "processes": {pid: {serviceName}}}]}.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
import urllib.request

BAR_WIDTH = 40


@dataclasses.dataclass
class SpanRow:
    span_id: str
    parent_id: str
    service: str
    name: str
    start_us: int
    duration_us: int
    failed: bool
    attributes: dict = dataclasses.field(default_factory=dict)  # the span's tags, by key


def fetch_trace(jaeger_url: str, service: str, request_id: str, timeout_s: float = 10) -> dict:
    query = urllib.parse.urlencode({"service": service, "tags": json.dumps({"gen_ai.request.id": request_id}),
                                    "limit": 20})
    with urllib.request.urlopen(f"{jaeger_url.rstrip('/')}/api/traces?{query}", timeout=timeout_s) as reply:
        return json.load(reply)


def rows_from_jaeger(trace: dict) -> list[SpanRow]:
    processes = {pid: p["serviceName"] for pid, p in trace.get("processes", {}).items()}
    rows = []
    for span in trace["spans"]:
        parents = [r["spanID"] for r in span.get("references", []) if r.get("refType") == "CHILD_OF"]
        tags = {t["key"]: t.get("value") for t in span.get("tags", [])}
        failed = str(tags.get("error", "")).lower() == "true" or tags.get("otel.status_code") == "ERROR"
        rows.append(SpanRow(span["spanID"], parents[0] if parents else "", processes.get(span["processID"], "?"),
                            span["operationName"], int(span["startTime"]), int(span["duration"]), failed,
                            tags))
    return rows


def _tree_order(rows: list[SpanRow]) -> list[tuple[int, SpanRow]]:
    """Depth-first by start time: (depth, row)."""
    ids = {r.span_id for r in rows}
    children: dict[str, list[SpanRow]] = {}
    for row in rows:
        children.setdefault(row.parent_id if row.parent_id in ids else "", []).append(row)
    ordered: list[tuple[int, SpanRow]] = []

    def visit(parent: str, depth: int) -> None:
        for row in sorted(children.get(parent, []), key=lambda r: r.start_us):
            ordered.append((depth, row))
            visit(row.span_id, depth + 1)

    visit("", 0)
    return ordered


def render_waterfall(rows: list[SpanRow]) -> str:
    """One line per span: tree-indented name, service, duration, and a bar on the trace's time axis."""
    if not rows:
        return "(no spans)"
    begin = min(r.start_us for r in rows)
    total = max(max(r.start_us + r.duration_us for r in rows) - begin, 1)
    ordered = _tree_order(rows)
    label_width = max(len("  " * d + r.name) for d, r in ordered)
    service_width = max(len(r.service) for _, r in ordered)
    lines = [f"trace: {len(rows)} spans, {total / 1000:.2f} ms"]
    for depth, row in ordered:
        left = round((row.start_us - begin) / total * BAR_WIDTH)
        width = max(1, round(row.duration_us / total * BAR_WIDTH))
        bar = " " * left + "█" * min(width, BAR_WIDTH - left)
        mark = " ERROR" if row.failed else ""
        lines.append(f"{'  ' * depth + row.name:<{label_width}}  {row.service:<{service_width}}  "
                     f"{row.duration_us / 1000:>9.2f} ms  |{bar:<{BAR_WIDTH}}|{mark}")
    return "\n".join(lines)
