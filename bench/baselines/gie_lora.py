"""Gateway API Inference Extension with its LoRA-affinity filter before its scorers.

Follows kubernetes-sigs/gateway-api-inference-extension,
``pkg/epp/scheduling/framework/plugins/filter/lora_affinity_filter.go`` (the
``lora-affinity`` filter) and ``pkg/epp/backend/metrics`` (how a pod's adapters are
read): from each scrape of ``vllm:lora_requests_info``, the newest sample's
``running_lora_adapters`` and ``waiting_lora_adapters`` (a pod's active and waiting
models) and ``max_lora``. For the request's model (its ``model``), the filter keeps

1. the pods with the adapter running or waiting ("affinity"), with probability 0.999
   (the default threshold) when there are also pods of the next group;
2. else the pods with fewer adapters running or waiting than ``max_lora``
   ("available");
3. else none: an empty result, which the pipeline here takes as no filter (every pod
   stays a candidate, as GIE's older decision tree fell back to).

Then GIE's default scorers and max-score picker choose among those left
(``gie_scorers.GIEScorerPicker``: queue, KV utilisation, prefix).

A pod that has shown no sample yet (vLLM has none before its first request) has no
slots to GIE, so it is neither "affinity" nor "available".

Approximations: the adapters are what the simulation's last scrape said (every
100 ms here; GIE scrapes every 50 ms), with no count of GIE's own picks since, as in
GIE; GIE skips samples whose adapter labels are both empty (so an idle pod keeps its
last adapters there), here the newest sample is taken whatever it says; the random
draw is seeded.
"""

from __future__ import annotations

import random

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import slots_of
from bench.baselines.gie_scorers import GIEScorerPicker

AFFINITY_THRESHOLD = 0.999  # GIE's config.DefaultLoraAffinityThreshold


class GIELoraPicker:
    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        threshold: float = AFFINITY_THRESHOLD,
        seed: int = 0,
    ) -> None:
        self.fleet = fleet
        self.threshold = threshold
        self.scorers = GIEScorerPicker(fleet, index, seed=seed)
        self._rng = random.Random(seed)

    def lora_filter(self, request: RoutingRequest, candidates: int) -> int:
        """The candidates GIE's lora-affinity filter keeps (0: none)."""
        affinity = available = 0
        model = request.model
        for slot in slots_of(candidates):
            adapters = self.fleet.load[slot].lora
            if model in adapters.reported:
                affinity |= 1 << slot
            elif adapters.reported_slots and len(adapters.reported) < adapters.max_lora:
                # GIE knows a pod's slots only from its own samples (ours borrows a
                # sibling's while a pod has shown none: lora.Adapters.assume).
                available |= 1 << slot
        if affinity and available:
            return affinity if self._rng.random() < self.threshold else available
        return affinity or available

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        return self.scorers.pick(request, self.lora_filter(request, candidates) or candidates)
