"""A picking pipeline in the spirit of the Gateway API Inference Extension: filters
narrow the candidates, a scorer prices each one, a chooser picks.

Unlike GIE's weighted sum of unrelated scores, the default scorer prices every pod
in one unit, the milliseconds until this request's first token there: the prefill
already queued on the pod, plus this request's own prefill of the tokens the pod
does not hold warm, both from the calibrated TTFT model. A warm pod wins while its
queue costs less than the prefill it saves; when it saturates, the request spills
to the cheapest other pod, which warms up too (the hot prefix is replicated). A full
pod is also charged for the prefixes its new blocks would evict.

Among pods priced within a small slack of the cheapest, the deepest match wins, then
the pod a session last went to, then the prefix's rendezvous order, so replicas still
agree on where new prefixes go and a conversation does not flap between two nearly equal
pods. A session's first request is placed by its session: a warm match is then some
other session's prefix, and following it would pile sessions onto one pod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ace_extproc.latency import TTFTModel
from ace_extproc.routing import rendezvous
from ace_extproc.routing.fleet import RETIRED, FleetState, PodLoad
from ace_extproc.routing.index import BlockIndex, RoomView
from ace_extproc.routing.picker import Pick, RoutingRequest
from ace_extproc.speedups import native


class Filter(Protocol):
    def __call__(self, request: RoutingRequest, candidates: int, fleet: FleetState) -> int:
        """The candidates (a bitmask) this filter keeps; an empty result is ignored."""
        ...


class Scorer(Protocol):
    def __call__(self, request: RoutingRequest, slot: int, depth: int, fleet: FleetState) -> float:
        """The price of sending the request to ``slot``, which holds ``depth`` leading
        blocks of it warm; lower is better."""
        ...


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


@dataclass(frozen=True, slots=True)
class EstimatedTTFT:
    """Milliseconds until the first token: queued prefill ahead, then this prefill.

    The queue is ``PodLoad.queued_prefill_tokens``: exact in the fleet simulation;
    in production it must be kept by the load accounting (requests sent since the
    last scrape, corrected by each scrape), which the pipeline only reads."""

    model: TTFTModel
    tokens_per_block: float  # router block bytes / bytes per token

    def prefill_ms(self, request: RoutingRequest, depth: int) -> float:
        tokens = request.prompt_tokens
        cached = min(int(depth * self.tokens_per_block), tokens - 1) if depth else 0
        return self.model.prefill_ms(tokens - cached, cached)

    def queue_ms(self, load: PodLoad) -> float:
        queued = load.queued_prefill_tokens
        return self.model.a_ms * queued if queued > 0 else 0.0

    def __call__(self, request: RoutingRequest, slot: int, depth: int, fleet: FleetState) -> float:
        return self.queue_ms(fleet.load[slot]) + self.prefill_ms(request, depth)


class PriceParams(NamedTuple):
    """The constants of ``price``: the TTFT model's, and how the pipeline reads prices."""

    tokens_per_block: float
    a_ms: float
    b_ms: float
    t_step_ms: float
    evict_ms: float  # charged per block a full pod would evict (0: not charged)
    slack_ratio: float
    slack_ms: float


def price_pure(
    slots: Sequence[int],
    depths: Mapping[int, int],
    rooms: RoomView,
    load: Sequence[PodLoad],
    n: int,
    tokens: int,
    params: PriceParams,
    keep: int,
) -> tuple[int, int, tuple[int, ...]]:
    """Price each candidate slot as ``EstimatedTTFT`` does (its queued prefill, then
    this request's prefill past the ``depths`` blocks it holds), plus the eviction
    charge, all candidates in one call.

    Returns ``(near, deepest, order)``: the bitmask of the near-best (priced within
    the slack of the cheapest) holding the deepest match among them, that depth, and
    the ``keep`` cheapest slots, cheapest first (ties by slot), for fallbacks. ``n`` is
    the prompt's blocks, ``tokens`` its tokens. The C version (``native.price``) gives
    the same without sorting every candidate.
    """
    if keep < 1:
        raise ValueError("price: keep must be at least 1")
    tpb, a_ms, b_ms, t_step_ms, evict_ms, slack_ratio, slack_ms = params
    lrus, capacities, default_capacity = rooms
    priced = []
    for slot in slots:
        depth = depths.get(slot, 0)
        cached = min(int(depth * tpb), tokens - 1) if depth else 0
        new = max(tokens - cached, 0)
        cost = max(t_step_ms, a_ms * new + b_ms * new * (cached + new / 2))
        if evict_ms:
            lru = lrus.get(slot)
            room = capacities.get(slot, default_capacity) - (len(lru) if lru is not None else 0)
            if (overflow := n - depth - room) > 0:
                cost += evict_ms * min(overflow, n - depth)
        queued = load[slot].queued_prefill_tokens
        if queued > 0:
            cost += a_ms * queued
        priced.append((cost, slot))
    priced.sort()
    limit = priced[0][0] * (1 + slack_ratio) + slack_ms
    deepest, near = -1, 0
    for cost, slot in priced:
        if cost > limit:
            break
        depth = depths.get(slot, 0)
        if depth > deepest:
            deepest, near = depth, 1 << slot
        elif depth == deepest:
            near |= 1 << slot
    return near, deepest, tuple([slot for _, slot in priced[:keep]])


# One C call for all candidates where the extension was built (speedups.py).
price = native.price if native is not None else price_pure


class Pipeline:
    """A ``Picker``: filters, then the cheapest pod by ``scorer``, affinity on near-ties."""

    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        filters: Sequence[Filter],
        scorer: EstimatedTTFT,
        *,
        slack_ratio: float = 0.10,
        slack_ms: float = 5.0,
        fallbacks: int = 2,
        balance_new: bool = False,
        eviction_weight: float = 0.5,
        min_match: float = 0.0,
        place_sessions: bool = False,
        sessions_remembered: int = 65_536,
        destination_models: Mapping[str, TTFTModel] | None = None,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.filters = tuple(filters)
        self.scorer = scorer
        self.fallbacks = fallbacks
        # Place a new prefix on the least busy near-best pod instead of its rendezvous
        # pod: better balanced with one replica, but replicas then disagree (measured in
        # bench/RESULTS.md), so it is off by default.
        self.balance_new = balance_new
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
        # (min_match is for prefixes other sessions share).
        self.place_sessions = place_sessions
        # (tenant, session) this replica routed -> the pod it last sent it to; bounded,
        # the first seen forgotten first. Scoped by tenant: session ids are the clients'.
        self._sessions: dict[tuple[str, str], int] = {}
        self._sessions_remembered = sessions_remembered
        self._slot_lists: dict[int, tuple[int, ...]] = {}
        self._eviction_weight = eviction_weight
        self._slack = slack_ratio, slack_ms
        self.params = self._price_params(scorer.model)
        # Destinations whose pods run another TTFT model than the scorer's (a request's
        # candidates are all of one destination): priced with their own constants.
        self._params_by_destination = {
            dest: self._price_params(model)
            for dest, model in (destination_models or {}).items()
            if model != scorer.model
        }
        for slot in range(len(fleet.pods)):
            index.add_pod(slot)
        fleet.on_change.append(self._fleet_changed)
        # The whole choice in one C call (``native.pick``) where the extension was built,
        # for the default filters on the C index; ``_choose`` otherwise (the reference).
        saturated = [f for f in self.filters if isinstance(f, NotSaturated)]
        self._fused = (
            native is not None
            and index.native
            and not balance_new
            and len(saturated) == len(self.filters) == 1
        )
        self._max_kv_usage = saturated[0].max_kv_usage if saturated else 1.0

    def _price_params(self, model: TTFTModel) -> PriceParams:
        """What ``price`` reads: the TTFT model's constants, this charge, the slack.
        Placing new blocks on a full pod costs later: the prefixes they evict must be
        prefilled again by whoever comes back for them, counted at eviction_weight of
        their prefill (not all of them come back)."""
        tpb = self.scorer.tokens_per_block
        evict_ms = self._eviction_weight * model.a_ms * tpb
        return PriceParams(tpb, model.a_ms, model.b_ms, model.t_step_ms, evict_ms, *self._slack)

    def _fleet_changed(self, slot: int, change: str) -> None:
        if change == RETIRED:  # its sessions' home is gone; the slot's next pod is not it
            self._sessions = {s: home for s, home in self._sessions.items() if home != slot}

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

    def remember(self, session: tuple[str, str], slot: int) -> None:
        """``(tenant, session id)`` went to ``slot`` (here, or by another replica)."""
        sessions = self._sessions
        sessions[session] = slot
        if len(sessions) > self._sessions_remembered:
            del sessions[next(iter(sessions))]

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        sid = request.session if self.place_sessions else None
        session = None if sid is None else (request.tenant, sid)
        home = -1 if session is None else self._sessions.get(session, -1)
        if sid is not None and home < 0:
            # A session this replica never routed: placed by its own key, no match steers.
            steer, route_key = False, rendezvous.key_of(sid)
        else:
            steer, route_key = True, request.hashes.route_key
        params = self.params
        if self._params_by_destination:  # the candidates' destination, by any one of them
            pod = self.fleet.pods[candidates.bit_length() - 1]
            params = self._params_by_destination.get(pod.destination, params)
        if self._fused:
            index, fleet = self.index, self.fleet
            chosen, depth, action, backups = native.pick(  # type: ignore[union-attr]
                request.hashes.blocks,
                self._slots(candidates),
                index.room_view(),
                index.roots,
                fleet.load,
                fleet.seeds,
                params,
                self.fallbacks,
                self._max_kv_usage,
                request.prompt_tokens,
                route_key,
                home,
                self.min_match,
                steer,
            )
        else:
            chosen, depth, action, backups = self._choose(
                request, candidates, route_key, home, steer, params
            )
        if session is not None:
            self.remember(session, chosen)
        return Pick(self.fleet.pods[chosen], chosen, depth, action, backups)

    def _choose(
        self,
        request: RoutingRequest,
        candidates: int,
        route_key: int,
        home: int,
        steer: bool,
        params: PriceParams,
    ) -> tuple[int, int, str, tuple[int, ...]]:
        """The pod for the request among ``candidates``, recorded as holding its blocks.

        ``route_key`` places a new prefix; ``home`` is the session's pod (-1: none);
        ``steer`` False means no warm match steers (a session's first request here);
        ``params``, the candidates' destination's pricing.
        Returns ``(chosen, held, action, backups)``: the chosen slot, the blocks it
        holds, what steered, and the next cheapest slots (``fallbacks`` of them) for
        Envoy's retries. The C version (``native.pick``) does the same in one call for
        the default filters."""
        fleet = self.fleet
        for keep in self.filters:
            candidates = keep(request, candidates, fleet) or candidates
        blocks = request.hashes.blocks
        n = len(blocks)
        index = self.index
        depths = index.match_depths(blocks, candidates)
        held = depths  # what the pods hold; ``depths`` is what may steer
        if not steer:
            depths = {}
        elif self.min_match and depths:
            # A session's own history, on the pod it went to, counts however short.
            shallow = self.min_match * n
            depths = {slot: d for slot, d in depths.items() if d >= shallow or slot == home}
            if not depths:
                # Its own key, not the shared prefix's: its first block past the shared
                # prefix, the same for every turn of a conversation, so a replica that has
                # not seen the earlier turns still places it where they went.
                route_key = blocks[min(max(held.values()), n - 1)]
        load = fleet.load
        near_mask, deepest, order = price(
            self._slots(candidates),
            depths,
            index.room_view(),
            load,
            n,
            request.prompt_tokens,
            params,
            self.fallbacks + 1,  # the chosen pod may be among them
        )
        if home >= 0 and (near_mask >> home) & 1:
            near_mask = 1 << home  # a session stays on its pod among equals
        elif not deepest and self.balance_new:  # a new prefix: the least busy first
            near = self._slots(near_mask)
            least = min(load[slot].inflight for slot in near)
            near_mask = sum(1 << slot for slot in near if load[slot].inflight == least)
        chosen = (
            near_mask.bit_length() - 1
            if not near_mask & (near_mask - 1)
            else rendezvous.best(route_key, fleet.seeds, near_mask)
        )
        index.record(chosen, blocks)
        # The action names what steered: a shallow match placed as new is a miss. The
        # depth reported is what the chosen pod really holds (the saved-prefill estimate).
        best = max(depths.values(), default=0)
        action = "miss" if not best else ("hit" if depths.get(chosen, 0) == best else "spill")
        backups = tuple([slot for slot in order if slot != chosen][: self.fallbacks])
        return chosen, held.get(chosen, 0), action, backups
