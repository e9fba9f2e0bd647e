"""Which pods hold which prefix blocks: the router's belief about the engines' caches.

Each pod has a bounded LRU of block hashes, as the engine's own prefix cache is a
bounded LRU of blocks. A shared map from block hash to a bitmask of pod slots makes
a longest-prefix lookup one dict probe per block for all pods at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice


class BlockIndex:
    def __init__(self, capacity_per_pod: int) -> None:
        self.capacity = capacity_per_pod  # until a pod's own is known (set_capacity)
        self._capacity: dict[int, int] = {}  # slot -> blocks, from the engine's KV size
        self._owners: dict[int, int] = {}  # block hash -> bitmask of pod slots
        # slot -> blocks, oldest first. A plain dict keeps insertion order and holds an
        # entry in about half the memory of an OrderedDict (bench.index_memory).
        self._lru: dict[int, dict[int, None]] = {}

    def add_pod(self, slot: int) -> None:
        self._lru.setdefault(slot, {})

    def set_capacity(self, slot: int, blocks: int) -> None:
        """Bound one pod's LRU by its engine's real KV capacity (in router blocks),
        evicting its oldest blocks if that is smaller than what it holds. The bound
        outlives ``drop_pod``: a restarted engine keeps its size."""
        blocks = max(1, blocks)
        self._capacity[slot] = blocks
        lru = self._lru.get(slot)
        if lru is not None and len(lru) > blocks:
            self._evict(slot, lru, len(lru) - blocks)

    def capacity_of(self, slot: int) -> int:
        return self._capacity.get(slot, self.capacity)

    def drop_pod(self, slot: int) -> None:
        """Forget everything a pod held (it left, or its engine restarted)."""
        blocks = self._lru.pop(slot, None)
        if not blocks:
            return
        clear = ~(1 << slot)
        owners = self._owners
        for h in blocks:
            mask = owners[h] & clear
            if mask:
                owners[h] = mask
            else:
                del owners[h]

    def longest_match(self, blocks: Sequence[int], candidates: int) -> tuple[int, int]:
        """``(depth, pods)``: how many leading blocks the best candidates hold, and the
        bitmask of the candidates that hold that many."""
        owners = self._owners
        pods = candidates
        depth = 0
        for h in blocks:
            held = owners.get(h, 0) & pods
            if not held:
                break
            pods = held
            depth += 1
        return depth, (pods if depth else 0)

    def match_depths(self, blocks: Sequence[int], candidates: int) -> dict[int, int]:
        """How many leading blocks each candidate holds, for those holding any.

        One dict probe per block for all pods at once: a pod drops out at the first
        block it lacks, and its depth is where it dropped."""
        owners = self._owners
        alive = candidates
        depths: dict[int, int] = {}
        depth = 0
        for h in blocks:
            held = owners.get(h, 0) & alive
            if depth:
                _assign(depths, alive & ~held, depth)
            alive = held
            if not alive:
                return depths
            depth += 1
        _assign(depths, alive, depth)
        return depths

    def record(self, slot: int, blocks: Sequence[int]) -> None:
        """The pod now holds these blocks (it is about to prefill them)."""
        lru = self._lru.get(slot)
        if lru is None or not blocks:
            return
        bit = 1 << slot
        owners = self._owners
        # Touch the tail first so the head ends most recent: like the engine, evict a
        # conversation's newest blocks before the prefix every later turn needs.
        for h in reversed(blocks):
            if h in lru:
                del lru[h]  # re-inserted below: now the most recent
            else:
                owners[h] = owners.get(h, 0) | bit
            lru[h] = None
        excess = len(lru) - self._capacity.get(slot, self.capacity)
        if excess > 0:
            self._evict(slot, lru, excess)

    def _evict(self, slot: int, lru: dict[int, None], count: int) -> None:
        """Forget a pod's ``count`` least recently used blocks."""
        owners = self._owners
        clear = ~(1 << slot)
        oldest = list(islice(lru, count))
        for h in oldest:
            del lru[h]
            mask = owners[h] & clear
            if mask:
                owners[h] = mask
            else:
                del owners[h]

    def blocks_held(self, slot: int) -> int:
        lru = self._lru.get(slot)
        return len(lru) if lru is not None else 0

    def __len__(self) -> int:
        return len(self._owners)


def _assign(depths: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        depths[low.bit_length() - 1] = depth
        mask ^= low
