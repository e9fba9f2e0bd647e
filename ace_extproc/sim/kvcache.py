"""A block-level prefix cache that behaves like vLLM's (v1 KV cache manager).

* The pod has ``num_gpu_blocks`` KV blocks of ``block_size`` tokens.
* Only full blocks of a prompt are cached.  A block is named by a chained hash:
  ``H(parent hash, its token ids[, cache_salt][, LoRA adapter])``; the salt and the
  adapter enter block 0 only, and since every later hash chains from block 0,
  requests with different salts, or for different adapters, never share a block
  (vLLM puts the adapter among a block's extra keys: an adapter's KV differs).
* A running request holds references on its blocks.  Unreferenced cached blocks
  stay cached until their space is needed and are then evicted least recently
  freed first.  A request frees its blocks last-to-first, so a prompt's leaf
  blocks go before its parents (as in vLLM's free-block queue).
* As in vLLM, a prompt that is cached in full still recomputes its last token:
  the match is limited to ``len(tokens) - 1`` tokens, rounded down to blocks.

Two ways to name blocks, one pool: :func:`block_hashes` hashes token ids (prompts
sent as ids), :func:`text_block_keys` hashes the UTF-8 text directly.  The sim's
tokenizer maps each 4-byte chunk of UTF-8 to one token, so a block of
``block_size`` tokens is exactly ``4 * block_size`` bytes of text, and two texts
share a block key exactly when they share those bytes (and everything before,
and the salt), just as they would share the block's token ids.  Keying on the
bytes skips hashing every token (a 60 KB prompt: ~0.2 ms instead of ~2.5 ms).  The
two key spaces are disjoint: a prompt sent as ids does not hit the cache of the
same prompt sent as text (a client cannot produce the sim's ids but through
``/tokenize``).  The ``*_keys`` methods take precomputed keys of either kind.

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
from typing import Protocol

import xxhash

from .tokenizer import BYTES_PER_TOKEN

_hash = xxhash.xxh3_64_intdigest
_ROOT = b"\x00" * 8  # parent of block 0, the stand-in for vLLM's NONE_HASH seed
_TEXT_ROOT = _hash(b"sim text blocks")  # seed of block 0 of text keys (own key space)


def _extra(salt: str | None, adapter: str | None) -> bytes:
    """Block 0's extra keys: the cache salt, the LoRA adapter (none: the base model)."""
    extra = b"\x00cache_salt\x00" + salt.encode("utf-8") if salt is not None else b""
    if adapter is not None:
        extra += b"\x00lora\x00" + adapter.encode("utf-8")
    return extra


def block_hashes(
    tokens: Sequence[int], block_size: int, salt: str | None = None, adapter: str | None = None
) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``tokens``.

    Token ids must fit in 32 bits (the API layer checks them against the vocabulary).
    """
    full = len(tokens) // block_size
    if full == 0:
        return []
    data = array("I", tokens[: full * block_size]).tobytes()
    step = block_size * 4
    extra = _extra(salt, adapter)
    out: list[int] = []
    parent = _ROOT
    for i in range(full):
        chunk = data[i * step : (i + 1) * step]
        value = _hash(parent + chunk + extra if i == 0 else parent + chunk)
        out.append(value)
        parent = value.to_bytes(8, "little")
    return out


def text_block_keys(
    data: bytes, block_size: int, salt: str | None = None, adapter: str | None = None
) -> list[int]:
    """Chained 64-bit keys of the full token blocks of UTF-8 ``data``.

    Block ``i`` is ``data[i*B : (i+1)*B]`` with ``B = 4 * block_size`` bytes (the
    tokenizer's 4-byte chunks); ``key_i = xxh3(block_i, seed=key_{i-1})``, and block
    0 also hashes the salt and the adapter.  A trailing partial block has no key, and neither has a
    block ending in a short (under 4 bytes) last token: no other prompt could match
    it (see the recompute-last-token rule), so nothing is lost.
    """
    step = block_size * BYTES_PER_TOKEN
    full = len(data) // step
    if full == 0:
        return []
    first = data[:step]
    if salt is not None or adapter is not None:
        first += _extra(salt, adapter)
    key = _hash(first, _TEXT_ROOT)
    out = [key]
    append = out.append
    for start in range(step, full * step, step):
        key = _hash(data[start : start + step], key)
        append(key)
    return out


def text_tokens(data: bytes) -> int:
    """Tokens of UTF-8 ``data`` under the sim's tokenizer (``len(encode(text))``)."""
    return -(-len(data) // BYTES_PER_TOKEN)


def prompt_keys(
    prompt: Sequence[int] | bytes,
    block_size: int,
    salt: str | None = None,
    adapter: str | None = None,
) -> tuple[int, list[int]]:
    """``(tokens, block keys)`` of a prompt given as UTF-8 text or as token ids."""
    if isinstance(prompt, bytes):
        return text_tokens(prompt), text_block_keys(prompt, block_size, salt, adapter)
    return len(prompt), block_hashes(prompt, block_size, salt, adapter)


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


class CacheEvents(Protocol):
    """Where the cache reports what leaves it (kv_events.KVEventPublisher).  What
    enters it is reported by the engine, which has the prompt's token ids."""

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


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
        self.events: CacheEvents | None = None  # KV events off: nothing is collected

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
    def _matched(self, hashes: Sequence[int], num_tokens: int) -> int:
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        refs = self._refs
        n = 0
        while n < limit and hashes[n] in refs:
            n += 1
        return n

    def match(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Cached prefix tokens a request for ``tokens`` would get now (no side effects)."""
        if not tokens:
            return 0
        return self.match_keys(block_hashes(tokens, self.block_size, salt), len(tokens))

    def match_keys(self, keys: Sequence[int], num_tokens: int) -> int:
        """:meth:`match` of a prompt of ``num_tokens`` tokens whose full blocks have ``keys``."""
        if num_tokens <= 0:
            return 0
        return self._matched(keys, num_tokens) * self.block_size

    # -- lifecycle ------------------------------------------------------------------
    def allocate(
        self, tokens: Sequence[int], salt: str | None = None, *, extra_tokens: int = 0
    ) -> Allocation | None:
        """Admit a request: reference its cached prefix and take blocks for the rest.

        ``extra_tokens`` reserves room for the output.  Returns None, changing
        nothing, when the free and evictable blocks cannot hold the request.
        """
        hashes = block_hashes(tokens, self.block_size, salt)
        return self.allocate_keys(hashes, len(tokens), extra_tokens=extra_tokens)

    def allocate_keys(
        self, keys: list[int], num_tokens: int, *, extra_tokens: int = 0
    ) -> Allocation | None:
        """:meth:`allocate` of a prompt of ``num_tokens`` tokens whose full blocks have
        ``keys`` (from :func:`text_block_keys` or :func:`block_hashes`)."""
        hashes = keys
        refs, free = self._refs, self._free
        matched = self._matched(hashes, num_tokens) if num_tokens > 0 else 0
        needed = self.blocks_for(num_tokens + extra_tokens) - matched
        held = hashes[:matched]
        revived = 0  # matched blocks that sit in the free queue (so are not evictable)
        for h in held:
            if not refs[h]:
                revived += 1
        if needed > self._empty() + len(free) - revived:
            return None
        for h in held:
            r = refs[h]
            if not r:
                del free[h]
            refs[h] = r + 1
        shortfall = needed - self._empty()
        if shortfall > 0:
            self._evict(shortfall)
        self._anonymous += needed
        self.queries += num_tokens
        self.hits += matched * self.block_size
        return Allocation(hashes, matched * self.block_size, held, needed)

    def _evict(self, count: int) -> None:
        """Drop the ``count`` least recently freed cached blocks."""
        refs, popitem = self._refs, self._free.popitem
        if self.events is None:
            for _ in range(count):
                victim, _none = popitem(last=False)
                del refs[victim]
        else:
            victims = [popitem(last=False)[0] for _ in range(count)]
            for victim in victims:
                del refs[victim]
            self.events.removed(victims)
        self.evictions += count

    def commit(self, alloc: Allocation, blocks: int | None = None) -> range:
        """The prefill is done: index the prompt's newly computed full blocks.

        ``blocks`` limits it to the first ``blocks`` full blocks, for a prefill done
        in chunks (vLLM caches each full block as soon as it is computed).  Returns
        the indexes of the blocks committed now, among them any that another request
        committed meanwhile (vLLM reports those as stored again, too).
        """
        first = len(alloc.held)
        if alloc.released:
            return range(first, first)
        end = len(alloc.hashes) if blocks is None else min(blocks, len(alloc.hashes))
        new = alloc.hashes[first:end]
        if not new:
            return range(first, first)
        refs, free = self._refs, self._free
        for h in new:
            r = refs.get(h)
            if r is None:
                refs[h] = 1  # our anonymous block now carries this content
            else:
                # Another request computed the same block meanwhile: share its
                # copy and give ours back, as vLLM dedups on cache insertion.
                if not r:
                    del free[h]
                refs[h] = r + 1
        self._anonymous -= len(new)
        alloc.anonymous -= len(new)
        alloc.held.extend(new)
        return range(first, end)

    def release(self, alloc: Allocation) -> None:
        """The request finished: drop its references (idempotent)."""
        if alloc.released:
            return
        alloc.released = True
        refs, free = self._refs, self._free
        for h in reversed(alloc.held):  # leaf first, so leaves are evicted first
            r = refs[h] - 1
            refs[h] = r
            if not r:
                free[h] = None
        self._anonymous -= alloc.anonymous
        alloc.anonymous = 0

    def reset(self) -> int:
        """Drop every unreferenced cached block (vLLM's /reset_prefix_cache).

        Reported as AllBlocksCleared when the index ends up empty; while running
        requests keep blocks cached, as BlockRemoved of those dropped (vLLM refuses
        a reset then, so it has no event for this case).
        """
        dropped = list(self._free)
        for h in dropped:
            del self._refs[h]
        self._free.clear()
        if self.events is not None:
            if self._refs:
                self.events.removed(dropped)
            else:
                self.events.cleared()
        return len(dropped)
