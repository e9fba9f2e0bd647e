"""Uniform random: each request to a candidate pod drawn uniformly.

Follows the ``random`` policy of the SGLang Model Gateway and the vLLM Router
(``/work/shared/reference/peers.md``). Seeded (``seed=0`` by default) so that a
benchmark run is reproducible. No cache belief: every pick is a "miss".
"""

from __future__ import annotations

import random

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import make_pick, slots_of


class RandomPicker:
    def __init__(self, fleet: FleetState, index: BlockIndex, seed: int = 0) -> None:
        self.fleet = fleet
        self._rng = random.Random(seed)

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        return make_pick(self.fleet, self._rng.choice(slots_of(candidates)))
