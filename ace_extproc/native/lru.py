"""The reference for the ``lru`` piece: each pod's blocks as a dict of the hashes'
ints in recency order (~80 bytes a block, against the C ``BlockLRU``'s 16), and the
index's three operations on it. ``Structures`` names either implementation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice
from types import ModuleType
from typing import Any, NamedTuple


def record(
    lru: dict[int, None], blocks: Sequence[int], roots: dict[int, int], bit: int, capacity: int
) -> None:
    """The pod whose LRU is ``lru`` (its bit in ``roots`` masks: ``bit``) now holds
    ``blocks``: they move to the most recent end, the tail first so the head ends most
    recent (like the engine, evict a conversation's newest blocks before the prefix
    every later turn needs); the first block's holders gain the pod; past ``capacity``
    its least recently used blocks are forgotten."""
    if not blocks:
        return
    pop = lru.pop
    for h in reversed(blocks):
        pop(h, None)
        lru[h] = None  # re-inserted: now the most recent
    root = blocks[0]
    roots[root] = roots.get(root, 0) | bit
    if (excess := len(lru) - capacity) > 0:
        evict(lru, roots, bit, excess)


def evict(lru: dict[int, None], roots: dict[int, int], bit: int, count: int) -> None:
    """Forget the ``count`` least recently used blocks of the pod whose bit is ``bit``."""
    for h in list(islice(lru, count)):
        del lru[h]
        if h in roots:  # a chain's head goes last, so its holders stay exact
            if mask := roots[h] & ~bit:
                roots[h] = mask
            else:
                del roots[h]


def match(lrus: dict[int, dict[int, None]], blocks: Sequence[int], holders: int) -> dict[int, int]:
    """How many leading ``blocks`` each pod of the ``holders`` bitmask holds (each holds
    the first): the length of its held run, by binary search on the chain."""
    depths: dict[int, int] = {}
    n = len(blocks)
    last = blocks[n - 1]
    while holders:
        low = holders & -holders
        holders ^= low
        slot = low.bit_length() - 1
        lru = lrus[slot]
        if last in lru:
            depths[slot] = n
            continue
        lo, hi = 1, n - 1  # blocks[:lo] held, blocks[:hi + 1] not
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if blocks[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        depths[slot] = lo
    return depths


class Structures(NamedTuple):
    """One implementation of the index's per-pod LRU and its operations."""

    new_lru: Callable[[], Any]
    record: Callable[[Any, Sequence[int], dict[int, int], int, int], None]
    evict: Callable[[Any, dict[int, int], int, int], None]
    match: Callable[[dict[int, Any], Sequence[int], int], dict[int, int]]
    ints_per_block: bool  # each held block keeps its hash's int object alive

    @classmethod
    def of(cls, extension: ModuleType) -> Structures:
        """The C implementation, from the compiled module."""
        return cls(extension.BlockLRU, extension.record, extension.evict, extension.match, False)


REFERENCE = Structures(dict, record, evict, match, True)
