"""The fleet as the pickers see it: pods in numbered slots, so a set of pods is one
int bitmask, and each destination's pods are a mask picked from by model.

Membership changes (discovery) go through ``add_pod`` / ``remove_pod``. A removed
pod keeps its slot (its bits cleared, so it gets nothing new), and the same pod coming
back takes that slot again. The slots of the last ``FREE_SLOTS_KEPT`` pods to leave wait
for them; past that, a new pod takes the slot of the pod that left longest ago, whose
slot is first *retired*: listeners drop what they kept for the old pod (its index
entries, session homes, per-pod metrics). So the slots, and the per-slot lists and
bitmasks the request path walks, stay bounded by the most pods ever present at once
plus that reserve, however many pods come and go over months of autoscaling and
rolling restarts (each a new pod IP, so a new pod id).

Four things keep a pod from new requests, each its own bitmask: leaving the fleet
(``members``), failing health checks (``healthy``, set by the monitor through
``set_available``), failing the requests it serves (``ejected``, set by passive health,
``outlier.py``) and an operator's drain (``drained``, the admin API). Pickers read
only ``available``, recomputed from the four whenever one changes, so a health change
never undrains a pod and an undrain never brings back one that is down.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ace_extproc.config import Destination, Fleet, Pod
from ace_extproc.routing import rendezvous
from ace_extproc.routing.lora import Adapters

log = logging.getLogger("ace_extproc.fleet")

ADDED = "added"
REMOVED = "removed"
RETIRED = "retired"  # the slot's pod left for good; its slot goes to another pod

# Slots of departed pods kept for their return before a new pod may take one.
FREE_SLOTS_KEPT = 64


@dataclass(slots=True)
class PodLoad:
    """What the router knows of a pod's load. The engine's own figures come from its
    ``/metrics`` (vLLM or SGLang names), refreshed by a scrape; ``inflight`` counts
    requests this replica sent and has not seen finish, as far as it can tell."""

    running: int = 0  # requests the engine is running (vllm:num_requests_running)
    waiting: int = 0  # requests queued in the engine (vllm:num_requests_waiting)
    kv_usage: float = 0.0  # KV cache use, 0..1 (vllm:kv_cache_usage_perc)
    inflight: int = 0
    # Prefill sent and not yet done, in milliseconds of the pod's TTFT model (load.py)
    queued_prefill_ms: float = 0.0
    # Picks the engine may not count yet, oldest first: (when it must, their prefill ms).
    unseen: deque[tuple[float, float]] = field(default_factory=deque)
    # Its LoRA adapter slots (vllm:lora_requests_info, and the picks since: lora.py)
    lora: Adapters = field(default_factory=Adapters)
    # Scrapes that found requests waiting where the estimate had no prefill queued:
    # the pod slower than its TTFT model says (load.py).
    underpriced: int = 0
    # How many times its model's time the pod takes, learned from the TTFT the engine
    # reports (pace.py), and the pace routing uses: that, or 1 within the model's own
    # error. Its queue drains, and its prefill and queue prices grow, by ``pace``.
    pace_learned: float = 1.0
    pace: float = 1.0


class FleetState:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.pods: list[Pod] = list(fleet.pods)
        self.seeds: list[tuple[int, float]] = [
            (rendezvous.pod_seed(p.key), p.weight) for p in self.pods
        ]
        # Slots that may take new requests: members & healthy & ~drained (_refresh).
        self.available = (1 << len(self.pods)) - 1
        self.healthy = (1 << len(self.pods)) - 1  # the health checks' verdict
        self.drained = 0  # drained by an operator: no new requests until undrained
        self.ejected = 0  # taken out by passive health until its ejection time is up
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
        # Slots of pods that left, the longest gone first (a dict: a pod coming back
        # takes its own out of the middle).
        self._free: dict[int, None] = {}
        self.free_slots_kept = FREE_SLOTS_KEPT  # how many wait before one is reused
        # Bumped by every membership change: caches of "which pod is in which slot"
        # compare it (the member mask alone can come back to the same value).
        self.version = 0
        # Called with (slot, "added" | "removed" | "retired") after each membership
        # change; "retired" comes just before a new pod's "added" in the same slot.
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

    def mask_of(self, endpoints: frozenset[str]) -> int:
        """The bitmask of the member pods named by ``ip:port`` (``Pod.endpoint``) in
        ``endpoints``: the endpoint-picker protocol's subset."""
        mask = 0
        members = self.members
        for slot, pod in enumerate(self.pods):
            if members >> slot & 1 and pod.endpoint in endpoints:
                mask |= 1 << slot
        return mask

    def set_available(self, slot: int, available: bool) -> None:
        """Record the health checks' verdict on a pod. It takes new requests only
        while it is also in the fleet and not drained."""
        if available:
            self.healthy |= 1 << slot
        else:
            self.healthy &= ~(1 << slot)
        self._refresh()

    def set_ejected(self, slot: int, ejected: bool) -> None:
        """Record passive health's verdict (``outlier.py``): apart from the health
        checks', so that neither brings back a pod the other took out."""
        if ejected:
            self.ejected |= 1 << slot
        else:
            self.ejected &= ~(1 << slot)
        self._refresh()

    def drain(self, slot: int) -> bool:
        """Send a pod no new requests (requests in flight are not touched, nor its
        index, so an undrain finds its prefixes warm). Health checks go on. The drain
        holds until ``undrain``, through health changes and the pod leaving and
        rejoining. Returns whether anything changed."""
        bit = 1 << slot
        if self.drained & bit:
            return False
        self.drained |= bit
        self._refresh()
        return True

    def undrain(self, slot: int) -> bool:
        """Lift a drain: the pod takes new requests again once healthy and in the
        fleet. Returns whether anything changed."""
        bit = 1 << slot
        if not self.drained & bit:
            return False
        self.drained &= ~bit
        self._refresh()
        return True

    def is_drained(self, slot: int) -> bool:
        return bool((self.drained >> slot) & 1)

    def is_healthy(self, slot: int) -> bool:
        """Neither marked down by the health checks nor ejected by passive health."""
        return bool(((self.healthy & ~self.ejected) >> slot) & 1)

    def is_ejected(self, slot: int) -> bool:
        return bool((self.ejected >> slot) & 1)

    def is_available(self, slot: int) -> bool:
        return bool((self.available >> slot) & 1)

    def _refresh(self) -> None:
        # One assignment: a reader sees the old mask or the new, never a mix.
        self.available = self.members & self.healthy & ~self.ejected & ~self.drained

    # ------------------------------------------------------------ membership

    def slot_of(self, pod_key: str) -> int | None:
        """The slot a pod (by ``destination/id``) has or had, if any."""
        return self._slot_of.get(pod_key)

    def is_member(self, slot: int) -> bool:
        return bool((self.members >> slot) & 1)

    def add_pod(self, pod: Pod) -> int:
        """Put a pod in the fleet and return its slot: the slot it had if it left
        earlier (same ``destination/id``) and nobody took it since, else the slot of
        the pod gone longest if more than ``free_slots_kept`` wait, else a new one at
        the end. Adding a pod already in the fleet changes nothing and returns its slot."""
        if pod.destination not in self._destination_ids:
            raise ValueError(f"pod {pod.key}: no destination {pod.destination!r}")
        slot = self._slot_of.get(pod.key)
        if slot is not None and (self.members >> slot) & 1:
            return slot
        seed = (rendezvous.pod_seed(pod.key), pod.weight)
        if slot is not None:  # back again: a new process, as far as anyone knows
            del self._free[slot]
        elif len(self._free) > self.free_slots_kept:
            slot = next(iter(self._free))
            del self._free[slot]
            self._retire(slot)
        if slot is None:
            slot = len(self.pods)
            self.pods.append(pod)
            self.seeds.append(seed)
            self.load.append(PodLoad())
            self.capacity_tokens.append(None)
        else:
            self.pods[slot] = pod
            self.seeds[slot] = seed
            self.load[slot] = PodLoad()
            self.capacity_tokens[slot] = None
        self._slot_of[pod.key] = slot
        bit = 1 << slot
        self._dest_masks[pod.destination] = self._dest_masks.get(pod.destination, 0) | bit
        self.members |= bit
        self.healthy |= bit  # a new process, until the health checks say otherwise
        self._refresh()  # a drained pod that rejoins stays drained
        self.version += 1
        self._notify(slot, ADDED)
        return slot

    def _retire(self, slot: int) -> None:
        """The pod that left ``slot`` is forgotten, so that another can take it: the
        same pod coming back later is a new pod (a new slot, not drained)."""
        del self._slot_of[self.pods[slot].key]
        self.drained &= ~(1 << slot)
        self._notify(slot, RETIRED)

    def remove_pod(self, slot: int) -> None:
        """Take a pod out of the fleet (it left, or is terminating): it gets nothing new.
        Its slot waits for it (``add_pod``). Removing twice changes nothing."""
        bit = 1 << slot
        if not self.members & bit:
            return
        clear = ~bit
        self.members &= clear
        self._refresh()
        dest = self.pods[slot].destination
        self._dest_masks[dest] = self._dest_masks.get(dest, 0) & clear
        self._free[slot] = None
        self.version += 1
        self._notify(slot, REMOVED)

    def _notify(self, slot: int, change: str) -> None:
        for listener in list(self.on_change):
            try:
                listener(slot, change)
            except Exception:  # one listener's bug must not stop the others
                log.exception("fleet: a listener failed on slot %d %s", slot, change)
