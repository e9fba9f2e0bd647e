"""The fleet as the pickers see it: pods in numbered slots, so a set of pods is one
int bitmask, and each destination's pods are a mask picked from by model."""

from __future__ import annotations

from dataclasses import dataclass

from ace_extproc.config import Destination, Fleet, Pod
from ace_extproc.routing import rendezvous


@dataclass(slots=True)
class PodLoad:
    """What the router knows of a pod's load. The engine's own figures come from its
    ``/metrics`` (vLLM or SGLang names), refreshed by a scrape; ``inflight`` counts
    requests this replica sent and has not seen finish, as far as it can tell."""

    running: int = 0  # requests the engine is running (vllm:num_requests_running)
    waiting: int = 0  # requests queued in the engine (vllm:num_requests_waiting)
    kv_usage: float = 0.0  # KV cache use, 0..1 (vllm:kv_cache_usage_perc)
    inflight: int = 0
    queued_prefill_tokens: int = 0  # uncached prompt tokens sent and not yet prefilled


class FleetState:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.pods: list[Pod] = list(fleet.pods)
        self.seeds: list[tuple[int, float]] = [
            (rendezvous.pod_seed(p.key), p.weight) for p in self.pods
        ]
        self.available = (1 << len(self.pods)) - 1  # not draining, not down
        self.load: list[PodLoad] = [PodLoad() for _ in self.pods]
        # Each pod's KV cache in tokens, once its /metrics has told (None: not yet).
        self.capacity_tokens: list[int | None] = [None] * len(self.pods)
        self._dest_masks: dict[str, int] = {}
        for slot, pod in enumerate(self.pods):
            self._dest_masks[pod.destination] = self._dest_masks.get(pod.destination, 0) | (
                1 << slot
            )
        self._by_model: dict[str, Destination | None] = {}

    def destination_for(self, model: str) -> Destination | None:
        try:
            return self._by_model[model]
        except KeyError:
            if len(self._by_model) > 4096:
                self._by_model.clear()
            dest = self._by_model[model] = self.fleet.destination_for(model)
            return dest

    def candidates(self, destination: Destination) -> int:
        """The bitmask of this destination's pods that may take new requests."""
        return self._dest_masks.get(destination.id, 0) & self.available

    def set_available(self, slot: int, available: bool) -> None:
        if available:
            self.available |= 1 << slot
        else:
            self.available &= ~(1 << slot)
