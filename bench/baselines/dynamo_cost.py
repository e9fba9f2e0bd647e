"""NVIDIA Dynamo KV router, its default cost function.

Follows ``/work/shared/reference/peers.md`` and Dynamo's router documentation
(docs.nvidia.com/dynamo, "KV Router" and "Router Design"): for each worker,
``cost = overlap_score_weight * potential_prefill_blocks + potential_active_blocks``,
lowest wins; ``potential_prefill_blocks`` = the request's blocks not cached on that
worker, ``potential_active_blocks`` = the worker's active blocks plus the new request's.
Defaults: ``--kv-overlap-score-weight 1.0``, ``--router-temperature 0.0`` (deterministic:
the argmin; with a temperature Dynamo samples a softmax over the costs instead).

Approximations:
- Dynamo's index is exact, built from the engines' KV events. The simulation gives
  pickers no KV events, so the overlap comes from its own ``BlockIndex`` filled from its
  own picks (like Dynamo's approximate ``--no-kv-events`` mode, with the index's LRU bound
  instead of its 120 s TTL). Real Dynamo with KV events would be more precise: it would
  see engine evictions that this index only guesses at.
- Blocks are the router's 512-byte prefix blocks (~128 tokens), not the engine's KV
  block size; both terms are counted in the same unit, so the trade-off is unchanged.
- Active blocks: Dynamo tracks each request it routed until it finishes, counting the
  unique blocks of a worker's active sequences. A picker hears of no completions, but
  the fleet state counts each pod's in-flight requests (``inflight``, exact in the
  simulation); the in-flight ones are taken to be the most recent that many routed there,
  and their distinct prompt blocks are counted (the last 128 exactly, any beyond at the
  mean size). Generated tokens are not counted (their length is unknown at routing).
- Ties at temperature 0 are broken at random (seeded).
"""

from __future__ import annotations

import random
from collections import deque
from itertools import islice

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import BLOCK_BYTES, make_pick, slots_of

_TRACKED = 128  # recent requests per pod whose blocks are counted exactly


class DynamoCostPicker:
    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        overlap_score_weight: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.overlap_score_weight = overlap_score_weight
        self._rng = random.Random(seed)
        self._recent: list[deque[list[int]]] = [deque(maxlen=_TRACKED) for _ in fleet.pods]
        for slot in range(len(fleet.pods)):
            index.add_pod(slot)

    def active_blocks(self, slot: int, new: list[int]) -> int:
        """Distinct blocks of the pod's in-flight requests and of the new one."""
        n = self.fleet.load[slot].inflight
        recent = self._recent[slot]
        seqs = list(islice(reversed(recent), min(n, len(recent))))
        active = len(set(new).union(*seqs))
        if n > len(seqs) and recent:  # more in flight than tracked: at the mean size
            active += (n - len(seqs)) * sum(map(len, recent)) // len(recent)
        return active

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        blocks = request.hashes.blocks
        total = -(-len(request.prompt) // BLOCK_BYTES)  # the partial tail is a block too
        best: list[int] = []
        best_cost = 0.0
        overlaps: dict[int, int] = {}
        for slot in slots_of(candidates):
            overlap = overlaps[slot] = self.index.longest_match(blocks, 1 << slot)[0]
            cost = self.overlap_score_weight * (total - overlap) + self.active_blocks(slot, blocks)
            if not best or cost < best_cost:
                best, best_cost = [slot], cost
            elif cost == best_cost:
                best.append(slot)
        slot = best[0] if len(best) == 1 else self._rng.choice(best)
        self.index.record(slot, blocks)
        self._recent[slot].append(blocks)
        return make_pick(self.fleet, slot, overlaps[slot])
