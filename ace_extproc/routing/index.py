"""Which pods hold which prefix blocks: the router's belief about the engines' caches.

Each pod has a bounded LRU of block hashes, as the engine's own prefix cache is a
bounded LRU of blocks. That is the only per-block structure: where the extension was
built a ``BlockLRU`` (``_lru.c``: a block's hash and its list links in 16 bytes, plus
its slot in a hash table), else a plain dict of the hashes' ints in recency order, the
reference (~80 bytes a block); ``bench.index_memory`` measures both.

Lookups lean on the chain: block ``i``'s hash covers every block before it, and
``record`` refreshes a prompt's blocks tail first, so each pod's held blocks of any
one prompt are a leading run (its LRU always evicts a chain's tail before its head).
A pod's match depth is then the length of that run, found by binary search, and
only pods holding the prompt's first block need one: a small map from first blocks
("roots") to a bitmask of pods finds them in one probe for the whole fleet.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from ace_extproc import native
from ace_extproc.native import lru as reference

if TYPE_CHECKING:
    from ace_extproc.native._speedups import BlockLRU

# The bytes a tracked block's hash int object takes (64-bit values need 3 digits).
_INT_BYTES = sys.getsizeof(2**63)

# A pod's blocks, least recently used first: the C type, or the reference dict.
LRU: TypeAlias = "BlockLRU | dict[int, None]"


# What ``BlockIndex.room`` reads, for pricing every candidate in one call:
# (slot -> LRU, slot -> capacity where known, the default capacity).
RoomView: TypeAlias = tuple[dict[int, LRU], dict[int, int], int]


class BlockIndex:
    def __init__(self, capacity_per_pod: int, *, pure: bool = False) -> None:
        """``pure``: the Python reference structures even where the extension was
        built (tests compare the two)."""
        self.capacity = capacity_per_pod  # until a pod's own is known (set_capacity)
        self._capacity: dict[int, int] = {}  # slot -> blocks, from the engine's KV size
        self._ops = reference.REFERENCE if pure else native.LRU_OPS
        self._lru: dict[int, LRU] = {}  # slot -> block hashes, least recently used first
        self._roots: dict[int, int] = {}  # first block of a prompt -> bitmask of holders

    @property
    def native(self) -> bool:
        """Whether the LRUs are the C ``BlockLRU`` (not the reference dicts)."""
        return self._ops is not reference.REFERENCE

    @property
    def roots(self) -> dict[int, int]:
        """First block of a prompt -> bitmask of the pods holding it (live, not a copy)."""
        return self._roots

    def add_pod(self, slot: int) -> None:
        if slot not in self._lru:
            self._lru[slot] = self._ops.new_lru()

    def set_capacity(self, slot: int, blocks: int) -> None:
        """Bound one pod's LRU by its engine's real KV capacity (in router blocks),
        evicting its oldest blocks if that is smaller than what it holds. The bound
        outlives ``drop_pod``: a restarted engine keeps its size."""
        blocks = max(1, blocks)
        self._capacity[slot] = blocks
        lru = self._lru.get(slot)
        if lru is not None and len(lru) > blocks:
            self._ops.evict(lru, self._roots, 1 << slot, len(lru) - blocks)

    def capacity_of(self, slot: int) -> int:
        return self._capacity.get(slot, self.capacity)

    def drop_pod(self, slot: int) -> None:
        """Forget everything a pod held (it left, or its engine restarted)."""
        if not self._lru.pop(slot, None):
            return
        bit = 1 << slot
        roots = self._roots
        for h in [h for h, mask in roots.items() if mask & bit]:
            if mask := roots[h] & ~bit:
                roots[h] = mask
            else:
                del roots[h]

    def retire_pod(self, slot: int) -> None:
        """The slot goes to another pod: forget its blocks and its learned bound too."""
        self.drop_pod(slot)
        self._capacity.pop(slot, None)

    def match_depths(self, blocks: Sequence[int], candidates: int) -> dict[int, int]:
        """How many leading blocks each candidate holds, for those holding any."""
        if not blocks:
            return {}
        return self._ops.match(self._lru, blocks, self._roots.get(blocks[0], 0) & candidates)

    def longest_match(self, blocks: Sequence[int], candidates: int) -> tuple[int, int]:
        """``(depth, pods)``: how many leading blocks the best candidates hold, and the
        bitmask of the candidates that hold that many."""
        depths = self.match_depths(blocks, candidates)
        depth = max(depths.values(), default=0)
        pods = 0
        for slot, d in depths.items():
            if d == depth:
                pods |= 1 << slot
        return depth, pods

    def record(self, slot: int, blocks: Sequence[int]) -> None:
        """The pod now holds these blocks (it is about to prefill them)."""
        lru = self._lru.get(slot)
        if lru is not None:
            capacity = self._capacity.get(slot, self.capacity)
            self._ops.record(lru, blocks, self._roots, 1 << slot, capacity)

    def blocks_held(self, slot: int) -> int:
        lru = self._lru.get(slot)
        return len(lru) if lru is not None else 0

    def room(self, slot: int) -> int:
        """Blocks the pod can take before it must evict (negative: over its bound)."""
        lru = self._lru.get(slot)
        return self._capacity.get(slot, self.capacity) - (len(lru) if lru is not None else 0)

    def room_view(self) -> RoomView:
        """What ``room`` reads for every slot at once (live, not a copy), for pricing
        every candidate in one pass."""
        return self._lru, self._capacity, self.capacity

    def approx_bytes(self) -> int:
        """The index's memory: its LRUs' and the roots' tables, and the hashes' int
        objects (the dicts' one per entry, an upper bound: a block held by several pods
        shares its int; the C LRU's none, so only the roots')."""
        tables = sum(sys.getsizeof(lru) for lru in self._lru.values())
        ints = len(self) if self._ops.ints_per_block else len(self._roots)
        return tables + sys.getsizeof(self._roots) + _INT_BYTES * ints

    def __len__(self) -> int:
        """Blocks tracked, counted once per pod that holds them."""
        return sum(len(lru) for lru in self._lru.values())
