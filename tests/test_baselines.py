"""The peer routers' policies (bench/baselines): each on a 4-pod fleet with hand-made
requests, plus one pass of every registered policy through the production Processor."""

from collections import Counter

import msgspec
import pytest

from ace_extproc.config import Config, Settings, sim_fleet
from ace_extproc.prefix import hash_prompt, scope_seed
from ace_extproc.routing import BlockIndex, FleetState, PrefixAffinityPicker, RoutingRequest
from ace_extproc.routing.lora import LoraCost
from ace_extproc.routing.pipeline import Pipeline
from bench.baselines import POLICIES, SIMULATION_SETTINGS
from bench.baselines._text_tree import TextTree, common_prefix
from bench.baselines.dynamo_cost import DynamoCostPicker
from bench.baselines.gie_scorers import GIEScorerPicker
from bench.baselines.least_loaded import LeastLoadedPicker
from bench.baselines.random_pick import RandomPicker
from bench.baselines.round_robin import RoundRobinPicker
from bench.baselines.session_hash import SessionHashPicker
from bench.baselines.sglang_cache_aware import SGLangCacheAwarePicker
from bench.baselines.vllm_cache_aware import VLLMCacheAwarePicker
from tests.conftest import make_processor

ALL = 0b1111


def fleet(n=4):
    return FleetState(sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(n)]))


def req(prompt, session=None, tenant="t", model="m"):
    data = prompt.encode() if isinstance(prompt, str) else prompt
    hashes = hash_prompt(data, None, 512, scope_seed(tenant, model))
    return RoutingRequest(hashes, data, max(1, len(data) // 4), tenant, model, session)


def text(tag, n):
    """``n`` bytes of text unique to ``tag``."""
    unit = f"<{tag}> lorem ipsum dolor sit amet {tag}. "
    return (unit * (n // len(unit) + 1))[:n]


def set_load(f, field, values):
    for slot, v in enumerate(values):
        setattr(f.load[slot], field, v)


def make(cls, **kw):
    f = fleet()
    return f, cls(f, BlockIndex(10_000), **kw)


# ------------------------------------------------------------------ every policy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_respects_the_mask_and_returns_none_on_zero(name):
    f = fleet()
    picker = POLICIES[name](f, BlockIndex(10_000))
    r = req(text("mask", 3000), session="s")
    assert picker.pick(r, 0) is None
    for mask in (0b0001, 0b0100, 0b1010, 0b0110, ALL):
        for i in range(6):
            p = picker.pick(req(text(f"m{i % 3}", 3000), session=f"s{i}"), mask)
            assert p is not None and (mask >> p.slot) & 1
            assert p.pod is f.pods[p.slot] and p.action in ("hit", "miss")
            if name.startswith("ace"):
                # Ours names what steered: a request placed as new (its session's first,
                # or a shallow match) is a miss even on a pod holding blocks of it;
                # matched_blocks is what that pod holds (the saved-prefill estimate).
                assert p.action != "hit" or p.matched_blocks > 0
            else:
                assert (p.action == "hit") == (p.matched_blocks > 0)


def test_registry_names_and_special_settings():
    assert set(POLICIES) == {
        "round_robin",
        "random",
        "least_loaded",
        "session_hash",
        "sglang_cache_aware",
        "vllm_cache_aware",
        "gie_scorers",
        "gie_lora",
        "dynamo_cost",
        "ace",
        "ace_affinity",
        "ace_balanced",
        "ace_any_match",
        "ace_by_prefix",
        "ace_no_slot_wait",
        "bound_pooled",
        "bound_unbounded",
    }
    assert POLICIES["ace_affinity"] is PrefixAffinityPicker
    assert isinstance(
        POLICIES["ace"](FleetState(sim_fleet(["127.0.0.1:1"])), BlockIndex(8)), Pipeline
    )
    assert POLICIES["bound_unbounded"] is PrefixAffinityPicker
    # ace_no_slot_wait: ours, its lora scorer pricing a load but no wait for a busy slot.
    no_wait = POLICIES["ace_no_slot_wait"](FleetState(sim_fleet(["127.0.0.1:1"])), BlockIndex(8))
    assert isinstance(no_wait, Pipeline)
    lora = [w.scorer for w in no_wait.scorers if isinstance(w.scorer, LoraCost)]
    assert lora == [LoraCost(busy_ms=0.0)]
    assert POLICIES["bound_pooled"] is LeastLoadedPicker
    assert set(SIMULATION_SETTINGS) == {"bound_pooled", "bound_unbounded"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_runs_through_the_processor(name):
    fl = sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)])
    p = make_processor(Config(fl, Settings(salt_secret=b"s")), picker=POLICIES[name])
    system = {"role": "system", "content": text("sys", 4000)}
    headers = {":path": "/v1/chat/completions", ":method": "POST", "x-session-id": "abc"}
    for turn in range(3):
        b = msgspec.json.encode(
            {"model": "sim", "messages": [system, {"role": "user", "content": f"q{turn}"}]}
        )
        out = p.on_body(p.on_headers(headers, False), b)
        assert out.pod is not None and out.action in ("hit", "miss")


# ------------------------------------------------------------------ load-only


def test_round_robin_cycles_over_candidates():
    _, rr = make(RoundRobinPicker)
    r = req("x")
    assert [rr.pick(r, ALL).slot for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [rr.pick(r, 0b1010).slot for _ in range(4)] == [3, 1, 3, 1]


def test_random_is_seeded_uniform_and_within_the_mask():
    f = fleet()
    a, b = RandomPicker(f, BlockIndex(1)), RandomPicker(f, BlockIndex(1))
    r = req("x")
    picks = [a.pick(r, ALL).slot for _ in range(400)]
    assert picks == [b.pick(r, ALL).slot for _ in range(400)]
    assert all(70 < c < 130 for c in Counter(picks).values()) and len(set(picks)) == 4
    assert {a.pick(r, 0b0110).slot for _ in range(50)} == {1, 2}


def test_least_loaded_follows_inflight():
    f, ll = make(LeastLoadedPicker)
    r = req("x")
    assert ll.pick(r, ALL).slot == 0  # all idle: the lowest slot
    set_load(f, "inflight", [3, 1, 2, 1])
    assert ll.pick(r, ALL).slot == 1  # tie between 1 and 3: the lower
    set_load(f, "inflight", [3, 4, 2, 5])
    assert ll.pick(r, ALL).slot == 2
    assert ll.pick(r, 0b1010).slot == 1


def test_session_hash_sticks_sessions_and_spreads_them():
    _, sh = make(SessionHashPicker)
    for s in range(20):  # every turn of a session, whatever its text, on one pod
        turns = [req(text(f"t{t}", 2000), session=f"s{s}") for t in range(5)]
        assert len({sh.pick(r, ALL).slot for r in turns}) == 1
    counts = Counter(sh.pick(req("x", session=f"user-{i}"), ALL).slot for i in range(2000))
    assert len(counts) == 4 and all(350 < c < 650 for c in counts.values())
    # No session: the first block decides, so one document's questions stay together.
    doc = text("doc", 2000)
    assert len({sh.pick(req(doc + f"question {q}"), ALL).slot for q in range(10)}) == 1
    # The ring's pod is not a candidate: the first candidate, as the vLLM Router does.
    home = sh.pick(req("x", session="k"), ALL).slot
    others = ALL & ~(1 << home)
    assert sh.pick(req("x", session="k"), others).slot == (others & -others).bit_length() - 1


def test_session_hash_whole_prompt_fallback_changes_every_turn():
    _, sh = make(SessionHashPicker, fallback_whole_prompt=True)
    doc = text("doc", 2000)
    assert len({sh.pick(req(doc + f"question {q}"), ALL).slot for q in range(20)}) > 1


# ------------------------------------------------------------------ SGLang / vLLM


def test_text_tree_matches_to_the_character():
    tree = TextTree(1 << 20)
    a = text("a", 1000)
    tree.insert(tree.walk(a.encode(), 1), 2)
    for n in (0, 1, 63, 64, 65, 700, 1000):  # b shares exactly n characters with a
        b = (a[:n] + "#" + a[n + 1 :]).encode() if n < 1000 else a.encode()
        matched, holders = tree.match(tree.walk(b, 1), ALL)
        assert matched == n and holders == (0b100 if n else 0)
    assert tree.match(tree.walk(a[:100].encode(), 1), ALL) == (100, 0b100)  # a prefix of it
    assert tree.match(tree.walk(a.encode(), 2), ALL) == (0, 0)  # another tenant/model
    assert tree.match(tree.walk(a.encode(), 1), 0b011) == (0, 0)  # not a candidate
    assert common_prefix(b"abcdef", b"abcxef") == 3 and common_prefix(b"ab", b"abc") == 2


def test_text_tree_evicts_a_workers_oldest_text_leaf_first():
    tree = TextTree(3000)
    a, b, c = (text(t, 1200).encode() for t in "abc")
    for t in (a, b):
        tree.insert(tree.walk(t, 1), 0)
    tree.insert(tree.walk(a, 1), 0)  # a is now the most recent
    tree.insert(tree.walk(c, 1), 0)  # over 3000 bytes: b goes, from its tail
    assert tree.size(0) <= 3000
    assert tree.match(tree.walk(a, 1), 1)[0] == 1200
    assert tree.match(tree.walk(c, 1), 1)[0] == 1200
    assert tree.match(tree.walk(b, 1), 1)[0] < 1200


def test_sglang_sends_a_repeated_prompt_to_the_same_worker():
    f, sg = make(SGLangCacheAwarePicker)
    set_load(f, "inflight", [5, 0, 5, 5])  # balanced enough: the miss goes to the least loaded
    p = text("chat", 6000)
    first = sg.pick(req(p), ALL)
    assert first.slot == 1 and first.action == "miss"
    set_load(f, "inflight", [0, 3, 0, 0])
    again = sg.pick(req(p), ALL)
    assert again.slot == 1 and again.action == "hit" and again.matched_blocks == 6000 // 512
    longer = sg.pick(req(p + text("turn2", 3000)), ALL)  # match rate 2/3 > 0.3
    assert longer.slot == 1
    # A short prompt and its prefix, as SGLang's own test ("hello world", then "hello").
    set_load(f, "inflight", [0, 0, 0, 0])
    assert sg.pick(req("hello world"), 0b1100).slot == 2
    assert sg.pick(req("hello"), ALL).slot == 2


def test_sglang_match_rate_must_exceed_the_threshold():
    f, sg = make(SGLangCacheAwarePicker)
    set_load(f, "inflight", [9, 0, 9, 9])
    shared = text("sys", 1000)
    assert sg.pick(req(shared + text("a", 4000)), ALL).slot == 1
    set_load(f, "inflight", [0, 9, 9, 9])
    assert sg.pick(req(shared + text("b", 4000)), ALL).slot == 0  # 20% matched: least loaded
    assert sg.pick(req(shared + text("a", 1000)), ALL).slot == 1  # 100%: the match


@pytest.mark.parametrize(
    ("loads", "expect"),
    [
        ([0, 100, 0, 0], 0),  # 100 - 0 > 64 and 100 > 1.5 * 0: least loaded
        ([70, 200, 70, 80], 0),  # 130 > 64 and 200 > 105: least loaded
        ([100, 150, 100, 100], 1),  # 50 <= 64: the cache
        ([200, 280, 210, 200], 1),  # 80 > 64 but 280 <= 300: the cache
    ],
)
def test_sglang_goes_least_loaded_only_when_both_thresholds_are_exceeded(loads, expect):
    f, sg = make(SGLangCacheAwarePicker)
    set_load(f, "inflight", [5, 0, 5, 5])
    p = text("doc", 5000)
    assert sg.pick(req(p), ALL).slot == 1
    set_load(f, "inflight", loads)
    assert sg.pick(req(p), ALL).slot == expect
    if expect == 0:  # the tree still learns where it went: pod 0 now holds it too
        assert sg.tree.match(sg.tree.walk(p.encode(), req(p).hashes.seed), 1)[0] == 5000


def test_sglang_reproduces_the_first_worker_weakness():
    _, sg = make(SGLangCacheAwarePicker)  # sequential traffic: every load is 0
    slots = [sg.pick(req(text(f"prefix{i}", 3000)), ALL).slot for i in range(20)]
    assert slots == [0] * 20


def test_vllm_cache_aware_matches_whole_tokens():
    f, vl = make(VLLMCacheAwarePicker)
    assert vl.match_rate(7, 100) == 1 / 25 and vl.match_rate(3, 3) == 0.0
    set_load(f, "inflight", [5, 5, 0, 5])
    p = text("doc", 4000)
    assert vl.pick(req(p), ALL).slot == 2
    set_load(f, "inflight", [0, 0, 0, 0])
    assert vl.pick(req(p), ALL).slot == 2
    assert [vl.pick(req(text(f"n{i}", 999)), ALL).slot for i in range(5)] == [0] * 5


# ------------------------------------------------------------------ GIE


def test_gie_prefix_dominates_when_loads_are_equal():
    _, gie = make(GIEScorerPicker)
    p = text("doc", 8000)
    first = gie.pick(req(p), ALL)
    assert first.action == "miss"
    for q in range(5):
        again = gie.pick(req(p + f" question {q}"), ALL)
        assert again.slot == first.slot and again.matched_blocks == 8000 // 64 * 64 // 512
        assert gie.matched(gie.prompt_hashes(req(p))) == {first.slot: 8000 // 64}
    # Ties (nothing matched, loads equal) are broken at random, not to the first pod.
    assert len({gie.pick(req(text(f"new{i}", 2000)), ALL).slot for i in range(40)}) > 1


def test_gie_queue_pressure_moves_traffic():
    f, gie = make(GIEScorerPicker)
    doc = text("doc", 4000)
    home = gie.pick(req(doc), ALL).slot
    half = doc + text("other", 4000)  # about half its blocks match: prefix score ~0.5
    assert gie.pick(req(half), ALL).slot == home
    waiting = [0, 0, 0, 0]
    waiting[home] = 10  # the only queue: queue score 0 there, 1 elsewhere
    set_load(f, "waiting", waiting)
    assert gie.pick(req(doc + text("third", 4000)), ALL).slot != home
    set_load(f, "waiting", [0, 0, 0, 0])
    kv = [0.0, 0.0, 0.0, 0.0]
    kv[home] = 0.9  # a full KV cache costs it 2 * 0.9 > 3 * 0.5
    set_load(f, "kv_usage", kv)
    assert gie.pick(req(doc + text("fourth", 4000)), ALL).slot != home


def test_gie_matches_at_most_256_blocks():
    _, gie = make(GIEScorerPicker)
    shared = text("long", 256 * 64)
    a, b = req(shared + text("a", 5000)), req(shared + text("b", 5000))
    assert len(gie.prompt_hashes(a)) == 256 and gie.prompt_hashes(a) == gie.prompt_hashes(b)
    home = gie.pick(a, ALL).slot
    counts = gie.matched(gie.prompt_hashes(b))
    assert counts == {home: 256}  # b looks fully cached although its tail never was
    assert gie.pick(b, ALL).slot == home
    assert gie.prompt_hashes(req("short")) == []


def test_gie_lru_forgets_the_oldest_hashes():
    _, gie = make(GIEScorerPicker, lru_capacity_per_server=100)
    a, b = req(text("a", 64 * 80)), req(text("b", 64 * 80))
    ha = gie.prompt_hashes(a)
    gie.add(ha, 0)
    gie.add(gie.prompt_hashes(b), 0)  # 80 + 80 > 100: a's oldest (its head) go first
    assert gie.matched(ha) == {}


# ------------------------------------------------------------------ Dynamo


def test_dynamo_prefers_overlap_unless_its_active_blocks_cost_more():
    f, dyn = make(DynamoCostPicker)
    p = text("doc", 40 * 512)
    home = dyn.pick(req(p), ALL).slot
    inflight = [0, 0, 0, 0]
    inflight[home] = 1  # the first request still runs there
    set_load(f, "inflight", inflight)
    again = dyn.pick(req(p + "more"), ALL)
    assert again.slot == home and again.matched_blocks == 40 and again.action == "hit"
    # Same prefix in flight: distinct active blocks barely grow, so it still wins.
    inflight[home] = 2
    set_load(f, "inflight", inflight)
    assert dyn.pick(req(p + "again"), ALL).slot == home
    # Other long requests in flight there: their blocks outweigh the 40 blocks saved.
    for i in range(3):
        dyn._recent[home].append(req(text(f"busy{i}", 20 * 512)).hashes.blocks)
    inflight[home] = 3
    set_load(f, "inflight", inflight)
    assert dyn.pick(req(p + "later"), ALL).slot != home


@pytest.mark.parametrize(("weight", "stays"), [(1.0, True), (0.0, False)])
def test_dynamo_cost_is_weighted_prefill_plus_active_blocks(weight, stays):
    f, dyn = make(DynamoCostPicker, overlap_score_weight=weight)
    p = text("doc", 10 * 512)
    home = dyn.pick(req(p), ALL).slot
    dyn._recent[home].append(req(text("busy", 5 * 512)).hashes.blocks)
    inflight = [0, 0, 0, 0]
    inflight[home] = 2  # p and a 5-block request in flight there
    set_load(f, "inflight", inflight)
    # weight 1: home costs 0 prefill + 15 active, others 10 + 10; weight 0: 15 against 10.
    assert (dyn.pick(req(p), ALL).slot == home) is stays
