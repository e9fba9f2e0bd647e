"""Prefix hashing: chained xxhash over fixed-size blocks of the canonical prompt.

Block ``i``'s hash is ``xxh3_64(block_i, seed=hash_{i-1})`` and block 0 is seeded
from the tenant and model, so two prompts share exactly the leading block hashes
whose text (and tenant, and model) they share, and one tenant's blocks never
match another's. Only full blocks are hashed, as engines cache only full blocks.

``prefix_key`` names the cacheable prefix (for chat, the conversation up to its
newest user turn; for a plain prompt, its leading full blocks): the chain hash at
the last full block inside the prefix, extended by the prefix's partial tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from ace_extproc import native

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(slots=True)
class PrefixHashes:
    blocks: list[int]  # chained hashes of the prompt's full blocks
    prefix_key: str  # 16 hex characters
    seed: int

    @property
    def route_key(self) -> int:
        """What places a new prefix: its first block, or for a prompt shorter than
        one block, the prefix key (such prompts are too short to be worth caching)."""
        return self.blocks[0] if self.blocks else int(self.prefix_key, 16)


_seeds: dict[tuple[str, str], int] = {}


def scope_seed(tenant: str, model: str) -> int:
    """The chain's seed: a tenant's and model's blocks live in their own hash space."""
    key = (tenant, model)
    seed = _seeds.get(key)
    if seed is None:
        if len(_seeds) > 65536:  # bounded: tenants x models is small, but be safe
            _seeds.clear()
        seed = _seeds[key] = _xxh3(f"{tenant}\x00{model}".encode())
    return seed


def hash_prompt(
    prompt: bytes, cacheable_end: int | None, block_bytes: int, seed: int
) -> PrefixHashes:
    """Block hashes and prefix key; ``cacheable_end=None`` means the leading full blocks."""
    blocks, key = native.prefix_hashes(prompt, cacheable_end, block_bytes, seed)
    return PrefixHashes(blocks, key, seed)


def cache_prefix_id(tenant: str, prefix_key: str) -> str:
    return f"ace-kv-{tenant}-{prefix_key}"
