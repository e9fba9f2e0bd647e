"""Where each stored Responses-API response lives: the pod whose engine holds it.

vLLM (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) keeps a stored response in its
serving process: a later turn naming it in ``previous_response_id`` is served by that
process alone, and any other answers 404 ("Response with id '…' not found"). That is
a hard affinity, not a preference: such a turn goes to the pod that produced the
response whatever the prefix policy says, and where that pod has left the fleet, been
replaced, or restarted since, the state is gone and the client is told so
(processor.py) rather than sent to a pod that cannot know it.

The observe side remembers each stored response's id as the answer passes
(observe.py); replicas share them (replicas.py); the request path only looks them up.
Entries are keyed by tenant and id, so a tenant's turn never pins to a response another
tenant stored (the ids are the engine's, and a client may even choose its own with
vLLM's ``request_id``). Memory is bounded: past ``capacity`` the least recently used is
forgotten, and with ``ttl_s`` an entry is forgotten that long after it was stored. A
forgotten or never-seen id is *unknown*: the turn is routed by its prefix, and the
engine answers 404 where it lands elsewhere.

An entry holds the pod's key and when it was stored; a pod's (re)joining the fleet and
its restarts (the monitor's) are kept per pod, so an entry older than the pod's
current process is known lost without walking the entries.

Envoy's observe filter reads an answer *beside* the client, not before it: a client
that sends its next turn the moment the last byte arrives can outrun the note of the
id. So each answer this replica sent to be stored is *awaited* (``expect``) until its
observation notes the id or ends (``settle``), and a turn naming an id unknown here
while its tenant has answers awaited waits for them, a bounded while (``noted``),
rather than be routed by prefix to a pod that can only answer 404.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import xxhash
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ace_extproc.routing.fleet import ADDED, RETIRED, FleetState

_xxh3 = xxhash.xxh3_64_intdigest

# What a lookup found (also the trace's ``previous_response`` and the metric's label).
PINNED = "pinned"  # the storing pod is there: the turn goes to it
UNKNOWN = "unknown"  # never seen here, or forgotten: routed by prefix
LOST = "lost"  # the storing pod left, was replaced or restarted: the state is gone
UNAVAILABLE = "unavailable"  # the storing pod is out of rotation (health): maybe later
RESULTS = (PINNED, UNKNOWN, LOST, UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class Home:
    """What a lookup found: ``result`` one of ``RESULTS``; the storing pod's slot
    (pinned or unavailable) and key (any but unknown); ``why`` for an error message."""

    result: str
    slot: int = -1
    pod: str = ""
    why: str = ""


_UNKNOWN = Home(UNKNOWN)
# An awaited answer whose observation never comes (a response Envoy did not send the
# observe filter, a lost stream) stops being awaited after this long, so a tenant's
# unknown ids do not wait for it forever. Longer than any stream should take.
AWAITED_FOR_S = 900.0


class ResponseHomes:
    """``(tenant, response id)`` -> the pod that stored it, bounded (see the module)."""

    def __init__(
        self,
        fleet: FleetState,
        capacity: int = 100_000,
        ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.capacity = max(0, capacity)
        self.ttl_s = ttl_s
        self._clock = clock
        # hash(tenant, id) -> (pod key, when stored). A 64-bit hash rather than the two
        # strings: a third of the memory, and a collision (one in ~10^13 at this size)
        # would at worst send a turn to a pod whose engine answers 404.
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()
        # Pod key -> when its current process started serving, as far as the router can
        # tell (joined the fleet, or seen restarting); absent: since before any entry.
        self._since: dict[str, float] = {}
        # Pods back in service whose process the router has not checked yet (their next
        # scrape says whether they restarted): a continuation there waits, as for a pod
        # out of service, rather than reach a new process that answers a bare 404.
        self._rechecking: set[str] = set()
        self.remembered = 0  # stored ids noted here (this replica's answers and learned)
        # Tenant -> when each of its answers still awaited (sent to be stored, not yet
        # noted nor ended) was sent, oldest first; and what wakes the turns waiting.
        self._awaited: dict[str, deque[float]] = {}
        self._wake: asyncio.Event | None = None
        self.found = dict.fromkeys(RESULTS, 0)  # lookups by result, for the metrics
        fleet.on_change.append(self._changed)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(tenant: str, response_id: str) -> int:
        return _xxh3(f"{tenant}\x00{response_id}".encode())

    def remember(self, tenant: str, response_id: str, pod: str) -> None:
        """``pod`` (its key) stored the response ``response_id`` of ``tenant``: one of
        its answers awaited here, if any, is settled (it may be another replica's: the
        count is what matters, and a turn wrongly not waiting is routed as before)."""
        if not self.capacity or not response_id:
            return
        entries = self._entries
        key = self._key(tenant, response_id)
        entries.pop(key, None)
        entries[key] = (sys.intern(pod), self._clock())
        self.remembered += 1
        if len(entries) > self.capacity:
            entries.popitem(last=False)  # the least recently used
        self.settle(tenant)

    def expect(self, tenant: str) -> None:
        """An answer of ``tenant``'s was sent to be stored: its id is awaited."""
        if self.capacity:
            self._awaited.setdefault(tenant, deque()).append(self._clock())

    def settle(self, tenant: str) -> None:
        """One of ``tenant``'s awaited answers was noted, or ended without an id."""
        awaited = self._awaited.get(tenant)
        if awaited:
            awaited.popleft()  # which one does not matter: only how many are left
            if not awaited:
                del self._awaited[tenant]
        self._woken()

    def awaits(self, tenant: str) -> bool:
        """Whether any of ``tenant``'s answers is still awaited."""
        awaited = self._awaited.get(tenant)
        if not awaited:
            return False
        stale = self._clock() - AWAITED_FOR_S
        while awaited and awaited[0] < stale:
            awaited.popleft()
        if not awaited:
            del self._awaited[tenant]
        return bool(awaited)

    async def noted(self, tenant: str, response_id: str, within_s: float) -> None:
        """Return once ``response_id`` is known here, or none of ``tenant``'s answers
        is awaited any more, or after ``within_s``. Never counts a lookup."""
        deadline = self._clock() + within_s
        while self._find(tenant, response_id).result == UNKNOWN and self.awaits(tenant):
            left = deadline - self._clock()
            if left <= 0:
                return
            if self._wake is None:
                self._wake = asyncio.Event()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _woken(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()

    def find(self, tenant: str, response_id: str) -> Home:
        """Where the turn continuing ``response_id`` must go, and whether it can
        (counted for the metrics)."""
        home = self._find(tenant, response_id)
        self.found[home.result] += 1
        return home

    def peek(self, tenant: str, response_id: str) -> Home:
        """``find``, uncounted."""
        return self._find(tenant, response_id)

    def _find(self, tenant: str, response_id: str) -> Home:
        key = self._key(tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return _UNKNOWN
        pod, stored = entry
        if self.ttl_s and self._clock() - stored > self.ttl_s:
            del self._entries[key]
            return _UNKNOWN
        self._entries.move_to_end(key)
        fleet = self.fleet
        slot = fleet.slot_of(pod)
        if slot is None or not fleet.is_member(slot):
            return Home(LOST, pod=pod, why=f"pod {pod}, which stored it, has left the fleet")
        if stored < self._since.get(pod, 0.0):
            return Home(LOST, pod=pod, why=f"pod {pod}, which stored it, has restarted since")
        if not fleet.is_healthy(slot):
            why = f"pod {pod}, which stored it, is out of service (failing health checks)"
            return Home(UNAVAILABLE, slot, pod, why)
        if pod in self._rechecking:
            why = f"pod {pod}, which stored it, is back; whether it restarted is not known yet"
            return Home(UNAVAILABLE, slot, pod, why)
        # Drained still serves it: a drain stops new conversations, not the ones the
        # pod alone can carry on.
        return Home(PINNED, slot, pod)

    def restarted(self, slot: int) -> None:
        """The pod in ``slot`` restarted (the monitor saw it): what it stored is gone."""
        key = self.fleet.pods[slot].key
        self._since[key] = self._clock()
        self._rechecking.discard(key)

    def back(self, slot: int) -> None:
        """The pod in ``slot`` passes its health checks again: until ``checked``, the
        router does not know whether it is the process that stored its responses."""
        self._rechecking.add(self.fleet.pods[slot].key)

    def checked(self, slot: int) -> None:
        """A scrape of the pod in ``slot`` said whether it restarted (``restarted``
        first, if it did)."""
        if self._rechecking:
            self._rechecking.discard(self.fleet.pods[slot].key)

    def _changed(self, slot: int, change: str) -> None:
        # A pod (re)joining is a new process as far as anyone knows (fleet.py); one that
        # left or was retired no longer resolves to a member, so lookups say so (and a
        # retired pod's mark goes with it: its key joining again is an ADDED anew).
        key = self.fleet.pods[slot].key
        if change == ADDED:
            self._since[key] = self._clock()
        elif change == RETIRED:
            self._since.pop(key, None)


class ResponseHomesMetrics(Collector):
    """``ace_previous_response_total{result}``: turns naming a stored response, by
    what the router found; ``ace_stored_responses``: the ids remembered now;
    ``ace_stored_responses_noted_total``: ids noted (this replica's and learned)."""

    def __init__(self, homes: ResponseHomes) -> None:
        self.homes = homes

    def collect(self) -> Iterator[Metric]:
        homes = self.homes
        turns = CounterMetricFamily(
            "ace_previous_response",
            "Responses-API turns naming a previous_response_id, by what the router found: "
            "pinned (to the pod that stored it), unknown (routed by prefix), lost (that "
            "pod left, was replaced or restarted: refused), unavailable (it is out of "
            "service: refused).",
            labels=["result"],
        )
        for result, count in list(homes.found.items()):
            turns.add_metric([result], count)
        held = GaugeMetricFamily("ace_stored_responses", "Stored response ids remembered now.")
        held.add_metric([], len(homes))
        noted = CounterMetricFamily(
            "ace_stored_responses_noted",
            "Stored response ids noted: from this replica's answers and learned from others.",
        )
        noted.add_metric([], homes.remembered)
        yield from (turns, held, noted)
