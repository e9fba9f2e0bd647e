"""LoRA adapters in the router: the engine's metric, each pod's adapter slots as the
router sees them, and what serving an adapter costs (routing/lora.py)."""

import math
import random
from collections import Counter

import pytest

from ace_extproc.config import Fleet, Settings, parse_settings, sim_fleet
from ace_extproc.latency import DECODE_STEPS, DEFAULT_LOAD_MS, get_model
from ace_extproc.prefix import hash_prompt, scope_seed
from ace_extproc.routing import BlockIndex, FleetState, RoutingRequest, metrics_text, policies
from ace_extproc.routing.load import LoadAccounting
from ace_extproc.routing.lora import OPEN_FOR_S, Adapters, LoraCost
from ace_extproc.routing.metrics_text import LoraInfo
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.routing.pipeline import DEFAULT_SCORERS

BASE = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = bytes(range(256)) * 64  # 16 KB: 32 blocks, ~4K tokens

# vLLM's exposition, as prometheus-client writes it: the gauge's labels as the CPU build
# (0.32) wrote them (max_lora, running, waiting; docs/engines.md), no engine or model_name
# label, the value a Unix time. Every combination seen stays a series. (vLLM 0.32 repeats
# the running adapters as waiting; the parse takes the labels as named either way.)
# fmt: off
VLLM_TEXT = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{BASE}"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{BASE}"}} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""}} 1.7333995e+09
vllm:lora_requests_info{{max_lora="4",running_lora_adapters="sql-lora,chat",waiting_lora_adapters="legal"}} 1.7333996905843e+09
vllm:lora_requests_info{{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}} 1.7333990905843e+09
"""  # noqa: E501
# fmt: on


def test_the_newest_lora_sample_is_the_engines_state() -> None:
    stats = metrics_text.parse(VLLM_TEXT)
    assert stats.reason == ""
    assert stats.model_name == BASE
    assert stats.lora == LoraInfo(4, ("sql-lora", "chat"), ("legal",))
    assert stats.lora.in_use == ("sql-lora", "chat", "legal")
    assert stats.running == 3 and stats.waiting == 1


def test_the_requests_deferred_for_a_slot_are_read_beside_the_slots() -> None:
    """vLLM 0.32 counts a request waiting for an adapter's slot only under
    ``vllm:num_requests_waiting_by_reason{reason="deferred"}``."""
    text = VLLM_TEXT + (
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        f'vllm:num_requests_waiting_by_reason{{model_name="{BASE}",reason="capacity"}} 3.0\n'
        f'vllm:num_requests_waiting_by_reason{{model_name="{BASE}",reason="deferred"}} 2.0\n'
    )  # fmt: skip
    stats = metrics_text.parse(text)
    assert stats.lora is not None and stats.lora.deferred == 2 and stats.reason == ""
    assert stats.waiting == 1  # the reasons are not summed into the waiting count
    assert metrics_text.parse(VLLM_TEXT).lora == LoraInfo(4, ("sql-lora", "chat"), ("legal",))


def test_lora_samples_with_missing_or_empty_labels_are_read_safely() -> None:
    idle = metrics_text.parse(
        'vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",'
        'running_lora_adapters=""} 1.7e+09\n'
    )
    assert idle.lora == LoraInfo(2) and idle.engine == "vllm"
    # No adapter labels at all, a stray comma, spaces: no adapter named "".
    bare = metrics_text.parse(
        'vllm:lora_requests_info{max_lora="8",running_lora_adapters=" a,,b "} 5.0\n'
    )
    assert bare.lora == LoraInfo(8, ("a", "b"), ())
    # No max_lora: adapters still read, slots unknown (0: costs nothing), and said.
    unknown = metrics_text.parse('vllm:lora_requests_info{running_lora_adapters="a"} 5.0\n')
    assert unknown.lora == LoraInfo(0, ("a",), ())
    assert "max_lora" in unknown.reason
    bad = metrics_text.parse('vllm:lora_requests_info{max_lora="x"} nan\n')
    assert bad.lora is None and "nan" in bad.reason
    assert metrics_text.parse(VLLM_TEXT.split("# HELP vllm:lora")[0]).lora is None


BUSY_MS = 2000.0


def cost(view: Adapters, model: str) -> float:
    return view.cost_ms(model, DEFAULT_LOAD_MS, BUSY_MS)


def test_an_adapter_costs_nothing_loaded_a_load_with_a_slot_free_more_when_all_are_busy() -> None:
    view = Adapters()
    view.picked("a")  # nothing scraped yet: no LoRA known, nothing recorded
    assert cost(view, "a") == 0.0 and not view.loaded
    view.scraped(BASE, 2, ["a"])
    assert cost(view, BASE) == 0.0  # the base model is no adapter
    assert cost(view, "a") == 0.0  # loaded
    assert cost(view, "b") == DEFAULT_LOAD_MS  # a free slot
    view.picked("b")  # between scrapes, the router's own pick counts
    assert cost(view, "b") == 0.0
    # Both slots' adapters in use: a third waits for one of them to finish.
    assert cost(view, "c") == DEFAULT_LOAD_MS + BUSY_MS
    # The next scrape: "a" has no request left. It stays loaded, but its slot may go.
    view.scraped(BASE, 2, ["b"])
    assert cost(view, "a") == 0.0 and cost(view, "c") == DEFAULT_LOAD_MS
    view.picked("c")  # "c" took the slot of "a", the least recently used idle one
    assert list(view.loaded) == ["b", "c"]
    assert cost(view, "a") == DEFAULT_LOAD_MS + BUSY_MS  # "b" and "c" in use
    view.idle()  # an idle engine: nothing in use, both still loaded
    assert cost(view, "d") == DEFAULT_LOAD_MS and cost(view, "c") == 0.0


def test_a_pick_that_waits_for_a_slot_is_not_loaded_until_it_has_run() -> None:
    """Sent where every slot's adapter is in use, a request waits: its adapter is in
    use but not loaded, so the next request for it is priced as waiting too (believed
    loaded, it was priced free, and a fleet overloaded by a pod's scale-out piled an
    adapter's requests onto a pod whose slots its hot adapters never gave up). Its
    answer says it ran: loaded then. A scrape's waiting-only adapters are not loaded."""
    view = Adapters()
    view.scraped(BASE, 2, ["a", "b"])
    number = view.picked("c", seen_by=1.0)
    assert "c" in view.in_use and "c" not in view.loaded
    assert cost(view, "c") == DEFAULT_LOAD_MS + BUSY_MS
    view.scraped(BASE, 2, ["a", "b"], now=0.5)  # too soon to show "c": still waiting
    assert "c" in view.in_use and "c" not in view.loaded
    view.answered(number)
    assert "c" in view.loaded and "c" not in view.in_use
    # An engine that names waiting adapters apart: those are in use, not loaded.
    view.scraped(BASE, 2, ["a", "b", "d"], running=["a", "b"])
    assert "d" in view.in_use and "d" not in view.loaded


def test_a_deferred_request_stays_waiting_though_no_label_names_it() -> None:
    """vLLM 0.32 names a request waiting for a slot in neither label; it counts it as
    deferred. A pick sent to wait stays open while the engine says requests are
    deferred, so the slots stay full in the router's view (closed, it let the next
    adapters be priced free there, and on the real pods they waited 5-15 s)."""
    view = Adapters()
    view.scraped(BASE, 2, ["a", "b"])
    view.picked("c", seen_by=1.0)
    view.scraped(BASE, 2, ["a", "b"], now=2.0, deferred=1)  # shows it nowhere
    assert "c" in view.in_use and view.waits_for_slot("d")
    view.scraped(BASE, 2, ["a", "b"], now=3.0)  # none deferred: it ran and was answered
    assert "c" not in view.in_use and not view.picks
    # Deferred requests beyond this router's picks are others': only its own stay open.
    first, second = view.picked("c", seen_by=4.0), view.picked("d", seen_by=4.0)
    view.scraped(BASE, 2, ["a", "b"], now=5.0, deferred=1)
    assert [m for m, _, _ in view.picks.values()] == ["c"] and first in view.picks
    assert second not in view.picks


def test_where_answers_are_heard_they_alone_close_the_picks() -> None:
    """vLLM names a request's adapter only from its first token: one queued for the
    step's token budget, or prefilling, is in no label, so a scrape cannot tell it from
    an answered one. Where answers are heard, a scrape closes no pick. (Closed by a
    scrape, they had a busy real pod's four slots counted with one free, and an adapter
    sent there waited behind the whole batch, 7.5 s, while the other pod had slots
    free.)"""
    view = Adapters()
    view.scraped(BASE, 4, [])
    view.answered(view.picked("z", seen_by=0.5))  # Envoy's access log reaches us
    a, b, c = (view.picked(m, seen_by=1.0) for m in ("a", "b", "c"))
    view.scraped(BASE, 4, ["x"], now=2.0)  # "x" others'; a, b, c queued: in no label
    assert view.in_use == {"a", "b", "c", "x"} and set(view.picks) == {a, b, c}
    assert view.state("d") == "wait"  # every slot's adapter in use
    view.answered(b)
    view.scraped(BASE, 4, ["a", "x"], now=3.0)
    assert view.in_use == {"a", "c", "x"} and view.state("d") == "load"
    view.scraped(BASE, 4, [], now=1.0 + OPEN_FOR_S + 1)  # answers lost: let go at last
    assert not view.picks and not view.in_use


def test_without_answers_a_scrape_keeps_open_only_the_picks_waiting_for_a_slot() -> None:
    """Where no answer is heard (no access log), the scrapes alone close picks: one
    that a scrape could show and does not was answered, unless it was sent to wait for
    a slot and the engine counts that many requests deferred."""
    view = Adapters()
    view.scraped(BASE, 2, [])
    view.picked("a", seen_by=1.0)
    running = view.picked("b", seen_by=1.0)
    waiting = view.picked("c", seen_by=1.0)
    view.scraped(BASE, 2, ["b"], now=2.0, deferred=1)  # "a" answered
    assert list(view.picks) == [running, waiting] and view.in_use == {"b", "c"}


def test_a_slot_freed_goes_to_the_adapter_waiting_for_it() -> None:
    """vLLM gives a slot whose adapter has no request left to an adapter waiting for
    one: the idle adapter is evicted, and a request for it now waits (believed loaded
    still, it drew a request into a 14.7 s wait on the real pods)."""
    view = Adapters()
    view.scraped(BASE, 2, [])
    first = view.picked("a", seen_by=1.0)
    view.picked("b", seen_by=1.0)
    waiting = view.picked("c", seen_by=1.0)  # every slot's adapter in use: it waits
    assert "c" not in view.loaded
    view.answered(first)  # "a" has no request left: "c" takes its slot
    assert list(view.loaded) == ["b", "c"] and "a" not in view.loaded
    assert view.waits_for_slot("a") and cost(view, "a") > DEFAULT_LOAD_MS
    view.answered(waiting)
    assert cost(view, "a") == DEFAULT_LOAD_MS  # a slot to take, but a load


def test_a_slot_held_by_a_hot_adapter_waits_longer() -> None:
    """vLLM keeps admitting a running adapter's new requests, so its slot frees only at
    a gap of one answer between them: (e^x - 1) / x answers, x its requests in flight
    less one (this router's open picks); the adapters already waiting go first."""
    view = Adapters()
    view.scraped(BASE, 2, ["a", "b"])
    assert view.slot_wait_answers("c") == 1.0  # shown by a scrape only: one answer
    for _ in range(3):
        view.picked("a")
        view.picked("b")
    # Three of each in flight: the first to free, after (e^2 - 1) / 2 answers.
    assert view.slot_wait_answers("c") == pytest.approx(math.expm1(2) / 2)
    assert cost(view, "c") == pytest.approx(DEFAULT_LOAD_MS + BUSY_MS * math.expm1(2) / 2)
    view.picked("c")  # waits; "d" then waits behind it, for the second slot to free
    assert view.slot_wait_answers("d") == pytest.approx(math.expm1(2) / 2)
    view.picked("b")  # "b" hotter than "a" now: "d" waits for "b"'s gap
    assert view.slot_wait_answers("d") == pytest.approx(math.expm1(3) / 3)
    view.picked("d")
    view.picked("e")  # three waiting ahead on two slots: "f" waits for a second round
    assert view.slot_wait_answers("f") == pytest.approx(2 * math.expm1(3) / 3)


def test_a_pick_that_waits_for_a_slot_is_predicted_as_unknown_to_the_pace() -> None:
    """The pace learns the pod's speed from its requests' TTFT; a wait for a slot lasts
    as long as other adapters' answers, so such a pick's TTFT is not predicted."""
    fleet, load = fleet_and_load(1)
    load.observed(0, 2, 0, 0.0, LoraInfo(2, ("a", "b")), BASE)
    view = fleet.load[0].lora
    assert view.waits_for_slot("c") and not view.waits_for_slot("a")
    assert not view.waits_for_slot(BASE)
    load.sent(0, 100, 0, "a")
    load.sent(0, 100, 0, "c")
    predicted = load.pace.open_predictions(0)
    assert predicted[0] is not None and predicted[0] > 0 and predicted[1] is None


def test_an_adapters_load_stalls_every_request_open_on_the_pod() -> None:
    """An adapter's load stalls the engine's whole step: the requests already open on
    the pod get their first tokens that much later, so their predictions move with it
    (else a pod that runs as modelled learns a pace above 1 from others' loads)."""
    _, load = fleet_and_load(1)
    load.observed(0, 0, 0, 0.0, LoraInfo(4, ("a",)), BASE)
    load.sent(0, 100, 0, "a")  # loaded: no stall
    load.sent(0, 100, 0, BASE)
    before = load.pace.open_predictions(0)
    load.sent(0, 100, 0, "b")  # a free slot: "b" is loaded, its step waits for it
    after = load.pace.open_predictions(0)
    stall = DEFAULT_LOAD_MS / load._model_speed_of(0)
    assert after[:2] == pytest.approx([ms + stall for ms in before])  # type: ignore[operator]
    assert after[2] is not None and after[2] > stall  # its own load, and its prefill
    load.sent(0, 100, 0, "b")  # loaded now: nothing stalls
    assert load.pace.open_predictions(0)[:3] == after


@pytest.mark.parametrize(
    ("lora_args", "ttft_model", "load_ms"),
    [({}, "vllm-cpu-tiny", 1.0), ({"load_ms": 20.0}, "vllm-cpu-tiny", 20.0)],
)
def test_the_stall_is_the_load_the_lora_scorer_prices(
    lora_args: dict[str, float], ttft_model: str, load_ms: float
) -> None:
    """One figure for an adapter's load: the ``lora`` scorer's, where the pipeline sets
    one, else the pods' TTFT model's; the pace's predictions move by what the pick was
    priced at (a constant there had the real-engine tier's pods, whose adapters load in
    about a millisecond, predicted 100 ms late on each load)."""
    scorers = [{"name": "prefill"}, {"name": "lora", "args": lora_args}]
    settings = parse_settings(
        {"salt_secret": "t", "ttft_model": ttft_model, "pipeline": {"scorers": scorers}},
        env={},
    )
    fleet = FleetState(sim_fleet(["127.0.0.1:9000"]))
    load = LoadAccounting(fleet, settings, clock=lambda: 0.0)
    load.observed(0, 0, 0, 0.0, LoraInfo(4, ()), BASE)
    load.sent(0, 100, 0, BASE)
    before = load.pace.open_predictions(0)[0]
    load.sent(0, 100, 0, "b")
    assert before is not None
    stall = load_ms / load._model_speed_of(0)
    assert load.pace.open_predictions(0)[0] == pytest.approx(before + stall)


def fleet_and_load(pods: int = 4) -> tuple[FleetState, LoadAccounting]:
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(pods)]))
    return fleet, LoadAccounting(fleet, Settings(), clock=lambda: 0.0)


def test_a_scrape_feeds_each_pods_adapters_and_picks_count_until_the_next() -> None:
    fleet, load = fleet_and_load()
    monitor = FleetMonitor(fleet, BlockIndex(1000), Settings(), load)
    monitor.apply(0, metrics_text.parse(VLLM_TEXT))
    view = fleet.load[0].lora
    assert (view.base, view.max_lora, view.reported) == (BASE, 4, {"sql-lora", "chat", "legal"})
    load.sent(0, 100, 0, "math")
    assert "math" in view.loaded and "math" in view.in_use
    assert view.reported == {"sql-lora", "chat", "legal"}  # what the engine said
    load.sent(1, 100, 0, "math")  # a pod that showed no LoRA: nothing to count
    assert not fleet.load[1].lora.loaded
    # An idle engine's gauge keeps its last sample: the idle counts say nothing runs,
    # but the pick the engine cannot show yet (its modelled TTFT and UNSEEN_MS).
    load.observed(0, 0, 0, 0.0, LoraInfo(4, ("chat",)), BASE)
    assert view.in_use == {"math"} and "chat" in view.loaded
    load.clock = lambda: 1.0
    load.observed(0, 0, 0, 0.0, LoraInfo(4, ("chat",)), BASE)
    assert not view.in_use and "chat" in view.loaded


def test_a_scrapes_adapters_are_believed_loaded_in_the_engines_order() -> None:
    """The least recently used of a scrape's adapters is the first the engine listed,
    whatever the order Python's per-process hash seed gives a set of them (the fleet
    simulation's figures moved between runs of one command when it did)."""
    view = Adapters()
    view.scraped(BASE, 3, ("c", "a", "b"))
    assert list(view.loaded) == ["c", "a", "b"]
    view.idle()
    view.picked("d")  # a fourth adapter evicts the least recently used idle one
    assert list(view.loaded) == ["a", "b", "d"]


def test_a_pod_showing_no_adapter_series_yet_has_its_siblings_slots() -> None:
    """vLLM samples vllm:lora_requests_info only after its first request, so a pod just
    added or restarted shows none. Until it does, it has the slots the other pods of its
    destination show, and the adapters of the picks sent to it (not none: every adapter
    would look free there); one that has answered and still shows none runs no LoRA."""
    fleet, load = fleet_and_load(3)
    load.observed(1, 0, 0, 0.0, None, BASE, (0.0, 0.0))
    assert fleet.load[1].lora.max_lora == 0  # no pod has shown any: nothing to assume
    load.observed(0, 1, 0, 0.1, LoraInfo(2, ("a",)), BASE)
    load.observed(1, 0, 0, 0.0, None, BASE, (0.0, 0.0))
    new = fleet.load[1].lora
    assert (new.base, new.max_lora, new.in_use, new.reported_slots) == (BASE, 2, set(), False)
    assert new.cost_ms("a", 100.0, 1000.0) == 100.0  # a free slot: a load
    load.sent(1, 100, 0, "a")
    load.sent(1, 100, 0, "b")
    assert new.in_use == {"a", "b"} and new.cost_ms("c", 100.0, 1000.0) == 1100.0
    load.observed(1, 0, 0, 0.0, None, BASE, (0.0, 0.0))  # the picks outlive a silent scrape
    assert new.in_use == {"a", "b"}
    load.observed(1, 2, 0, 0.1, LoraInfo(3, ("a", "b")), BASE, (0.0, 0.0))
    assert (new.max_lora, new.reported_slots) == (3, True)  # its own word from now on
    load.observed(1, 0, 0, 0.0, None, BASE, (0.0, 0.0))
    assert new.max_lora == 3
    # Answered requests and still no series: this pod runs no LoRA.
    load.observed(2, 0, 0, 0.0, None, BASE, (5.0, 0.2))
    assert fleet.load[2].lora.max_lora == 0 and not fleet.load[2].lora.is_adapter("a")


def test_a_pod_takes_no_slots_from_another_destination() -> None:
    lora = sim_fleet(["127.0.0.1:9000"], "lora")
    plain = sim_fleet(["127.0.0.1:9001"], "plain")
    fleet = FleetState(Fleet(lora.destinations + plain.destinations))
    load = LoadAccounting(fleet, Settings(), clock=lambda: 0.0)
    load.observed(0, 1, 0, 0.1, LoraInfo(4, ("a",)), BASE)
    load.observed(1, 0, 0, 0.0, None, BASE, (0.0, 0.0))
    assert fleet.load[1].lora.max_lora == 0


def test_an_answer_frees_its_adapter_once_no_pick_of_it_is_open() -> None:
    view = Adapters()
    view.scraped(BASE, 2, ())
    assert view.picked(BASE) == 0  # the base model: nothing to answer
    a1, a2, b = view.picked("a"), view.picked("a"), view.picked("b")
    assert len({a1, a2, b}) == 3 and 0 not in {a1, a2, b}
    assert view.waits_for_slot("c")  # both slots in use
    view.answered(a1)
    assert "a" in view.in_use  # its second request still runs
    view.answered(a2)
    assert view.in_use == {"b"} and not view.waits_for_slot("c")
    assert list(view.loaded) == ["a", "b"]  # still in its slot until another needs it
    view.answered(a2)  # an answer told twice, or another pod's: nothing more
    view.answered(12345)
    assert view.in_use == {"b"}


def test_an_answer_leaves_an_adapter_in_use_where_others_requests_use_it() -> None:
    """A scrape showed "a" in use while this router had no request for it (another
    replica's or gateway's): the answer to this router's own frees nothing."""
    view = Adapters()
    view.scraped(BASE, 2, ("a",))
    number = view.picked("a")
    view.answered(number)
    assert view.in_use == {"a"}
    # Showed in use again with this router's pick open: its answer frees it.
    number = view.picked("a")
    view.scraped(BASE, 2, ("a",))
    view.answered(number)
    assert not view.in_use


def test_a_scrape_keeps_the_picks_it_cannot_show_yet_and_settles_the_rest() -> None:
    """The engine's gauges show a request only once its API server has read it: a
    scrape before then keeps the pick's adapter in use. One after, showing the adapter
    unused, says it was answered: its late answer then frees nothing newer."""
    view = Adapters()
    view.scraped(BASE, 2, (), now=0.0)
    early = view.picked("a", seen_by=1.0)
    view.scraped(BASE, 2, (), now=0.5)  # too soon to show it
    assert view.in_use == {"a"} and view.open_picks["a"] == 1
    view.scraped(BASE, 2, (), now=1.5)  # could show it and does not: answered
    assert not view.in_use and not view.picks
    late = view.picked("a", seen_by=3.0)
    view.answered(early)  # the first request's answer, reported after the scrape
    assert view.in_use == {"a"}
    view.scraped(BASE, 2, ("a",), now=4.0)  # shown running: kept
    view.idle(now=4.5)  # the engine idle: every pick it could show was answered
    assert not view.in_use and not view.picks
    view.answered(late)
    assert not view.in_use
    # A pick whose answer never comes (no access log) is let go after OPEN_FOR_S.
    view.picked("b", seen_by=5.0)
    view.scraped(BASE, 2, ("b",), now=6.0)
    assert view.picks
    view.scraped(BASE, 2, ("b",), now=6.0 + OPEN_FOR_S)
    assert not view.picks and view.in_use == {"b"}  # the engine's word remains


def test_an_answer_reported_by_envoy_frees_the_adapter_on_the_pinned_pod() -> None:
    """The routing decision's metadata carries the pick's number; the access log's
    entry brings it back (observe.py)."""
    from ace_extproc.observe import Observation, Observer
    from ace_extproc.routing.outlier import OutlierDetector

    fleet, load = fleet_and_load(2)
    load.observed(1, 0, 0, 0.0, LoraInfo(2), BASE)
    number = load.sent(1, 100, 0, "a")
    assert number and load.sent(0, 100, 0, "a") == 0  # pod 0 runs no LoRA
    assert fleet.load[1].lora.in_use == {"a"}
    observer = Observer(fleet, OutlierDetector(fleet, Settings().passive_health))
    pod = fleet.pods[1].key
    observer.record(Observation("shadow", "hit", "", pod, status=200, lora_pick=number))
    assert fleet.load[1].lora.in_use == {"a"}  # not pinned: not this router's to free
    observer.record(Observation("prod", "hit", pod, pod, status=200, lora_pick=number))
    assert not fleet.load[1].lora.in_use


def test_the_scorer_is_zero_for_the_base_model_and_without_lora() -> None:
    fleet, load = fleet_and_load()
    load.observed(0, 1, 0, 0.1, LoraInfo(1, ("a",)), BASE)
    load.observed(1, 1, 0, 0.1, LoraInfo(1, ()), BASE)
    picker = policies.cost_policy(Settings())(fleet, BlockIndex(10_000))
    assert any(isinstance(w.scorer, LoraCost) for w in DEFAULT_SCORERS)

    def prices(model: str, scorer: LoraCost | None = None, ttft: str = "") -> list[float]:
        from ace_extproc.routing.pipeline import Candidates

        r = RoutingRequest(hash_prompt(PROMPT, None, 512, 1), PROMPT, 4096, "t", model)
        m = get_model(ttft) if ttft else picker.model
        c = Candidates(r, (0, 1, 2, 3), {}, fleet, picker.index, m, 32.0, 1, -1)
        return (scorer or LoraCost())(c)

    assert prices(BASE) == [0.0, 0.0, 0.0, 0.0]
    # Pods 2 and 3 run no LoRA: they cost nothing (they would refuse an adapter: the
    # fleet's configuration, not the price, keeps adapters off them).
    assert prices("a") == [0.0, DEFAULT_LOAD_MS, 0.0, 0.0]
    # Every slot of pod 0 busy: a decode's wait there, in the destination's model's steps
    # (1,980 ms on the default 70B model, 225 ms on the CPU pods' tiny one), and its load
    # (100 ms, 1 ms), unless set.
    busy = DECODE_STEPS * picker.model.t_step_ms
    assert busy == pytest.approx(1980.0)
    assert prices("b") == [DEFAULT_LOAD_MS + busy, DEFAULT_LOAD_MS, 0.0, 0.0]
    assert prices("b", ttft="vllm-cpu-tiny")[0] == pytest.approx(1.0 + 225.0)
    assert prices("b", LoraCost(busy_ms=500.0), "vllm-cpu-tiny")[0] == 1.0 + 500.0
    set_both = LoraCost(load_ms=20.0, busy_ms=500.0)
    assert prices("b", set_both, "vllm-cpu-tiny") == [520.0, 20.0, 0.0, 0.0]


def lora_fleet(pods: int, max_lora: int) -> tuple[FleetState, LoadAccounting, object]:
    fleet, load = fleet_and_load(pods)
    for slot in range(pods):
        load.observed(slot, 0, 0, 0.0, LoraInfo(max_lora), BASE)
    picker = policies.cost_policy(Settings())(fleet, BlockIndex(10_000))
    return fleet, load, picker


def pick(fleet: FleetState, load: LoadAccounting, picker: object, model: str, data: bytes):
    h = hash_prompt(data, None, 512, scope_seed("t", model))
    request = RoutingRequest(h, data, len(data) // 4, "t", model)
    chosen = picker.pick(request, fleet.available)  # type: ignore[attr-defined]
    assert chosen is not None
    load.sent(chosen.slot, 1 if chosen.matched_blocks else len(data) // 4, 0, model)
    return chosen


def test_two_adapters_prefixes_never_match() -> None:
    """Prefix keys are seeded by tenant and model: one adapter's blocks are not
    another's, as in vLLM (its block hashes include the adapter)."""
    assert scope_seed("t", "a") != scope_seed("t", "b") != scope_seed("t", BASE)
    a = hash_prompt(PROMPT, None, 512, scope_seed("t", "a")).blocks
    b = hash_prompt(PROMPT, None, 512, scope_seed("t", "b")).blocks
    assert len(a) == len(b) == 32 and not set(a) & set(b)
    fleet, load, picker = lora_fleet(4, 4)
    first = pick(fleet, load, picker, "a", PROMPT)
    assert first.action == "miss"
    again = pick(fleet, load, picker, "a", PROMPT)
    assert again.action == "hit" and again.slot == first.slot
    other = pick(fleet, load, picker, "b", PROMPT)  # the same text, another adapter
    assert other.action == "miss" and other.matched_blocks == 0


def test_a_new_adapter_goes_where_it_is_loaded_and_not_where_all_slots_are_busy() -> None:
    fleet, load, picker = lora_fleet(2, 1)
    first = pick(fleet, load, picker, "a", b"x" * 2048)
    other = 1 - first.slot
    # A new prompt for "a": its pod has it loaded, the other would load it first.
    assert pick(fleet, load, picker, "a", b"y" * 2048).slot == first.slot
    # "b" goes to the other pod: the first's only slot is in use by "a".
    assert pick(fleet, load, picker, "b", b"z" * 2048).slot == other
    # A queue on the pod of "a" shorter than the load keeps "a" there ...
    fleet.load[first.slot].queued_prefill_ms = DEFAULT_LOAD_MS / 2
    assert pick(fleet, load, picker, "a", b"w" * 2048).slot == first.slot


def test_a_hot_adapter_spreads_like_a_hot_prefix() -> None:
    """One adapter asked for again and again: its pod's queue grows with each pick
    until waiting there costs more than loading it elsewhere; then it spills, and the
    next pod holds it loaded too."""
    fleet, load, picker = lora_fleet(4, 2)
    slots = [pick(fleet, load, picker, "hot", bytes([i]) * 4096).slot for i in range(40)]
    first = slots[0]
    spill = next(i for i, s in enumerate(slots) if s != first)
    assert spill > 1  # it stayed on its pod while the queue cost less than a load
    assert fleet.load[first].queued_prefill_ms > 0
    assert len(set(slots)) == 4  # in the end every pod took a share
    assert all("hot" in fleet.load[s].lora.loaded for s in range(4))


def test_an_adapters_sessions_go_where_its_system_prompt_is_warm() -> None:
    """Sessions opening with the same system prompt: the base model's are placed by
    session (the session rule); an adapter's follow its prompt to the pod holding it and
    its slot, rather than taking a slot for it on every pod."""
    system = PROMPT[: 14 * 512]  # 14 of the 16 blocks of each first request

    def first_turns(model: str) -> Counter[int]:
        fleet, _, picker = lora_fleet(4, 4)
        where: Counter[int] = Counter()
        for i in range(16):
            data = system + bytes([i]) * 1024
            h = hash_prompt(data, None, 512, scope_seed("t", model))
            r = RoutingRequest(h, data, len(data) // 4, "t", model, f"s{i}")
            chosen = picker.pick(r, fleet.available)  # type: ignore[attr-defined]
            assert chosen is not None
            where[chosen.slot] += 1
        return where

    assert len(first_turns(BASE)) == 4  # spread by session
    assert list(first_turns("a").values()) == [16]  # all where the prompt is warm


def test_gie_s_lora_filter_keeps_pods_running_the_adapter_else_pods_with_a_free_slot() -> None:
    from bench.baselines.gie_lora import GIELoraPicker

    fleet, load = fleet_and_load(3)
    load.observed(0, 2, 0, 0.0, LoraInfo(2, ("a", "b")), BASE)  # a running, no slot free
    load.observed(1, 1, 0, 0.0, LoraInfo(2, ("c",)), BASE)  # one slot free
    load.observed(2, 2, 0, 0.0, LoraInfo(2, ("c", "d")), BASE)  # full
    gie = GIELoraPicker(fleet, BlockIndex(1000))
    every = 0b111

    def request(model: str) -> RoutingRequest:
        return RoutingRequest(hash_prompt(PROMPT, None, 512, scope_seed("t", model)), PROMPT,
                              4096, "t", model)  # fmt: skip

    # "a": pod 0 runs it (affinity) almost always; the free slot of pod 1 otherwise.
    kept = Counter(gie.lora_filter(request("a"), every) for _ in range(2000))
    assert kept[0b001] > 1900 and set(kept) <= {0b001, 0b010}
    assert gie.lora_filter(request("e"), every) == 0b010  # nobody runs it: a free slot
    assert gie.lora_filter(request("e"), 0b101) == 0  # none: no filter, all stay
    assert gie.pick(request("e"), 0b101) is not None
    # A pod that has shown no sample yet has no slots to GIE (ours assumes its
    # siblings'): neither affinity nor available, as pod 1 now is.
    fleet, load = fleet_and_load(2)
    load.observed(0, 2, 0, 0.0, LoraInfo(2, ("a", "b")), BASE)
    load.observed(1, 0, 0, 0.0, None, BASE, (0.0, 0.0))
    assert fleet.load[1].lora.max_lora == 2
    assert GIELoraPicker(fleet, BlockIndex(1000)).lora_filter(request("e"), 0b11) == 0


def test_an_adapters_state_names_what_a_request_for_it_needs_there() -> None:
    """The trace's ``adapter=``: loaded, a slot to load it into, or a wait for one."""
    view = Adapters()
    assert view.state("a") == ""  # no LoRA here (or not scraped yet)
    view.scraped(BASE, 2, ("a", "b"))
    assert (view.state(BASE), view.state("a"), view.state("c")) == ("", "loaded", "wait")
    assert (view.busy_slots("a"), view.busy_slots("c")) == ("1/2", "2/2")
    view.idle()
    assert view.state("c") == "load"  # an idle adapter's slot to take
    assert view.busy_slots("c") == "0/2"


def test_the_open_picks_count_stays_that_of_the_picks_open() -> None:
    """``open_picks``, kept as picks open and close (the request path reads it for each
    pod whose slots are full), is always the count of ``picks``, whichever way they
    close: answered, settled by a scrape, or let go after ``OPEN_FOR_S``."""

    rng = random.Random(7)
    view = Adapters()
    view.scraped(BASE, 3, ())
    numbers: list[int] = []
    now = 0.0
    for _ in range(2_000):
        now += rng.random()
        op = rng.random()
        if op < 0.5:
            numbers.append(view.picked(rng.choice("abcdef"), now + rng.random() * 3))
        elif op < 0.8 and numbers:
            view.answered(numbers.pop(rng.randrange(len(numbers))))
        elif op < 0.95:
            shown = rng.sample("abcdef", rng.randrange(4))
            view.scraped(BASE, 3, shown, now, deferred=rng.randrange(3))
        else:
            view.idle(now + rng.choice((0.0, OPEN_FOR_S * 2)))
        assert view.open_picks == Counter(m for m, _, _ in view.picks.values())
        assert all(count > 0 for count in view.open_picks.values())
