"""`distserve compose-secrets`: fresh Redis users for the compose deployment, one per role, as `distserve up`
makes for its own Redis (distserve.redis_acl).

Writes, in the compose folder (default deploy/compose):
  - `.env` (mode 0600), which docker compose reads: DISTSERVE_REDIS_PASSWORD_<ROLE> per role, each service
    getting only its own in its DISTSERVE_REDIS_URL, and the launcher (administrator) one for Redis's
    health check. Other lines already in the file are kept.
  - `redis.acl`, which the Redis container loads (`--aclfile`): the `default` user off, each role with only
    its keys, channels and commands. It holds the passwords' SHA-256 hashes, not the passwords, so the
    container's redis user may read it (mode 0644).
Run again, it keeps the passwords .env holds (running containers keep their Redis) unless --force.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from distserve import redis_acl

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "deploy" / "compose"
PREFIX = "DISTSERVE_REDIS_PASSWORD_"


def env_name(role: str) -> str:
    """The compose variable holding `role`'s password."""
    return PREFIX + role.upper()


def write_secrets(folder: Path, force: bool = False) -> dict[str, str]:
    """Writes folder/.env and folder/redis.acl with a fresh password per role and returns them; where .env
    holds every role's password already, keeps them (unless `force`) and writes redis.acl from them."""
    env_path, acl_path = folder / ".env", folder / "redis.acl"
    kept = env_path.read_text().splitlines() if env_path.exists() else []
    existing = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in kept if line.startswith(PREFIX) and "=" in line}
    passwords = {role: existing.get(env_name(role), "") for role in redis_acl.ROLES}
    if force or not all(passwords.values()):
        passwords = redis_acl.make_passwords()
        lines = [line for line in kept if not line.startswith(PREFIX)]
        lines += [f"{env_name(role)}={password}" for role, password in passwords.items()]
        redis_acl.write_private(env_path, "\n".join(lines) + "\n")
    acl_path.write_text(redis_acl.acl_text(passwords))
    os.chmod(acl_path, 0o644)
    return passwords


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=str(DEFAULT_DIR), help="the compose folder (default: deploy/compose)")
    parser.add_argument("--force", action="store_true", help="replace the passwords written before (restart every "
                                                             "container after)")


def run(args) -> int:
    folder = Path(args.dir)
    write_secrets(folder, args.force)
    print(f"wrote {folder / '.env'} (a Redis password per role, mode 0600) and {folder / 'redis.acl'} "
          "(their users and grants)")
    return 0
