"""The default policy: pods priced by estimated time to first token."""

import pytest

from ace_extproc.config import ConfigError, Settings, parse_settings, sim_fleet
from ace_extproc.latency import get_model
from ace_extproc.prefix import hash_prompt
from ace_extproc.routing import BlockIndex, FleetState, RoutingRequest, policies, rendezvous
from ace_extproc.routing.pipeline import Candidates, PrefillCost, QueueCost

PROMPT = bytes(range(256)) * 64  # 16 KB: 32 blocks, ~4K tokens


def setup(pods: int = 4, **policy: float):
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(pods)]))
    index = BlockIndex(10_000)
    return fleet, index, policies.cost_policy(Settings(), **policy)(fleet, index)


def request(data: bytes = PROMPT, seed: int = 1) -> RoutingRequest:
    h = hash_prompt(data, None, 512, seed)
    return RoutingRequest(h, data, len(data) // 4, "t", "m")


def test_a_warm_pod_wins_while_its_queue_is_cheaper_than_the_prefill_it_saves() -> None:
    fleet, _, picker = setup()
    first = picker.pick(request(), fleet.available)
    assert first is not None and first.action == "miss"
    # Some queue on the warm pod, but less than re-computing ~4K tokens elsewhere.
    fleet.load[first.slot].queued_prefill_ms = 40.0  # 1,000 tokens' prefill
    again = picker.pick(request(), fleet.available)
    assert again is not None and again.slot == first.slot and again.action == "hit"
    assert again.matched_blocks == 32


@pytest.mark.parametrize(("pace", "stays"), [(1.0, True), (2.0, True), (4.0, False)])
def test_a_warm_pod_slower_than_its_model_is_priced_at_its_pace(pace: float, stays: bool) -> None:
    """The warm pod of the test above, with the same queue, learned to take ``pace``
    times its model's time (``routing/pace.py``): its queue and the rest of its prefill
    cost that much more, so at 4x a cold pod that runs as modelled starts sooner."""
    fleet, _, picker = setup()
    first = picker.pick(request(), fleet.available)
    assert first is not None
    fleet.load[first.slot].queued_prefill_ms = 40.0
    fleet.load[first.slot].pace = pace
    again = picker.pick(request(), fleet.available)
    assert again is not None and (again.slot == first.slot) is stays
    assert again.action == ("hit" if stays else "spill")


def test_a_saturated_warm_pod_spills_and_the_prefix_is_replicated() -> None:
    fleet, index, picker = setup()
    first = picker.pick(request(), fleet.available)
    assert first is not None
    fleet.load[first.slot].queued_prefill_ms = 2_000.0  # 2 s of prefill queued
    spilled = picker.pick(request(), fleet.available)
    assert spilled is not None and spilled.slot != first.slot and spilled.action == "spill"
    # The spill went to the prefix's next pod in rendezvous order ...
    others = fleet.available & ~(1 << first.slot)
    assert spilled.slot == rendezvous.best(request().hashes.route_key, fleet.seeds, others)
    # ... and now both pods hold it warm.
    depths = index.match_depths(request().hashes.blocks, fleet.available)
    assert depths == {first.slot: 32, spilled.slot: 32}


def test_new_prefixes_follow_rendezvous_when_loads_are_equal() -> None:
    fleet, _, picker = setup()
    for seed in range(20):
        r = request(PROMPT[:600] + bytes([seed]) * 600, seed=seed)
        pick = picker.pick(r, fleet.available)
        assert pick is not None and pick.slot == rendezvous.best(r.hashes.route_key, fleet.seeds)


def test_near_ties_keep_affinity_instead_of_flapping() -> None:
    fleet, _, picker = setup(2)
    short = PROMPT[:1100]  # 2 blocks: saves little, so the slack decides
    first = picker.pick(request(short), fleet.available)
    assert first is not None
    fleet.load[first.slot].queued_prefill_ms = 2.4  # a little more queue: within the slack
    again = picker.pick(request(short), fleet.available)
    assert again is not None and again.slot == first.slot


@pytest.mark.parametrize(
    ("slack", "stays"),
    [({}, False), ({"affinity_slack": 1.0}, True), ({"affinity_slack_ms": 10_000.0}, True)],
)
def test_the_affinity_slack_sets_how_long_a_queued_warm_pod_keeps_its_prefix(
    slack: dict[str, float], stays: bool
) -> None:
    """A warm pod whose queue makes it cost half as much again as a cold pod: the
    default spills; a slack of 100% (or of ten seconds) keeps the request there."""
    settings = Settings(**slack)
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(4)]))
    picker = policies.cost_policy(settings)(fleet, BlockIndex(10_000))
    first = picker.pick(request(), fleet.available)
    assert first is not None
    model = get_model(settings.ttft_model)
    fleet.load[first.slot].queued_prefill_ms = 1.5 * model.prefill_ms(len(PROMPT) // 4, 0)
    again = picker.pick(request(), fleet.available)
    assert again is not None and (again.slot == first.slot) is stays
    assert again.action == ("hit" if stays else "spill")


def test_pods_holding_a_prefix_alike_go_by_price_not_by_the_slack() -> None:
    """A prefix every pod holds as deep (a shared first block): no affinity is at stake,
    so the cheapest pod takes the request, even one a few milliseconds cheaper (issue
    27: short requests warm only on that block waited behind long prefills)."""
    fleet, index, picker = setup(4)
    r = request()
    for slot in range(4):
        index.record(slot, r.hashes.blocks)
    first = rendezvous.best(r.hashes.route_key, fleet.seeds)
    for slot in range(4):
        fleet.load[slot].queued_prefill_ms = 3.0
    fleet.load[(first + 2) % 4].queued_prefill_ms = 1.0  # two milliseconds cheaper
    pick = picker.pick(r, fleet.available)
    assert pick is not None and pick.slot == (first + 2) % 4 and pick.action == "hit"


@pytest.mark.parametrize(
    ("slack", "rendezvous_wins"),
    [({}, True), ({"affinity_slack": 0.0, "affinity_slack_ms": 0.0}, False)],
)
def test_the_slack_places_new_prefixes_by_rendezvous_among_near_ties(
    slack: dict[str, float], rendezvous_wins: bool
) -> None:
    """A new prefix (no pod holds any of it) whose rendezvous pod has a little queue:
    within the slack it still goes there, so replicas with slightly different views
    agree; with no slack the cheapest pod takes it."""
    settings = Settings(**slack)
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(4)]))
    picker = policies.cost_policy(settings)(fleet, BlockIndex(10_000))
    r = request(b"a new document " * 300)
    home = rendezvous.best(r.hashes.route_key, fleet.seeds)
    fleet.load[home].queued_prefill_ms = 3.0  # inside 10% + 5 ms of a ~160 ms prefill
    pick = picker.pick(r, fleet.available)
    assert pick is not None and pick.action == "miss"
    assert (pick.slot == home) is rendezvous_wins


def test_affinity_slack_settings_are_checked() -> None:
    parsed = parse_settings({"affinity_slack": 0.5, "affinity_slack_ms": 20})
    assert (parsed.affinity_slack, parsed.affinity_slack_ms) == (0.5, 20.0)
    for name in ("affinity_slack", "affinity_slack_ms"):
        for bad in (-0.1, float("inf"), float("nan"), "wide"):
            with pytest.raises(ConfigError, match=rf"router\.{name}"):
                parse_settings({name: bad})


def test_saturated_kv_caches_are_avoided_unless_all_are() -> None:
    fleet, _, picker = setup(3)
    first = picker.pick(request(), fleet.available)
    assert first is not None
    fleet.load[first.slot].kv_usage = 0.99
    moved = picker.pick(request(), fleet.available)
    assert moved is not None and moved.slot != first.slot
    for load in fleet.load:
        load.kv_usage = 0.99
    assert picker.pick(request(), fleet.available) is not None


def test_fallbacks_are_the_next_cheapest_and_candidates_are_respected() -> None:
    fleet, _, picker = setup(4)
    pick = picker.pick(request(), 0b0110)
    assert pick is not None and pick.slot in (1, 2)
    assert pick.fallbacks == (({1, 2} - {pick.slot}).pop(),)
    assert picker.pick(request(), 0) is None
    full = picker.pick(request(b"x" * 4096), fleet.available)
    assert full is not None and len(full.fallbacks) == 2 and full.slot not in full.fallbacks


def test_the_price_is_queue_plus_uncached_prefill() -> None:
    fleet, _, _ = setup(1)
    model = get_model(Settings().ttft_model)
    r = request()
    fleet.load[0].queued_prefill_ms = 80.0

    def price(depth: int) -> float:
        c = Candidates(r, (0,), {0: depth}, fleet, BlockIndex(100), model, 128, 0, -1)
        return QueueCost()(c)[0] + PrefillCost()(c)[0]

    assert price(0) == 80.0 + model.prefill_ms(4096, 0)
    assert price(10) == 80.0 + model.prefill_ms(4096 - 1280, 1280)


def test_a_full_pod_is_priced_for_what_it_would_evict() -> None:
    # The shared prefix is short here, so let any match steer: eviction pricing alone
    # must move the document off the full pod.
    fleet, index, picker = setup(2, min_match=0.0)
    for slot in (0, 1):
        index.set_capacity(slot, 40)
    shared = b"S" * 1024  # a 2-block prefix every document starts with
    first = picker.pick(request(shared + bytes(range(256)) * 60), fleet.available)
    assert first is not None
    # Fill the pod that holds the shared prefix to its capacity with other documents.
    index.record(first.slot, list(range(10_000, 10_038)))
    doc = shared + b"D" * 15_000  # ~30 new blocks: placing it there would evict as many
    pick = picker.pick(request(doc), fleet.available)
    assert pick is not None and pick.slot != first.slot  # the pod with room wins
    assert pick.action == "spill"


def test_conversations_sharing_only_a_short_system_prompt_spread_over_the_pods() -> None:
    """A warm match on less than ``min_match`` of the prompt does not steer: 40
    conversations that share a 2-block system prompt (of 16 blocks) land on every
    pod, while with any match steering they all follow the system prompt."""
    from collections import Counter

    system = PROMPT[:1024]

    def place(min_match: float) -> Counter[int]:
        fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(4)]))
        picker = policies.cost_policy(Settings(), min_match=min_match)(fleet, BlockIndex(10_000))
        slots: Counter[int] = Counter()
        for i in range(40):
            convo = system + bytes([i % 256, i // 256]) * 3584  # 7 KB of its own
            pick = picker.pick(request(convo), fleet.available)
            assert pick is not None
            slots[pick.slot] += 1
        return slots

    assert len(place(0.0)) == 1  # every conversation followed the system prompt
    spread = place(0.25)
    assert len(spread) == 4 and max(spread.values()) <= 20
    # A conversation's next turn still sticks: its own history is most of the prompt.
    fleet, _, picker = setup()
    turn1 = system + b"x" * 7000
    first = picker.pick(request(turn1), fleet.available)
    again = picker.pick(request(turn1 + b"y" * 1500), fleet.available)
    assert first is not None and again is not None
    assert again.slot == first.slot and again.action == "hit"


def test_conversations_sharing_a_system_prompt_spread_by_their_events_depths_too() -> None:
    """Precise routing: the pods' events give the shared system prompt's depth from
    the engine's tokens, a hair under its 2 blocks (1.99). The conversations are still
    placed by their own first block, so they spread as with the router's record; keyed
    by the system prompt's last block (the depth truncated), every one followed it."""
    from collections import Counter

    system = PROMPT[:1024]
    fleet, _, picker = setup(4, min_match=0.25)
    slots: Counter[int] = Counter()
    for i in range(40):
        r = request(system + bytes([i % 256, i // 256]) * 3584)
        r.known, r.known_depths = fleet.available, dict.fromkeys(range(4), 1.99)
        pick = picker.pick(r, fleet.available)
        assert pick is not None and pick.action == "miss"
        slots[pick.slot] += 1
    assert len(slots) == 4 and max(slots.values()) <= 20


def test_replicas_place_a_new_conversation_the_same_way_on_every_turn() -> None:
    """A conversation sharing only a short system prompt is placed by its first block
    past that prefix, which every turn carries: a replica that never saw turn 1 puts
    turn 2 where another replica put turn 1 (placing by the prompt's last block, which
    changes every turn, scattered them)."""
    system = PROMPT[:1024]
    for i in range(20):
        a_fleet, _, replica_a = setup(8)
        b_fleet, _, replica_b = setup(8)
        for fleet, picker in ((a_fleet, replica_a), (b_fleet, replica_b)):
            assert picker.pick(request(system + b"warm" * 2000), fleet.available)  # both know it
        turn1 = system + bytes([i]) * 12000 + b"first question"  # 2 of 25 blocks shared
        turn2 = turn1 + b"an answer" * 300 + b"second question"
        first = replica_a.pick(request(turn1), a_fleet.available)
        second = replica_b.pick(request(turn2), b_fleet.available)
        assert first is not None and second is not None
        assert first.action == second.action == "miss"  # the system prompt alone does not steer
        assert second.slot == first.slot


def session_request(data: bytes, session: str) -> RoutingRequest:
    h = hash_prompt(data, None, 512, 1)
    return RoutingRequest(h, data, len(data) // 4, "t", "m", session)


def test_sessions_sharing_a_large_prefix_spread_and_then_stick() -> None:
    """Agents whose first request is 90% a shared tool prompt: each session's first
    request goes where its session's key puts it, not to the pod holding the tools (with
    place_sessions off they all pile onto that one); its later turns follow it there."""
    from collections import Counter

    tools = PROMPT[: 14 * 512]  # 14 of 16 blocks shared by every agent

    def first_turns(place_sessions: bool) -> tuple[Counter[int], dict[str, int]]:
        _, _, picker = setup(4, place_sessions=place_sessions)
        where: dict[str, int] = {}
        for i in range(40):
            pick = picker.pick(session_request(tools + bytes([i]) * 1024, f"agent-{i}"), 15)
            assert pick is not None
            where[f"agent-{i}"] = pick.slot
        return Counter(where.values()), where

    piled, _ = first_turns(False)
    assert len(piled) == 1  # every agent followed the tool prompt
    spread, where = first_turns(True)
    assert len(spread) == 4 and max(spread.values()) <= 16
    # The same sessions again, on a fresh replica: same pods, and a session's next turn,
    # seen by the replica that placed it, follows its own history.
    fleet, _, picker = setup(4)
    for i in range(40):
        turn1 = tools + bytes([i]) * 1024
        first = picker.pick(session_request(turn1, f"agent-{i}"), fleet.available)
        again = picker.pick(session_request(turn1 + b"tool result" * 300, f"agent-{i}"), 15)
        assert first is not None and again is not None
        assert first.slot == where[f"agent-{i}"] and first.action == "miss"
        assert again.slot == first.slot and again.action == "hit"


def test_a_replica_joining_a_session_late_sends_it_where_the_session_went() -> None:
    """Replica B never saw the session's first turn and holds the shared prefix on
    another pod: it still sends turn 2 to the session's pod, not to that prefix."""
    tools = PROMPT[: 14 * 512]
    placed = set()
    for i in range(20):
        a_fleet, _, replica_a = setup(8)
        b_fleet, _, replica_b = setup(8)
        turn1 = tools + bytes([i]) * 1024
        first = replica_a.pick(session_request(turn1, f"s{i}"), a_fleet.available)
        # B has routed another session with the same tools (so holds them somewhere).
        assert replica_b.pick(session_request(tools + b"other" * 300, "x"), b_fleet.available)
        second = replica_b.pick(
            session_request(turn1 + b"an answer" * 300, f"s{i}"), b_fleet.available
        )
        assert first is not None and second is not None and second.slot == first.slot
        placed.add(first.slot)
    assert len(placed) >= 4  # by session: spread, not all on the tools' pod


def test_a_sessions_own_history_steers_however_short() -> None:
    """A turn whose history is under min_match of its prompt (a long new message after a
    short exchange) stays on the session's pod; a stranger's equally short match on that
    pod does not draw an unrelated request."""
    fleet, _, picker = setup(8)
    history = PROMPT[: 2 * 512]
    first = picker.pick(session_request(history, "conv"), fleet.available)
    assert first is not None
    long_turn = history + bytes(range(256))[::-1] * 60  # 2 of 32 blocks are history
    again = picker.pick(session_request(long_turn, "conv"), fleet.available)
    assert again is not None and again.slot == first.slot and again.action == "hit"
    # Without a session the short match is someone else's prefix: min_match holds.
    other_turn = history + bytes(range(256)) * 60  # shares only the 2 history blocks
    stranger = picker.pick(request(other_turn, seed=1), fleet.available)
    assert stranger is not None and stranger.action == "miss"


def test_a_session_stays_on_its_pod_when_only_its_events_show_it_shallower() -> None:
    """Precise routing: the session's pod's events say part of its history was evicted,
    another pod holds one block more (a prefix other sessions share): priced alike, the
    turn stays home. Where the session's pod is known only by the router's record (no
    events), the deeper pod wins among equals as before."""
    turn1 = PROMPT[: 16 * 512]
    turn2 = turn1 + bytes(range(256))[::-1] * 16  # 32 blocks

    def second_turn(home_known: bool) -> tuple[int, int]:
        fleet, _, picker = setup(8)
        first = picker.pick(session_request(turn1, "s"), fleet.available)
        assert first is not None
        home, other = first.slot, (first.slot + 1) % 8
        r = session_request(turn2, "s")
        if home_known:  # events: 11 blocks left at home, 12 on the other pod
            r.known, r.known_depths = (1 << home) | (1 << other), {home: 11, other: 12}
        else:  # the record says 16 at home; the other pod's events, 17
            r.known, r.known_depths = 1 << other, {other: 17}
        pick = picker.pick(r, fleet.available)
        assert pick is not None
        return home, pick.slot

    home, chosen = second_turn(home_known=True)
    assert chosen == home
    home, chosen = second_turn(home_known=False)
    assert chosen != home


def test_a_session_moved_by_another_replica_follows_its_history_there() -> None:
    """Precise routing, replicas sharing nothing: this replica sent turn 1 (16 blocks) to
    its pod; another replica then sent turn 2 elsewhere. At turn 3 the events show that
    pod holding more than this replica ever sent home, which only the session's own later
    turns can be: the turn goes there, not back to a home that looks evicted (as where
    the deeper pod holds no more than was sent home: the test above)."""
    turn1 = PROMPT[: 16 * 512]
    turn3 = turn1 + bytes(range(256))[::-1] * 32  # 48 blocks
    fleet, _, picker = setup(8)
    first = picker.pick(session_request(turn1, "s"), fleet.available)
    assert first is not None
    home, moved = first.slot, (first.slot + 3) % 8
    r = session_request(turn3, "s")
    # Home holds its 16 blocks; turns 1 and 2 (17 blocks: priced near) on the other pod.
    r.known, r.known_depths = (1 << home) | (1 << moved), {home: 16, moved: 17}
    pick = picker.pick(r, fleet.available)
    assert pick is not None and pick.slot == moved and pick.action == "hit"


def test_a_replica_joining_a_session_late_follows_its_history_by_the_events() -> None:
    """Precise routing, replicas sharing nothing: replica B never routed the session, and
    the turn carries its history (an assistant message). The pods' events say which pod
    holds that history (another replica put it there, off the session's own pod): B
    sends the turn there. A first request (no earlier turn) is still placed by its
    session, not by a deep match, which can only be somebody else's."""
    tools = PROMPT[: 14 * 512]
    answer = b"\x1eassistant\x1f"  # the canonical prompt's assistant message
    moved = 0
    for i in range(16):
        fleet, _, replica_b = setup(8)
        first_turn = tools + bytes([i]) * 1024
        by_session = replica_b.pick(session_request(first_turn, f"s{i}"), fleet.available)
        assert by_session is not None
        fleet, _, replica_b = setup(8)  # a fresh replica: the session is new to it again
        history = (by_session.slot + 1 + i % 7) % 8  # where another replica put it
        turn = first_turn + answer + b"an answer" * 300
        depths = {slot: 14.0 for slot in range(8)} | {history: 20.0}  # the tools everywhere
        r = session_request(turn, f"s{i}")
        r.known, r.known_depths = fleet.available, depths
        pick = replica_b.pick(r, fleet.available)
        assert pick is not None and pick.slot == history and pick.action == "hit"
        # The same events for a first request of another session: placed by its session.
        fresh = session_request(tools + bytes([i]) * 1024 + b"x" * 3000, f"new{i}")
        fresh.known, fresh.known_depths = fleet.available, depths
        pick = replica_b.pick(fresh, fleet.available)
        assert pick is not None and pick.action == "miss"
        moved += pick.slot != history
    assert moved >= 8


def test_sessions_are_remembered_per_tenant() -> None:
    """Session ids are the clients': another tenant's "s1" is a session this replica
    has never routed, placed by its key as a first request is."""
    fleet, _, picker = setup(8)

    def tenant_request(data: bytes, tenant: str) -> RoutingRequest:
        return RoutingRequest(
            hash_prompt(data, None, 512, 7), data, len(data) // 4, tenant, "m", "s1"
        )

    first = picker.pick(tenant_request(PROMPT, "a"), fleet.available)
    again = picker.pick(tenant_request(PROMPT, "a"), fleet.available)
    other = picker.pick(tenant_request(PROMPT, "b"), fleet.available)
    assert first is not None and again is not None and other is not None
    assert again.action == "hit"  # tenant a's session continues on its pod
    assert other.action == "miss"  # tenant b's "s1" is new here: the match does not steer


def test_pods_alike_in_price_and_match_go_to_the_least_busy() -> None:
    """A prefix every pod holds, every queue drained: the prices tie exactly, and the
    least busy pod takes the request, not always the first in rendezvous order."""
    fleet, index, picker = setup(4)
    r = request()
    for slot in range(4):
        index.record(slot, r.hashes.blocks)
    first = rendezvous.best(r.hashes.route_key, fleet.seeds)
    for slot in range(4):
        fleet.load[slot].inflight = 5
    fleet.load[(first + 1) % 4].inflight = 2
    pick = picker.pick(r, fleet.available)
    assert pick is not None and pick.slot == (first + 1) % 4 and pick.action == "hit"
    fleet.load[(first + 1) % 4].inflight = 5  # all alike again: rendezvous order decides
    again = picker.pick(r, fleet.available)
    assert again is not None and again.slot == first
