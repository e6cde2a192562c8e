"""The prefix-cache key spec: one hash chain over full KV blocks, shared by every service (torch-free).

A prompt's full blocks are keyed by a chain: block i's key is

    key_i = SHA-256(key_{i-1} || its block_size token ids as little-endian uint32)

and key_{-1}, the chain's seed, names everything that makes two blocks' KV interchangeable:
the hash version, the model, the KV dtype, the block size, the deployment's seed, and the request's
`cache_salt`. Equal keys therefore mean equal tokens at equal positions under the same model and
namespace, so a worker may reuse the block's KV instead of computing it. Only full blocks are keyed:
a partial last block is never shared.

The seed is per deployment (`prefix_seed`, the same in every service), never per process, so workers
and routers compute the same keys. SHA-256 rather than Python's `hash` or a fast non-cryptographic
hash: a caller who can craft a collision could read or poison another request's KV.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import sys

HASH_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PrefixNamespace:
    """What two blocks must share to be interchangeable, besides their tokens and position."""

    model: str  # the model's identity as the deployment names it (folder or default:<size>)
    dtype: str  # the KV cache's dtype, e.g. "bfloat16"
    block_size: int  # tokens per keyed block
    deployment_seed: str = ""  # the same in every service of one deployment

    def seed(self, cache_salt: str = "") -> bytes:
        """The chain's seed for requests with this `cache_salt` ("" for none): requests share blocks
        only when their salts are equal."""
        fields = (f"distserve-prefix-v{HASH_VERSION}", self.model, self.dtype, str(self.block_size),
                  self.deployment_seed, cache_salt)
        return hashlib.sha256("\x00".join(fields).encode()).digest()


def longest_run(keys: list[bytes], block_of: dict[bytes, int]) -> list[int]:
    """The blocks `block_of` maps the longest run of `keys` from the first to, in order."""
    blocks = []
    for key in keys:
        block = block_of.get(key)
        if block is None:
            break
        blocks.append(block)
    return blocks


def reusable_keys(keys: list[bytes], num_prompt_tokens: int, block_size: int) -> list[bytes]:
    """The keys a prompt may take from a cache: its full blocks, short of its last token, which is
    always computed (its logits give the first token)."""
    return keys[:(num_prompt_tokens - 1) // block_size]


def _token_bytes(token_ids: list[int]) -> bytes:
    packed = array.array("I", token_ids)  # uint32: every vocabulary fits; negative ids raise
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def block_keys(token_ids: list[int], block_size: int, seed: bytes, max_blocks: int | None = None) -> list[bytes]:
    """The keys of the full blocks of `token_ids` (at most `max_blocks` of them), in order."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    keys, parent = [], seed
    for i in range(num_blocks):
        parent = hashlib.sha256(parent + _token_bytes(token_ids[i * block_size:(i + 1) * block_size])).digest()
        keys.append(parent)
    return keys
