"""A stand-in for Jaeger's query API (`GET /api/traces?...`) for the `distserve trace` / `explain` tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def fake_jaeger(body: bytes) -> Iterator[tuple[str, list[str]]]:
    """Serves `body` (a Jaeger /api/traces JSON reply) to every GET on a free loopback port; yields the
    base URL and the request paths (with their queries) asked so far."""
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            paths.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", paths
    finally:
        server.shutdown()
        server.server_close()
