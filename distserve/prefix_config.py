"""Prefix-cache settings, shared by every worker config that prefills (prefill, colocated, decode's
colocated half). The environment variables are the same for every service, since all of a
deployment's workers must agree on the keys (distserve.prefix_hash)."""

from __future__ import annotations

import dataclasses

from distserve.config import require, setting
from distserve.prefix_hash import PrefixNamespace


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    prefix_caching: bool = setting(True, "reuse the KV of prompt prefixes computed before (false: compute every "
                                         "prompt whole)", env="DISTSERVE_PREFIX_CACHING")
    prefix_cache_mb: int = setting(1024, "memory for cached prompt prefixes, MiB (allocated as blocks are stored)",
                                   env="DISTSERVE_PREFIX_CACHE_MB")
    prefix_block_size: int = setting(16, "tokens per cached block: prefixes are shared in whole blocks",
                                     env="DISTSERVE_PREFIX_BLOCK_SIZE")
    prefix_seed: str = setting("", "seed of the prefix-cache keys, the same in every service of a deployment",
                               env="DISTSERVE_PREFIX_SEED", flag=False)

    def check_prefix_cache(self) -> None:
        """Called from the worker config's __post_init__."""
        require(self.prefix_cache_mb >= 0, "prefix_cache_mb", f"must be >= 0, got {self.prefix_cache_mb}")
        require(self.prefix_block_size > 0, "prefix_block_size", f"must be > 0, got {self.prefix_block_size}")


def shared_prefix(config: PrefixCacheConfig, model: str, dtype: str, block_size: int) -> PrefixNamespace | None:
    """The namespace a decode engine keys its shared prompt blocks in (`block_size`: its paged cache's),
    or None with prefix caching off."""
    if not config.prefix_caching:
        return None
    return PrefixNamespace(model, dtype, block_size, config.prefix_seed)


def prefix_settings(config: PrefixCacheConfig) -> dict:
    """The prefix-cache fields of `config`, to hand on to another worker config (a colocated half)."""
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(PrefixCacheConfig)}
