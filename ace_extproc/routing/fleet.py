"""The fleet as the pickers see it: pods in numbered slots, so a set of pods is one
int bitmask, and each destination's pods are a mask picked from by model.

Membership changes (discovery) go through ``add_pod`` / ``remove_pod``. A slot is
never freed: a removed pod keeps its slot (its bits cleared, so it gets nothing new),
and the same pod coming back takes that slot again, so every bitmask stays valid.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ace_extproc.config import Destination, Fleet, Pod
from ace_extproc.routing import rendezvous

log = logging.getLogger("ace_extproc.fleet")

ADDED = "added"
REMOVED = "removed"


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
        self.members = (1 << len(self.pods)) - 1  # slots whose pod is in the fleet now
        self._slot_of: dict[str, int] = {p.key: slot for slot, p in enumerate(self.pods)}
        self._destination_ids = frozenset(d.id for d in fleet.destinations)
        # Called with (slot, "added" | "removed") after each membership change.
        self.on_change: list[Callable[[int, str], None]] = []

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
            if (self.members >> slot) & 1:  # a pod that left stays out
                self.available |= 1 << slot
        else:
            self.available &= ~(1 << slot)

    # ------------------------------------------------------------ membership

    def slot_of(self, pod_key: str) -> int | None:
        """The slot a pod (by ``destination/id``) has or had, if any."""
        return self._slot_of.get(pod_key)

    def is_member(self, slot: int) -> bool:
        return bool((self.members >> slot) & 1)

    def add_pod(self, pod: Pod) -> int:
        """Put a pod in the fleet and return its slot: the slot it had if it left
        earlier (same ``destination/id``), else a new one at the end. Adding a pod
        already in the fleet changes nothing and returns its slot."""
        if pod.destination not in self._destination_ids:
            raise ValueError(f"pod {pod.key}: no destination {pod.destination!r}")
        slot = self._slot_of.get(pod.key)
        if slot is not None and (self.members >> slot) & 1:
            return slot
        seed = (rendezvous.pod_seed(pod.key), pod.weight)
        if slot is None:
            slot = len(self.pods)
            self.pods.append(pod)
            self.seeds.append(seed)
            self.load.append(PodLoad())
            self.capacity_tokens.append(None)
            self._slot_of[pod.key] = slot
        else:  # back again: a new process, as far as anyone knows
            self.pods[slot] = pod
            self.seeds[slot] = seed
            self.load[slot] = PodLoad()
            self.capacity_tokens[slot] = None
        bit = 1 << slot
        self._dest_masks[pod.destination] = self._dest_masks.get(pod.destination, 0) | bit
        self.members |= bit
        self.available |= bit
        self._notify(slot, ADDED)
        return slot

    def remove_pod(self, slot: int) -> None:
        """Take a pod out of the fleet (it left, or is draining): it gets nothing new.
        Its slot is kept, so bitmasks stay valid. Removing twice changes nothing."""
        bit = 1 << slot
        if not self.members & bit:
            return
        clear = ~bit
        self.members &= clear
        self.available &= clear
        dest = self.pods[slot].destination
        self._dest_masks[dest] = self._dest_masks.get(dest, 0) & clear
        self._notify(slot, REMOVED)

    def _notify(self, slot: int, change: str) -> None:
        for listener in list(self.on_change):
            try:
                listener(slot, change)
            except Exception:  # one listener's bug must not stop the others
                log.exception("fleet: a listener failed on slot %d %s", slot, change)
