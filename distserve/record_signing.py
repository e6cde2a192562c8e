"""Signed records in Redis: with a deployment key, only its holders can publish workers or KV handles.

Anyone who can write to Redis could otherwise publish a worker record (the router would send it prompts
and their KV secrets, decode workers would dial it) or rewrite a KV handle (a decode worker would pull
from another address, or another layout). With a key configured, writers store an HMAC-SHA256 with
each record (`sign`), over the record's kind, the Redis key it is stored under and its bytes, so a
valid record copied under another key (another worker id, another handle id) does not verify; readers
drop a record whose MAC is missing or wrong (`RecordSigner.accepts`): logged once per Redis key, and
counted in `distserve:registry_records_rejected_total{kind}`.

The key: DISTSERVE_REGISTRY_KEY, or a file named by DISTSERVE_REGISTRY_KEY_FILE (`distserve up` writes a
fresh one per run, mode 0600, and hands it to every child). Without either, records are written unsigned
and every record is accepted, as before; the process says so once (`process_signer`).

Not covered: a record its writer signed may be replayed under the same key while it would be live
(a worker's older record: the same address, older load), and records may be deleted; the handle's
`state` field (ready/claimed) is not signed, so a Redis writer can reset it, but a second pull still
needs the request's KV secret; the release channels are not signed (a Redis writer can make a worker
free KV early: denial of service, not redirection).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path
from typing import Callable, Mapping

from distserve.config import ConfigError

log = logging.getLogger(__name__)

KEY_ENV = "DISTSERVE_REGISTRY_KEY"
KEY_FILE_ENV = "DISTSERVE_REGISTRY_KEY_FILE"
MIN_KEY_CHARS = 32  # `openssl rand -hex 16` at least; `distserve up` makes 64 hex characters
WORKER = "worker"  # a WorkerRecord under distserve:worker:<role>:<worker_id>
KV_HANDLE = "kv-handle"  # a KvHandle under distserve:kv:<handle_id>
_DOMAIN = b"distserve-record-v1"
_LOGGED_KEYS_MAX = 100  # rejected records logged one by one; past this many keys only the counter counts


def load_key(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The deployment key from DISTSERVE_REGISTRY_KEY or the file DISTSERVE_REGISTRY_KEY_FILE names (None
    when neither is set, or set empty). ConfigError naming the variable: both set, the file unreadable,
    or a key shorter than MIN_KEY_CHARS."""
    value, path = environ.get(KEY_ENV, "").strip(), environ.get(KEY_FILE_ENV, "").strip()
    if value and path:
        raise ConfigError(f"{KEY_FILE_ENV}: set either {KEY_ENV} or {KEY_FILE_ENV}, not both")
    name = KEY_ENV
    if path:
        name = KEY_FILE_ENV
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{KEY_FILE_ENV}: cannot read {path}: {exc}") from exc
    if not value and not path:
        return None
    if len(value) < MIN_KEY_CHARS:
        raise ConfigError(f"{name}: the registry key must be at least {MIN_KEY_CHARS} characters "
                          f"(e.g. `openssl rand -hex 32`), got {len(value)}")
    return value.encode()


def write_key_file(path: Path) -> Path:
    """Writes a fresh random key (64 hex characters) to `path`, readable by its owner only; returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # O_CREAT keeps an existing file's mode
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def _message(kind: str, record_key: str, payload: bytes) -> bytes:
    """What is MACed: a domain tag, then each part length-prefixed (so no two triples encode alike)."""
    parts = (kind.encode(), record_key.encode(), payload)
    return _DOMAIN + b"".join(len(part).to_bytes(8, "big") + part for part in parts)


def sign(key: bytes, kind: str, record_key: str, payload: bytes) -> str:
    """The MAC (HMAC-SHA256, hex) of a record of `kind` stored under the Redis key `record_key`."""
    return hmac.new(key, _message(kind, record_key, payload), hashlib.sha256).hexdigest()


def verify(key: bytes, kind: str, record_key: str, payload: bytes, mac: str | bytes | None) -> bool:
    """Whether `mac` is the record's MAC under `key` (constant-time); a missing or empty MAC is not."""
    if not mac:
        return False
    if isinstance(mac, bytes):
        mac = mac.decode("ascii", errors="replace")
    return hmac.compare_digest(sign(key, kind, record_key, payload), mac)


class RecordSigner:
    """One process's signing and checking of records. With a key: `mac` signs, `accepts` drops records
    whose MAC is missing or wrong (logs each Redis key once, calls on_rejected(kind)). Without one:
    `mac` is None and `accepts` takes every record (the deployment has not configured signing)."""

    def __init__(self, key: bytes | None, on_rejected: Callable[[str], None] | None = None):
        self._key = key
        self._on_rejected = on_rejected or (lambda kind: None)
        self._logged: set[str] = set()

    @property
    def is_signing(self) -> bool:
        return self._key is not None

    def mac(self, kind: str, record_key: str, payload: bytes) -> str | None:
        """The MAC to store with the record; None without a key."""
        return sign(self._key, kind, record_key, payload) if self._key is not None else None

    def accepts(self, kind: str, record_key: str, payload: bytes, mac: str | bytes | None) -> bool:
        """Whether to use the record: True without a key, else whether its MAC verifies."""
        if self._key is None or verify(self._key, kind, record_key, payload, mac):
            return True
        self._on_rejected(kind)
        self._log_once(record_key, "missing" if not mac else "wrong")
        return False

    def _log_once(self, record_key: str, what: str) -> None:
        if record_key in self._logged or len(self._logged) > _LOGGED_KEYS_MAX:
            return
        self._logged.add(record_key)
        if len(self._logged) > _LOGGED_KEYS_MAX:
            log.warning("more than %d Redis records refused for their signature: no longer logged one by one "
                        "(distserve:registry_records_rejected_total counts them)", _LOGGED_KEYS_MAX)
            return
        log.warning("ignoring %s: its signature is %s (forged or rewritten by a Redis writer without the "
                    "registry key)", record_key, what)


@functools.cache
def process_signer() -> RecordSigner:
    """This process's signer, from its environment (load_key), made once; its rejections are counted in
    distserve:registry_records_rejected_total. Without a key it logs one WARNING that records are unsigned.
    ConfigError naming the variable as load_key."""
    from distserve.metrics import records_rejected  # prometheus only: no torch

    key = load_key()
    if key is None:
        log.warning("registry records in Redis are unsigned: anyone who can write to Redis can add workers or "
                    "rewrite KV handles; set %s or %s (`distserve up` does)", KEY_ENV, KEY_FILE_ENV)
    counter = records_rejected()
    return RecordSigner(key, lambda kind: counter.labels(kind=kind).inc())
