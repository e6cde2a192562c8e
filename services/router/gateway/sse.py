"""Server-sent events framing, as the OpenAI streaming API uses it.

Each event is one `data: <json>\n\n` line; the stream ends with `data: [DONE]\n\n`.
JSON is written without raw newlines (json.dumps escapes them), so one event
is always exactly one `data:` line.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}  # tell proxies (nginx) not to buffer the stream


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def parse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of a complete SSE byte stream, in order (clients and tests)."""
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        if not all(line.startswith("data: ") for line in lines):
            raise ValueError(f"not an SSE data event: {block!r}")
        events.append("\n".join(line[len("data: "):] for line in lines))
    return events
