"""Logging set-up shared by every service: one line per event, key=value fields, trace id appended."""

from __future__ import annotations

import logging
import os

from distserve.tracing import current_trace_id


class _TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.trace_id = current_trace_id() or "-"
        return True


def setup_logging(service: str) -> None:
    level = os.environ.get("DISTSERVE_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler()
    handler.addFilter(_TraceIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s trace_id=%(trace_id)s"))
    logging.basicConfig(level=level, handlers=[handler])
    # UCX warns about its own env vars on every start; keep logs readable.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
