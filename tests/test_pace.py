"""Each pod's pace, learned from the TTFT its engine reports (``routing/pace.py``):
the learner alone, the load accounting and prices that use it, the scrape that feeds
it, and the fleet simulation's pods slower than their model."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from ace_extproc.config import Settings, sim_fleet
from ace_extproc.routing import BlockIndex, FleetState
from ace_extproc.routing.load import LoadAccounting
from ace_extproc.routing.metrics_text import EngineStats, parse
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.routing.pace import (
    BAND,
    EXPIRE_S,
    MAX_PACE,
    MIN_PACE,
    WEIGHT_N,
    PaceLearner,
    priced,
)
from ace_extproc.telemetry import Telemetry
from bench import workloads
from bench.baselines import resolve
from bench.fleetsim import SimSettings, simulate


def _learn(true_pace: float, windows: int, per_window: int = 8) -> float:
    """Each window ``per_window`` requests are predicted at 100 ms each by the model and
    the engine reports them at ``true_pace`` times that; the pace learned."""
    learner = PaceLearner()
    count, total = 0.0, 0.0
    now = 0.0
    pace = learner.observed(0, now, count, total, idle=False)  # the baseline
    for _ in range(windows):
        for _ in range(per_window):
            learner.predicted(0, now, 100.0)
        now += 1.0
        count += per_window
        total += per_window * 0.1 * true_pace
        pace = learner.observed(0, now, count, total, idle=False)
    return pace


def test_the_pace_settles_on_how_much_slower_the_pod_runs() -> None:
    for true in (3.0, 0.5, 1.1):
        assert _learn(true, windows=40) == pytest.approx(true, rel=0.02)


def test_one_window_moves_the_pace_part_of_the_way_and_a_small_one_less() -> None:
    """One request's TTFT is noisy: a window of one moves the pace less than a window of
    many, and neither jumps all the way (it settles over several scrapes)."""
    one, many = _learn(3.0, windows=1, per_window=1), _learn(3.0, windows=1, per_window=32)
    assert 1.0 < one < many < 3.0


def test_the_pace_stays_within_its_bounds() -> None:
    assert _learn(1000.0, windows=100) == MAX_PACE
    assert _learn(0.0001, windows=100) == MIN_PACE


def test_routing_prices_a_pace_within_the_models_own_error_as_the_model() -> None:
    assert [priced(p) for p in (1.0, 1.4, 0.7, 1.6, 0.6, 3.0)] == [1.0, 1.0, 1.0, 1.6, 0.6, 3.0]
    assert priced(BAND) == BAND and priced(1 / BAND) == 1 / BAND


def test_the_first_scrape_and_a_restart_teach_nothing() -> None:
    learner = PaceLearner()
    learner.predicted(0, 0.0, 100.0)
    # The first scrape: counters since the engine started, not since the prediction.
    assert learner.observed(0, 1.0, 500.0, 900.0, idle=False) == 1.0
    learner.predicted(0, 1.0, 100.0)
    # A restart: the counters went back; what was open was for the old process.
    assert learner.observed(0, 2.0, 3.0, 2.0, idle=False) == 1.0
    assert learner.observed(0, 3.0, 4.0, 2.5, idle=False) == 1.0  # nothing open
    # Nothing was learned: the next window moves the pace from 1 by one window's step.
    learner.predicted(0, 3.0, 100.0)
    moved = learner.observed(0, 4.0, 5.0, 2.8, idle=False)  # 300 ms against 100
    assert moved == pytest.approx(math.exp(math.log(3.0) / (1 + WEIGHT_N)))


def test_predictions_never_answered_expire() -> None:
    """A rejected or cancelled request has no first token: its prediction must not be
    matched with a later request's (a 10 s prediction against a 100 ms answer)."""
    learner = PaceLearner()
    learner.observed(0, 0.0, 0.0, 0.0, idle=False)
    learner.predicted(0, 0.0, 10_000.0)  # never answered
    now = EXPIRE_S + 1.0
    learner.predicted(0, now, 100.0)
    pace = learner.observed(0, now + 0.5, 1.0, 0.1, idle=False)
    assert pace == 1.0  # matched with its own prediction: as modelled


def test_an_idle_pod_keeps_only_the_predictions_just_sent() -> None:
    learner = PaceLearner()
    learner.observed(0, 0.0, 0.0, 0.0, idle=False)
    learner.predicted(0, 0.0, 100.0)  # ended without a first token (an error)
    learner.observed(0, 5.0, 0.0, 0.0, idle=True)  # nothing there: it is gone
    learner.predicted(0, 5.0, 100.0)
    assert learner.observed(0, 5.5, 1.0, 0.1, idle=False) == 1.0


def test_a_window_with_a_wait_the_model_cannot_see_teaches_nothing() -> None:
    """A request that waited for a LoRA adapter's slot waited as long as another
    adapter's answers took, not at the pod's pace: its window is matched (the next one
    lines up) and passed over."""
    learner = PaceLearner()
    learner.observed(0, 0.0, 0.0, 0.0, idle=False)
    learner.predicted(0, 0.0, 100.0)
    learner.predicted(0, 0.0, None)  # waited for a slot: 3 s, say
    assert learner.observed(0, 1.0, 2.0, 3.1, idle=False) == 1.0
    learner.predicted(0, 1.0, 100.0)  # the next window is its own: 300 ms against 100
    moved = learner.observed(0, 2.0, 3.0, 3.4, idle=False)
    assert moved == pytest.approx(math.exp(math.log(3.0) / (1 + WEIGHT_N)))


def test_a_stall_moves_the_open_predictions_and_teaches_no_pace() -> None:
    """A LoRA adapter's load stalls the engine's step: the requests open on the pod get
    their first tokens that much later. A pod that runs as its model says, stalls
    included, keeps a pace of 1; told of no stall, the learner takes them for a slow pod."""
    for told in (True, False):
        learner = PaceLearner()
        learner.observed(0, 0.0, 0.0, 0.0, idle=False)
        learner.predicted(0, 0.0, None)  # a wait the model cannot see: a stall leaves it
        learner.stalled(0, 50.0)
        assert learner.observed(0, 0.5, 1.0, 3.0, idle=False) == 1.0
        count, total_s = 1.0, 3.0
        for window in range(20):
            learner.predicted(0, window, 100.0)
            learner.predicted(0, window, 100.0)
            if told:
                learner.stalled(0, 50.0)  # both first tokens come at 150 ms
            count, total_s = count + 2, total_s + 0.3
            pace = learner.observed(0, window + 1.0, count, total_s, idle=False)
        assert pace == pytest.approx(1.0) if told else pace > 1.4


def test_learning_off_keeps_every_pod_at_its_model() -> None:
    learner = PaceLearner(enabled=False)
    learner.observed(0, 0.0, 0.0, 0.0, idle=False)
    learner.predicted(0, 0.0, 100.0)
    assert learner.observed(0, 1.0, 1.0, 5.0, idle=False) == 1.0


def test_the_scrape_reads_the_ttft_histogram_of_vllm_and_sglang() -> None:
    vllm = (
        'vllm:num_requests_running{model_name="m",engine="0"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="0.1"} 2\n'
        'vllm:time_to_first_token_seconds_count{model_name="m",engine="0"} 7\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m",engine="0"} 3.5\n'
        'vllm:time_to_first_token_seconds_count{model_name="m",engine="1"} 3\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m",engine="1"} 1.5\n'
    )
    assert parse(vllm).ttft_counters == (10.0, 5.0)  # data-parallel engines summed
    sglang = (
        "sglang:num_running_reqs 2\n"
        "sglang:time_to_first_token_seconds_sum 4.25\n"
        "sglang:time_to_first_token_seconds_count 5\n"
    )
    assert parse(sglang).ttft_counters == (5.0, 4.25)
    assert parse("vllm:num_requests_running 1\n").ttft_counters is None  # no histogram
    half = "vllm:num_requests_running 1\nvllm:time_to_first_token_seconds_count 4\n"
    assert parse(half).ttft_counters is None  # a count without its sum teaches nothing


def test_a_slow_pod_learned_from_its_scrapes_drains_slower() -> None:
    """Two pods, each sent the same requests; the engine of pod 0 reports first tokens
    3x later than the model says. Over the scrapes its pace nears 3 and pod 1's stays
    near 1: pod 0's queued prefill drains a third as fast. The pace is exported."""
    settings = Settings(ttft_model="vllm-cpu-tiny")
    fleet = FleetState(sim_fleet(["127.0.0.1:1", "127.0.0.1:2"]))
    now = [0.0]
    load = LoadAccounting(fleet, settings, clock=lambda: now[0])
    monitor = FleetMonitor(fleet, BlockIndex(100), settings, load)
    model = load.model_of(0)
    counts = [[0.0, 0.0], [0.0, 0.0]]
    for slot in (0, 1):
        monitor.apply(slot, _stats(0, counts[slot]))
    for _ in range(80):  # one request a scrape: each moves the pace a little
        for slot, slower in ((0, 3.0), (1, 1.0)):
            load.sent(slot, 2000)
            counts[slot][0] += 1
            counts[slot][1] += slower * model.ttft_ms(2000) / 1000  # its own pace
        now[0] += 1.0
        for slot in (0, 1):
            monitor.apply(slot, _stats(0, counts[slot]))
    slow, fast = fleet.load[0].pace, fleet.load[1].pace
    assert math.isclose(slow, 3.0, rel_tol=0.05) and math.isclose(fast, 1.0, rel_tol=0.05)
    # The same queue on each: pod 0's drains at a third of the pace, and costs more.
    load.drain()
    for slot in (0, 1):
        monitor.apply(slot, _stats(1, counts[slot]))
        fleet.load[slot].queued_prefill_ms = 300.0
    now[0] += 0.1
    load.drain()
    left = [fleet.load[slot].queued_prefill_ms for slot in (0, 1)]
    assert left[0] > left[1] and math.isclose(300.0 - left[0], (300.0 - left[1]) / slow)
    telemetry = Telemetry(settings, fleet, BlockIndex(100), monitor, process_metrics=False)
    text = generate_latest(telemetry.registry).decode()
    pod = fleet.pods[0]
    series = f'ace_pod_prefill_pace{{destination="{pod.destination}",pod="{pod.id}"}}'
    assert f"{series} {slow}" in text


def test_learn_pace_off_keeps_the_model_however_slow_the_pod() -> None:
    settings = Settings(ttft_model="vllm-cpu-tiny", learn_pace=False)
    fleet = FleetState(sim_fleet(["127.0.0.1:1"]))
    now = [0.0]
    load = LoadAccounting(fleet, settings, clock=lambda: now[0])
    monitor = FleetMonitor(fleet, BlockIndex(100), settings, load)
    monitor.apply(0, _stats(0, [0.0, 0.0]))
    for i in range(1, 10):
        load.sent(0, 2000)
        now[0] += 1.0
        monitor.apply(0, _stats(0, [float(i), 10.0 * i]))
    assert fleet.load[0].pace == 1.0


def test_a_pod_slower_than_its_model_gets_less_work_once_its_pace_is_learned() -> None:
    """The fleet simulation, every other pod 3x slower than the TTFT model the router
    prices them by: the paces learned tell the slow pods from the others, and the slow
    pods get fewer requests than with the pace fixed at the model's."""
    workload = workloads.get("seed800", limit=400)
    slow = (1.0, 3.0)
    share = {}
    for learn in (False, True):
        settings = SimSettings(pod_slowdown=slow, learn_pace=learn)
        result = simulate(workload, resolve("ace"), pods=4, settings=settings, progress=False)
        on_slow = sum(1 for r in result.records if r.pod % 2 == 1)
        share[learn] = on_slow / len(result.records)
        paces = result.extra["pace"]
        if learn:
            assert min(paces[1], paces[3]) > 2.0 and max(paces[0], paces[2]) < 1.5
        else:
            assert paces == [1.0] * 4
    assert share[True] < share[False]


def _stats(running: int, counts: list[float]) -> EngineStats:
    return EngineStats(
        engine="vllm",
        running=running,
        waiting=0,
        kv_usage=0.1,
        first_tokens=counts[0],
        first_token_s=counts[1],
    )
