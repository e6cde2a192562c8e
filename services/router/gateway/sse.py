"""Server-sent events framing, as the OpenAI streaming API uses it.

Each event is one `data: <json>\n\n` line; the stream ends with `data: [DONE]\n\n`.
JSON is written compact and without raw newlines (orjson escapes them in strings), so one event is
always exactly one `data:` line. orjson writes a float that is not finite as null; the logprobs that can
be -inf are clamped before (logprobs_format).
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}  # tell proxies (nginx) not to buffer the stream


def event(payload: dict[str, Any]) -> bytes:
    """One event. orjson: about a tenth of json.dumps' time, on every streamed token."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def json_text(value: Any) -> str:
    """A JSON body's text (aiohttp's json_response(dumps=...)), as compact as the events'."""
    return orjson.dumps(value).decode()


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
