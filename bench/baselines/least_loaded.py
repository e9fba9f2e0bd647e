"""Least loaded: each request to the candidate with the fewest in-flight requests.

The load-only half of the SGLang / vLLM routers' ``cache_aware`` policy (their "shortest
queue" branch, ``/work/shared/reference/peers.md``): load is the router's own count of
requests it routed and has not seen finish (``PodLoad.inflight``; exact in the fleet
simulation). Ties go to the lowest slot, as their ``min_by_key`` does, so with no load
at all every request lands on the first pod; that carries no accidental cache affinity
(a rendezvous tie-break on the prefix would). No cache belief: every pick is a "miss".
Also the placement of ``bound_pooled`` (``bounds.py``).
"""

from __future__ import annotations

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import least_inflight, make_pick, slots_of


class LeastLoadedPicker:
    def __init__(self, fleet: FleetState, index: BlockIndex) -> None:
        self.fleet = fleet

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        return make_pick(self.fleet, least_inflight(self.fleet, slots_of(candidates)))
