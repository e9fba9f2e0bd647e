"""Round robin: each request to the next candidate pod in slot order.

Follows the ``round_robin`` policy of the SGLang Model Gateway and the vLLM Router
(``/work/shared/reference/peers.md``): a rotating counter over the healthy workers.
They index ``counter % len(healthy)``; here the rotation is kept by slot (the next
candidate after the last one picked), which is the same cycle while the candidates are
unchanged and stays even when a pod leaves or joins. No cache belief: every pick is a
"miss" with ``matched_blocks=0``.
"""

from __future__ import annotations

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import make_pick


class RoundRobinPicker:
    def __init__(self, fleet: FleetState, index: BlockIndex) -> None:
        self.fleet = fleet
        self._last = -1

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        after = candidates >> (self._last + 1) << (self._last + 1)  # candidates past the last
        chosen = after or candidates  # none past it: wrap around to the lowest
        slot = (chosen & -chosen).bit_length() - 1
        self._last = slot
        return make_pick(self.fleet, slot)
