"""Logging set-up shared by every service: one line per event, key=value fields."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> None:
    level = os.environ.get("DISTSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    # UCX warns about its own env vars on every start; keep logs readable.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
