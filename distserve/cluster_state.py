"""The state file of a running `distserve up`: which children it runs, where, and how they fare.

The launcher rewrites it (atomically, mode 0600) after start and after every
supervision event, and removes it on stop. `distserve status` reads it to find
the system: by default `~/.cache/distserve/up.json`, or DISTSERVE_STATE_FILE,
or `--state-file`. URLs in it are redacted (distserve.redact): a Redis
password is never written. For the Redis `up` starts, it names `redis.url` in the log folder (mode
0600), which holds the launcher's URL; for one given by `--redis-url`, `distserve status` needs
DISTSERVE_REDIS_URL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from distserve.redact import redact_url

if TYPE_CHECKING:
    from distserve.launcher import Cluster


def default_path() -> Path:
    explicit = os.environ.get("DISTSERVE_STATE_FILE")
    return Path(explicit) if explicit else Path.home() / ".cache" / "distserve" / "up.json"


def describe(cluster: "Cluster") -> dict:
    """The JSON-ready description of a cluster's children."""
    children = [{"name": p.name, "pid": p.popen.pid, "address": p.address, "metrics_url": p.metrics_url,
                 "restarts": p.restarts, "state": p.state if p.popen.poll() is None or p.state != "running"
                 else "exited"} for p in list(cluster.processes.values())]
    return {"launcher_pid": os.getpid(), "redis_url": redact_url(cluster.redis_url),
            "gateway_url": cluster.gateway_url, "log_dir": str(cluster.log_dir), "children": children,
            "tls": cluster.spec.tls.tls_env(),  # file paths (never their contents), for status's health checks
            "registry_key_file": cluster.registry_key_file,  # for status's read of the registry
            # the launcher's Redis URL with its password, in a file of mode 0600 ("": given by the user)
            "redis_url_file": str(cluster.redis_url_file) if cluster.redis_passwords else ""}


def write(path: Path, cluster: "Cluster") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(describe(cluster), f, indent=1)
    os.replace(temporary, path)


def redis_url(state: dict) -> str:
    """The Redis URL `distserve status` uses: DISTSERVE_REDIS_URL, else the launcher's from its 0600 file,
    else the state's (redacted: it works only without a password)."""
    explicit, url_file = os.environ.get("DISTSERVE_REDIS_URL"), state.get("redis_url_file")
    if explicit:
        return explicit
    if url_file:
        try:
            return Path(url_file).read_text().strip()
        except OSError:
            pass
    return state["redis_url"]


def read(path: Path) -> dict:
    """The state a launcher wrote; FileNotFoundError when none runs (or it used another path)."""
    return json.loads(path.read_text())
