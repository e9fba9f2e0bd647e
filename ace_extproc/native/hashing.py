"""The reference for the ``prompt`` piece's hashing: chained xxh3 over full blocks."""

from __future__ import annotations

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def chain(data: bytes, block_bytes: int, seed: int, /) -> list[int]:
    """Chained hashes of every full block of ``data``: ``h_i = xxh3(block_i, h_{i-1})``,
    ``h_{-1} = seed``."""
    out: list[int] = []
    h = seed
    # Plain bytes slices measured faster here than memoryview slices for 512 B blocks.
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        out.append(h := _xxh3(data[start : start + block_bytes], h))
    return out


def prefix_hashes(
    prompt: bytes, cacheable_end: int | None, block_bytes: int, seed: int, /
) -> tuple[list[int], str]:
    """The prompt's block hashes, and the prefix key: the chain hash at the last full
    block inside ``prompt[:cacheable_end]``, extended by the prefix's partial tail, as
    16 hex characters (``cacheable_end=None``: the leading full blocks)."""
    blocks = chain(prompt, block_bytes, seed)
    if cacheable_end is None:
        cacheable_end = len(blocks) * block_bytes
    elif not 0 <= cacheable_end <= len(prompt):
        raise IndexError("prefix_hashes: cacheable_end out of the prompt")
    full = cacheable_end // block_bytes
    h = blocks[full - 1] if full else seed
    tail = prompt[full * block_bytes : cacheable_end]
    if tail:
        h = _xxh3(tail, h)
    return blocks, f"{h:016x}"
