"""A picking pipeline in the spirit of the Gateway API Inference Extension: filters
narrow the candidates, scorers price each one, a picker chooses. Each is a small
plug-in, composed by configuration (``plugins.py``), and what is configured is what
runs: there is one path.

Unlike GIE's weighted sum of unrelated scores, every scorer here speaks one unit, the
milliseconds it adds to this request's time to first token on a pod, so their sum is
a price (weights stay, to tune one against the others). The default scorers, from the
calibrated TTFT model: this request's own prefill of the tokens the pod does not hold
warm (``PrefillCost``) and the prefill already queued there (``QueueCost``), both at
the pod's learned pace (``pace.py``), what its new blocks would evict from a full pod
(``EvictionCost``), and loading the LoRA adapter the request names where the pod has
not loaded it (``LoraCost``, ``lora.py``: 0 for the base model). A warm pod
wins while its queue costs less than the prefill it saves; when it saturates, the
request spills to the cheapest other pod, which warms up too (the hot prefix is
replicated). Warming that pod is priced as shared by the requests expected on the
prefix meanwhile (``prefix_rates.py``), so a hot prefix is replicated before its pods
queue a whole cold prefill.

Among pods priced within a small slack of the cheapest, the default picker
(``NearBest``) takes the deepest match, then the pod a session last went to, then,
among pods that hold the match alike, the cheapest, then the prefix's rendezvous order,
so replicas still agree on where new prefixes go and a conversation does not flap
between two nearly equal pods. A session's first request
is placed by its session: a warm match is then some other session's prefix, and
following it would pile sessions onto one pod (but a LoRA adapter's sessions follow it:
they share the adapter's slot too). A session another replica began, whose history the
request carries, goes where the pods' KV events say that history is.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ace_extproc.latency import TTFTModel
from ace_extproc.request import continues
from ace_extproc.routing import rendezvous
from ace_extproc.routing.fleet import RETIRED, FleetState, PodLoad
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.lora import LoraCost
from ace_extproc.routing.picker import Pick, RoutingRequest
from ace_extproc.routing.prefix_rates import PrefixRates


@dataclass(slots=True)
class Candidates:
    """One request's candidates, as the scorers and the picker see them."""

    request: RoutingRequest
    slots: tuple[int, ...]  # the filtered candidates, ascending
    # Leading blocks each holds warm that may steer (slot -> depth; fractional where a
    # pod's events say it holds part of a block's tokens, or some offloaded).
    depths: dict[int, float]
    fleet: FleetState
    index: BlockIndex
    model: TTFTModel  # the candidates' destination's
    tokens_per_block: float
    route_key: int  # places a new prefix (rendezvous)
    home: int  # the pod the request's session last went to; -1: none
    # Blocks of the session's request last sent home (the depth home got from it).
    home_blocks: float = float("inf")
    # Requests a second on the deepest warm prefix lately (``prefix_rates.py``), a second
    # of the pods' TTFT model as the queues are: those that would follow this one to a
    # pod it warms.
    prefix_per_s: float = 0.0


class Filter(Protocol):
    def __call__(self, request: RoutingRequest, candidates: int, fleet: FleetState) -> int:
        """The candidates (a bitmask) this filter keeps; an empty result is ignored."""
        ...


class Scorer(Protocol):
    def __call__(self, c: Candidates) -> Sequence[float]:
        """Milliseconds this adds to the request's TTFT on each of ``c.slots``, in order."""
        ...


class Picker(Protocol):
    def __call__(self, c: Candidates, prices: list[float]) -> tuple[int, tuple[int, ...]]:
        """The chosen slot among ``c.slots``, priced ``prices``, and the fallbacks for
        Envoy's retries, best first."""
        ...


# ------------------------------------------------------------------ filters


@dataclass(frozen=True, slots=True)
class NotSaturated:
    """Drop pods whose KV cache is nearly full: they would queue or preempt."""

    max_kv_usage: float = 0.97

    def __call__(self, request: RoutingRequest, candidates: int, fleet: FleetState) -> int:
        limit = self.max_kv_usage
        full = [slot for slot, load in enumerate(fleet.load) if load.kv_usage >= limit]
        for slot in full:  # rarely any: a comprehension finds them in a third the time
            candidates &= ~(1 << slot)
        return candidates


# ------------------------------------------------------------------ scorers


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """This request's prefill past the blocks the pod holds warm, at the pod's pace
    (``pace.py``: a pod twice as slow as its model prefills twice as long). What a pod
    holding less than the deepest match would prefill beyond it warms that pod, and the
    requests that follow it there share that (``Candidates.prefix_per_s``): a hot
    prefix is replicated once its pods queue more than its share, not only once they
    queue more than a whole cold prefill (issue 27: 90% of requests on one system
    prompt waited on 3 of 8 pods, TTFT p50 1.36x round robin's)."""

    def __call__(self, c: Candidates) -> list[float]:
        tokens, depths = c.request.prompt_tokens, c.depths
        model = c.model
        cold = model.prefill_ms(tokens)  # most pods hold none of the prompt
        if not depths:
            load = c.fleet.load
            return [cold * load[slot].pace for slot in c.slots]
        tpb = c.tokens_per_block
        warm = {
            slot: model.prefill_ms(tokens - (cached := min(int(depth * tpb), tokens - 1)), cached)
            for slot, depth in depths.items()
            if depth
        }
        get, load = warm.get, c.fleet.load
        prices = [get(slot, cold) * load[slot].pace for slot in c.slots]
        if c.prefix_per_s:
            prices = self._shared(c, prices)
        return prices

    @staticmethod
    def _shared(c: Candidates, prices: list[float]) -> list[float]:
        """What each pod would prefill beyond the deepest match, divided among this
        request and those expected on the prefix while that pod is the sooner start:
        for as long as the deepest pods' queue outlasts its own."""
        get, load = c.depths.get, c.fleet.load
        deepest = max([get(slot, 0) for slot in c.slots])
        if not deepest:
            return prices
        queued = min(_waited(load[slot]) for slot in c.slots if get(slot, 0) == deepest)
        best, per_ms = min(prices), c.prefix_per_s / 1000
        return [
            best + (p - best) / (1.0 + per_ms * max(0.0, queued - _waited(load[slot])))
            for p, slot in zip(prices, c.slots, strict=True)
        ]


def _waited(load: PodLoad) -> float:
    """The pod's queued prefill at its pace (``pace.py``): how long the queue lasts."""
    return load.queued_prefill_ms * load.pace


@dataclass(frozen=True, slots=True)
class EvictionCost:
    """Placing new blocks on a full pod costs later: the prefixes they evict must be
    prefilled again by whoever comes back for them, counted at ``weight`` of their
    prefill (not all of them come back)."""

    weight: float = 0.5

    def __call__(self, c: Candidates) -> list[float]:
        per_block = self.weight * c.model.a_ms * c.tokens_per_block
        if not per_block:
            return [0.0] * len(c.slots)
        n, depths, slots = len(c.request.hashes.blocks), c.depths, c.slots
        lrus, capacities, default = c.index.room_view()
        lru, capacity = lrus.get, capacities.get
        # Only a pod without room for the whole prompt can have to evict: most have it.
        short = [slot for slot in slots if capacity(slot, default) - len(lru(slot, ())) < n]
        if not short:
            return [0.0] * len(slots)
        charges = {}
        for slot in short:
            depth = depths.get(slot, 0)
            overflow = n - depth - (capacity(slot, default) - len(lru(slot, ())))
            if overflow > 0:
                charges[slot] = per_block * min(overflow, n - depth)
        charge = charges.get
        return [charge(slot, 0.0) for slot in slots]


@dataclass(frozen=True, slots=True)
class QueueCost:
    """The prefill already queued on the pod, ahead of this request: milliseconds of
    the pod's TTFT model, each request sent priced as this one is, long prompts' extra
    attention cost included (``load.py``: picks since the last scrape, corrected by
    each scrape), at the pod's pace: how long it lasts there."""

    def __call__(self, c: Candidates) -> list[float]:
        load = c.fleet.load
        return [_waited(load[slot]) for slot in c.slots]


# ------------------------------------------------------------------ picker


@dataclass(frozen=True, slots=True)
class NearBest:
    """Among the pods priced within the slack of the cheapest, the deepest match; then
    the session's pod (before depth where its depth is its events' word: evictions);
    then, among pods holding that match alike, the cheapest (the
    least busy of equals); for a new prefix, with ``balance_new``, the least busy
    (better balanced with one replica, but replicas then disagree, so off by default);
    then rendezvous order."""

    slack_ratio: float = 0.10
    slack_ms: float = 5.0
    fallbacks: int = 2
    balance_new: bool = False

    def __call__(self, c: Candidates, prices: list[float]) -> tuple[int, tuple[int, ...]]:
        get = c.depths.get
        limit = min(prices) * (1 + self.slack_ratio) + self.slack_ms
        near_slots = [slot for price, slot in zip(prices, c.slots, strict=True) if price <= limit]
        deepest = max([get(slot, 0) for slot in near_slots])
        near = 0
        for slot in near_slots:
            if get(slot, 0) == deepest:
                near |= 1 << slot
        home = c.home
        if home >= 0 and ((near >> home) & 1 or self._evicted_home(c, home, near_slots)):
            near = 1 << home  # a session stays on its pod among equals
        elif deepest and near & (near - 1):
            # Pods that hold as much of it (a prefix every pod holds, a replicated hot
            # one): no affinity is at stake between them, so the cheapest, where it
            # starts soonest (a short request warm only on a shared first block waited
            # behind long prefills: issue 27); among equals, the least busy.
            lowest = min(p for p, slot in zip(prices, c.slots, strict=True) if (near >> slot) & 1)
            near = self._least_busy(
                c,
                [
                    slot
                    for p, slot in zip(prices, c.slots, strict=True)
                    if p == lowest and (near >> slot) & 1
                ],
            )
        elif not deepest and self.balance_new and near & (near - 1):
            # A new prefix: the least busy first (replicas then disagree on where it goes).
            near = self._least_busy(c, [slot for slot in c.slots if (near >> slot) & 1])
        chosen = (
            near.bit_length() - 1
            if not near & (near - 1)
            else rendezvous.best(c.route_key, c.fleet.seeds, near)
        )
        keep = self.fallbacks
        cheapest = heapq.nsmallest(keep + 1, zip(prices, c.slots, strict=True))
        backups = tuple([slot for _, slot in cheapest if slot != chosen][:keep])
        return chosen, backups

    @staticmethod
    def _evicted_home(c: Candidates, home: int, near_slots: list[int]) -> bool:
        """Whether the session's pod, priced near the cheapest, holds less of the prompt
        than another only by its own events' word: what the engine evicted there (its
        history's tail first) the turn prefills again on any pod, and the pod that looks
        deeper often holds only a prefix other sessions share (the approximate index,
        blind to evictions, keeps such a session home as well). Not where a near pod
        holds more than the session's last request sent home: only the session's own
        later turns, sent there by another replica, can be that deep."""
        if not ((c.request.known >> home) & 1 and home in near_slots):
            return False
        get, sent = c.depths.get, c.home_blocks
        return all(get(slot, 0) <= sent for slot in near_slots)

    @staticmethod
    def _least_busy(c: Candidates, slots: list[int]) -> int:
        """The bitmask of those of ``slots`` with the fewest requests in flight."""
        load = c.fleet.load
        least = min(load[slot].inflight for slot in slots)
        return sum(1 << slot for slot in slots if load[slot].inflight == least)


# ------------------------------------------------------------------ the pipeline


@dataclass(frozen=True, slots=True)
class Weighted:
    """A scorer and how much its milliseconds count."""

    scorer: Scorer
    weight: float = 1.0


DEFAULT_SCORERS = (
    Weighted(PrefillCost()),
    Weighted(EvictionCost()),
    Weighted(QueueCost()),
    Weighted(LoraCost()),
)


class Pipeline:
    """A ``routing.Policy``: filters, then scorers, then the picker; sessions and
    shallow matches decide what may steer before any of them runs."""

    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        model: TTFTModel,
        tokens_per_block: float,
        *,
        filters: Sequence[Filter] = (NotSaturated(),),
        scorers: Sequence[Weighted] = DEFAULT_SCORERS,
        picker: Picker | None = None,
        min_match: float = 0.0,
        place_sessions: bool = False,
        sessions_remembered: int = 65_536,
        destination_models: Mapping[str, TTFTModel] | None = None,
        prefill_tokens_per_s: float = 0.0,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.model = model
        self.tokens_per_block = tokens_per_block
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker: Picker = picker if picker is not None else NearBest()
        # A match covering less than this share of the prompt (a system prompt that many
        # conversations share) neither lowers a pod's price nor steers the pick: the
        # request is placed as new, by its own key, so conversations that share only a
        # short prefix spread over the pods instead of piling onto the one holding it.
        self.min_match = min_match
        # A session's first request seen by this replica is placed by the session, not
        # drawn to the pod holding a prefix it shares with other sessions (a system
        # prompt, tool schemas): this replica never routed the session, so any warm match
        # is somebody else's. Sessions sharing a large prefix then spread over the pods
        # instead of piling onto one whose cache cannot hold all their histories, and a
        # replica that joins a session late sends it where the session's key put it.
        # Later, the session's own history on the pod it went to steers however short
        # (min_match is for prefixes other sessions share). Not for a session of a LoRA
        # adapter: spreading an adapter's sessions takes a slot for it on every pod they
        # reach (a load there, another adapter evicted), a cost this rule does not weigh;
        # they share the adapter as they share its system prompt, so they go where that
        # is warm (as GIE's LoRA affinity sends them) and spill by price.
        self.place_sessions = place_sessions
        # (tenant, session) this replica routed -> the pod it last sent it to and that
        # request's blocks; bounded, the first seen forgotten first. Scoped by tenant:
        # session ids are the clients'.
        self._sessions: dict[tuple[str, str], tuple[int, int]] = {}
        self._sessions_remembered = sessions_remembered
        self._slot_lists: dict[int, tuple[int, ...]] = {}
        self.rates = PrefixRates()
        # The pods' prefill rate where it is not their model's (settings'): the queues
        # are in the model's milliseconds, the prefix rates in requests a real second.
        self._prefill_tokens_per_s = prefill_tokens_per_s
        # Destinations whose pods run another TTFT model (a request's candidates are
        # all of one destination): priced with their own.
        self._models = {d: m for d, m in (destination_models or {}).items() if m != model}
        for slot in range(len(fleet.pods)):
            index.add_pod(slot)
        fleet.on_change.append(self._fleet_changed)

    def _fleet_changed(self, slot: int, change: str) -> None:
        if change == RETIRED:  # its sessions' home is gone; the slot's next pod is not it
            self._sessions = {s: at for s, at in self._sessions.items() if at[0] != slot}

    def _slots(self, mask: int) -> tuple[int, ...]:
        """The slots of a bitmask, cached: candidate sets repeat request after request."""
        slots = self._slot_lists.get(mask)
        if slots is None:
            if len(self._slot_lists) > 1024:
                self._slot_lists.clear()
            slots = self._slot_lists[mask] = tuple(
                slot for slot in range(mask.bit_length()) if (mask >> slot) & 1
            )
        return slots

    def remember(self, session: tuple[str, str], slot: int, blocks: int) -> None:
        """``(tenant, session id)`` went to ``slot`` with a request of ``blocks`` blocks
        (here, or by another replica)."""
        sessions = self._sessions
        sessions[session] = (slot, blocks)
        if len(sessions) > self._sessions_remembered:
            del sessions[next(iter(sessions))]

    def _names_adapter(self, request: RoutingRequest, candidates: int) -> bool:
        """Whether the request's model is a LoRA adapter on the candidates' pods (all of
        one destination: any one of them says)."""
        return self.fleet.load[candidates.bit_length() - 1].lora.is_adapter(request.model)

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        """The pod for the request among ``candidates``, recorded as holding its blocks;
        the pick says what steered and the next cheapest pods, for Envoy's retries."""
        if not candidates:
            return None
        fleet, index = self.fleet, self.index
        sid = request.session if self.place_sessions else None
        session = None if sid is None else (request.tenant, sid)
        home, home_blocks = (-1, 0) if session is None else self._sessions.get(session, (-1, 0))
        steer, route_key = True, request.hashes.route_key
        elsewhere = False  # a session another replica began: its history is on some pod
        if sid is not None and home < 0 and not self._names_adapter(request, candidates):
            # A session this replica never routed: placed by its own key, no match steers
            # (this replica's record holds other sessions' prefixes, not its history)...
            steer, route_key = False, rendezvous.key_of(sid)
            # ... unless it carries earlier turns and pods' events say what they hold:
            # their word on its history is the other replica's placement, with no Redis.
            elsewhere = bool(request.known) and continues(request.prompt)
        model = self.model
        if self._models:  # the candidates' destination, by any one of them
            pod = fleet.pods[candidates.bit_length() - 1]
            model = self._models.get(pod.destination, model)
        for keep in self.filters:
            candidates = keep(request, candidates, fleet) or candidates
        blocks = request.hashes.blocks
        n = len(blocks)
        # What the pods hold, in blocks: the index's guess, or their events' word.
        held: dict[int, float] = index.match_depths(blocks, candidates)  # type: ignore[assignment]
        if known := request.known:  # pods whose own events say what they hold
            held = {slot: d for slot, d in held.items() if not (known >> slot) & 1}
            held.update(request.known_depths or {})
        depths = held  # what may steer
        if elsewhere:  # the events' deep matches only (a shared prefix is shallow)
            known, shallow = request.known, self.min_match * n
            depths = {s: d for s, d in held.items() if (known >> s) & 1 and d >= shallow}
        elif not steer:
            depths = {}
        elif self.min_match and depths:
            # A session's own history, on the pod it went to, counts however short.
            shallow = self.min_match * n
            depths = {slot: d for slot, d in depths.items() if d >= shallow or slot == home}
            if not depths:
                # Its own key, not the shared prefix's: its first block past the shared
                # prefix, the same for every turn of a conversation, so a replica that has
                # not seen the earlier turns still places it where they went. Rounded: an
                # events' depth is a share of the engine's tokens put in the router's
                # blocks, so a shared prefix of 4 blocks can read 3.99; truncated, the key
                # was that prefix's last block, one for every request.
                route_key = blocks[min(round(max(held.values())), n - 1)]
        c = Candidates(
            request,
            self._slots(candidates),
            depths,
            fleet,
            index,
            model,
            self.tokens_per_block,
            route_key,
            home,
            home_blocks,
        )
        if depths and (deepest := max(depths.values())) >= 1:
            per_s = self.rates.seen(blocks[min(int(deepest), n) - 1])
            c.prefix_per_s = per_s / model.speed(self._prefill_tokens_per_s)  # model time
        prices = self._price(c)
        chosen, backups = self.picker(c, prices)
        index.record(chosen, blocks)
        if session is not None:
            self.remember(session, chosen, n)
        # The action names what steered: a shallow match placed as new is a miss. The
        # depth reported is what the chosen pod really holds (the saved-prefill estimate).
        best = max(depths.values(), default=0)
        action = "miss" if not best else ("hit" if depths.get(chosen, 0) == best else "spill")
        return Pick(fleet.pods[chosen], chosen, held.get(chosen, 0), action, backups)

    def _price(self, c: Candidates) -> list[float]:
        """Every scorer's milliseconds for each candidate, summed in scorer order."""
        first, *rest = self.scorers
        prices = list(first.scorer(c))
        if first.weight != 1.0:
            prices = [first.weight * p for p in prices]
        for weighted in rest:
            w = weighted.weight
            prices = [p + w * ms for p, ms in zip(prices, weighted.scorer(c), strict=True)]
        return prices
