"""`distserve compose-secrets`: fresh Redis users for the compose deployment, one per role, as `distserve up`
makes for its own Redis (distserve.redis_acl).

Writes, in the compose folder (default deploy/compose):
  - `.env` (mode 0600), which docker compose reads: DISTSERVE_REDIS_PASSWORD_<ROLE> per role, each service
    getting only its own in its DISTSERVE_REDIS_URL, and one for `health`, a user that may only PING (the
    Redis container's health check). The administrator's (`launcher`) is in the file, for an operator's
    redis-cli, and in no container. Other lines already in the file are kept.
  - `redis.acl`, which the Redis container loads (`--aclfile`): the `default` user off, each role with only
    its keys, channels and commands. It holds the passwords' SHA-256 hashes, not the passwords, so the
    container's redis user may read it (mode 0644).
Run again, it keeps the passwords .env holds (running containers keep their Redis) unless --force.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from distserve import redis_acl

DEFAULT_DIR = "deploy/compose"
PREFIX = "DISTSERVE_REDIS_PASSWORD_"
HEALTH = "health"  # may only PING: the health check's user, whose password sits in the Redis container's env


def env_name(role: str) -> str:
    """The compose variable holding `role`'s password."""
    return PREFIX + role.upper()


def write_secrets(folder: Path, force: bool = False, spill: bool = False) -> dict[str, str]:
    """Writes folder/.env and folder/redis.acl with a fresh password per role (and HEALTH) and returns them;
    where .env holds every one already, keeps them (unless `force`) and writes redis.acl from them.
    spill: prefill and decode workers also publish spill-only colocated records (DISTSERVE_*_ALSO_COLOCATED)."""
    folder.mkdir(parents=True, exist_ok=True)
    env_path, acl_path = folder / ".env", folder / "redis.acl"
    kept = env_path.read_text().splitlines() if env_path.exists() else []
    existing = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in kept if line.startswith(PREFIX) and "=" in line}
    users = (*redis_acl.ROLES, HEALTH)
    passwords = {user: existing.get(env_name(user), "") for user in users}
    if force or not all(passwords.values()):
        passwords = {**redis_acl.make_passwords(), HEALTH: secrets.token_urlsafe(24)}
        lines = [line for line in kept if not line.startswith(PREFIX)]
        lines += [f"{env_name(user)}={passwords[user]}" for user in users]
        redis_acl.write_private(env_path, "\n".join(lines) + "\n")
    roles = {role: password for role, password in passwords.items() if role != HEALTH}
    health = f"user {HEALTH} on {redis_acl.password_rule(passwords[HEALTH])} resetkeys resetchannels -@all +ping\n"
    acl_path.write_text(redis_acl.acl_text(roles, spill=spill) + health)
    os.chmod(acl_path, 0o644)
    return passwords


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=DEFAULT_DIR, help="the compose folder (default: deploy/compose, from here)")
    parser.add_argument("--spill", action="store_true", help="grant prefill and decode workers the colocated records "
                                                             "that spilling publishes (if you turn it on there)")
    parser.add_argument("--force", action="store_true", help="replace the passwords written before (restart every "
                                                             "container after)")


def run(args) -> int:
    folder = Path(args.dir)
    write_secrets(folder, args.force, args.spill)
    print(f"wrote {folder / '.env'} (a Redis password per role, mode 0600) and {folder / 'redis.acl'} "
          "(their users and grants)")
    return 0
