"""A block-level prefix cache that behaves like vLLM's (v1 KV cache manager).

* The pod has ``num_gpu_blocks`` KV blocks of ``block_size`` tokens.
* Only full blocks of a prompt are cached.  A block is named by a chained hash:
  ``H(parent hash, its token ids[, cache_salt])``; the salt enters block 0
  only, and since every later hash chains from block 0, requests with
  different salts never share a block.
* A running request holds references on its blocks.  Unreferenced cached blocks
  stay cached until their space is needed and are then evicted least recently
  freed first.  A request frees its blocks last-to-first, so a prompt's leaf
  blocks go before its parents (as in vLLM's free-block queue).
* As in vLLM, a prompt that is cached in full still recomputes its last token:
  the match is limited to ``len(tokens) - 1`` tokens, rounded down to blocks.

Simplifications, documented: blocks for the whole prompt and the reserved
output are taken at admission (vLLM grows them step by step and may preempt),
and blocks filled by generated tokens are not cached (the sim's output is
filler; the next turn's prompt re-renders it anyway).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

_hash = xxhash.xxh3_64_intdigest
_ROOT = b"\x00" * 8  # parent of block 0, the stand-in for vLLM's NONE_HASH seed


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``tokens``.

    Token ids must fit in 32 bits (the API layer checks them against the vocabulary).
    """
    full = len(tokens) // block_size
    if full == 0:
        return []
    data = array("I", tokens[: full * block_size]).tobytes()
    step = block_size * 4
    extra = b"\x00cache_salt\x00" + salt.encode("utf-8") if salt is not None else b""
    out: list[int] = []
    parent = _ROOT
    for i in range(full):
        chunk = data[i * step : (i + 1) * step]
        value = _hash(parent + chunk + extra if i == 0 else parent + chunk)
        out.append(value)
        parent = value.to_bytes(8, "little")
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Allocation:
    """The blocks one running request holds."""

    hashes: list[int]  # hashes of the prompt's full blocks
    cached_tokens: int  # prefix tokens found in the cache at admission
    held: list[int] = field(default_factory=list)  # cached blocks referenced, prompt order
    anonymous: int = 0  # blocks held that carry no hash yet (new prompt blocks, tail, output)
    released: bool = False


class PrefixCache:
    """Block pool + prefix index for one pod.  Not thread-safe (one event loop)."""

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 8192) -> None:
        if block_size < 1 or num_gpu_blocks < 1:
            raise ValueError("block_size and num_gpu_blocks must be positive")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self._refs: dict[int, int] = {}  # cached block hash -> references
        self._free: OrderedDict[int, None] = OrderedDict()  # unreferenced cached, LRU first
        self._anonymous = 0  # blocks in use that are not in the index
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)
        self.evictions = 0  # cached blocks evicted

    # -- accounting -----------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        """Blocks holding indexed content, referenced or not."""
        return len(self._refs)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests."""
        return len(self._refs) - len(self._free) + self._anonymous

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: referenced blocks over all blocks (0..1)."""
        return self.used_blocks / self.num_gpu_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _empty(self) -> int:
        return self.num_gpu_blocks - len(self._refs) - self._anonymous

    # -- lookups --------------------------------------------------------------------
    def _matched(self, hashes: list[int], num_tokens: int) -> int:
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        n = 0
        while n < limit and hashes[n] in self._refs:
            n += 1
        return n

    def match(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Cached prefix tokens a request for ``tokens`` would get now (no side effects)."""
        if not tokens:
            return 0
        hashes = block_hashes(tokens, self.block_size, salt)
        return self._matched(hashes, len(tokens)) * self.block_size

    # -- lifecycle ------------------------------------------------------------------
    def allocate(
        self, tokens: Sequence[int], salt: str | None = None, *, extra_tokens: int = 0
    ) -> Allocation | None:
        """Admit a request: reference its cached prefix and take blocks for the rest.

        ``extra_tokens`` reserves room for the output.  Returns None, changing
        nothing, when the free and evictable blocks cannot hold the request.
        """
        hashes = block_hashes(tokens, self.block_size, salt)
        matched = self._matched(hashes, len(tokens)) if tokens else 0
        needed = self.blocks_for(len(tokens) + extra_tokens) - matched
        revived = sum(1 for h in hashes[:matched] if self._refs[h] == 0)
        if needed > self._empty() + len(self._free) - revived:
            return None
        held = hashes[:matched]
        for h in held:
            if self._refs[h] == 0:
                del self._free[h]
            self._refs[h] += 1
        while self._empty() < needed:
            victim, _ = self._free.popitem(last=False)
            del self._refs[victim]
            self.evictions += 1
        self._anonymous += needed
        self.queries += len(tokens)
        self.hits += matched * self.block_size
        return Allocation(hashes, matched * self.block_size, held, needed)

    def commit(self, alloc: Allocation) -> None:
        """The prefill is done: index the prompt's newly computed full blocks."""
        if alloc.released:
            return
        for h in alloc.hashes[len(alloc.held) :]:
            refs = self._refs.get(h)
            if refs is None:
                self._refs[h] = 1  # our anonymous block now carries this content
            else:
                # Another request computed the same block meanwhile: share its
                # copy and give ours back, as vLLM dedups on cache insertion.
                if refs == 0:
                    del self._free[h]
                self._refs[h] = refs + 1
            self._anonymous -= 1
            alloc.anonymous -= 1
            alloc.held.append(h)

    def release(self, alloc: Allocation) -> None:
        """The request finished: drop its references (idempotent)."""
        if alloc.released:
            return
        alloc.released = True
        for h in reversed(alloc.held):  # leaf first, so leaves are evicted first
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._free[h] = None
        self._anonymous -= alloc.anonymous
        alloc.anonymous = 0

    def reset(self) -> int:
        """Drop every unreferenced cached block (vLLM's /reset_prefix_cache)."""
        dropped = len(self._free)
        for h in self._free:
            del self._refs[h]
        self._free.clear()
        return dropped
