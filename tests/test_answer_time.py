"""Each pod's answer time, learned from the engine's request-latency histogram
(routing/answer_time.py), read from vLLM's and SGLang's /metrics and used to price a
wait for a LoRA adapter's slot."""

from __future__ import annotations

import pytest

from ace_extproc.config import Settings, sim_fleet
from ace_extproc.routing import FleetState, metrics_text
from ace_extproc.routing.answer_time import WEIGHT_N, AnswerTimes
from ace_extproc.routing.load import LoadAccounting


def test_the_answer_time_moves_toward_each_windows_mean() -> None:
    times = AnswerTimes()
    assert times.observed(0, 10, 20.0, None) is None  # the first scrape: counters only
    assert times.observed(0, 10, 20.0, None) is None  # nothing answered since
    learned = times.observed(0, 14, 32.0, None)  # 4 answers of 3 s: the first mean taken
    assert learned == pytest.approx(3000.0)
    # 16 more of 1 s: half way at most, n / (n + WEIGHT_N) of it.
    moved = times.observed(0, 30, 48.0, learned)
    assert moved == pytest.approx(3000.0 - 16 / (16 + WEIGHT_N) * 2000.0)
    many = times.observed(0, 1030, 1048.0, moved)  # a thousand of 1 s: half way
    assert many == pytest.approx(moved - 0.5 * (moved - 1000.0))
    # An engine restart (counters back to 0) keeps what was learned and starts counting.
    assert times.observed(0, 2, 50.0, many) == many
    after = times.observed(0, 3, 60.0, many)  # one answer of 10 s
    assert after == pytest.approx(many + 1 / (1 + WEIGHT_N) * (10_000.0 - many))
    # A new process in the slot: its first scrape teaches nothing.
    times.forget(0)
    assert times.observed(0, 500, 900.0, None) is None


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engines_request_latency_histogram_is_read(engine: str) -> None:
    text = (
        f"# TYPE {engine}:e2e_request_latency_seconds histogram\n"
        f'{engine}:e2e_request_latency_seconds_bucket{{le="1.0",model_name="m"}} 2.0\n'
        f'{engine}:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="m"}} 5.0\n'
        f'{engine}:e2e_request_latency_seconds_count{{model_name="m"}} 5.0\n'
        f'{engine}:e2e_request_latency_seconds_sum{{model_name="m"}} 12.5\n'
    )
    assert metrics_text.parse(text).answer_counters == (5.0, 12.5)
    assert metrics_text.parse(text.replace("_sum", "_other")).answer_counters is None


def test_scrapes_teach_each_pod_its_own_answer_time() -> None:
    fleet = FleetState(sim_fleet(["127.0.0.1:9000", "127.0.0.1:9001"]))
    load = LoadAccounting(fleet, Settings(), clock=lambda: 0.0)
    for slot, seconds in ((0, 2.0), (1, 8.0)):
        load.observed(slot, 1, 0, 0.1, answers=(0.0, 0.0))
        load.observed(slot, 1, 0, 0.1, answers=(10.0, 10 * seconds))
    assert fleet.load[0].answer_ms == pytest.approx(2000.0)
    assert fleet.load[1].answer_ms == pytest.approx(8000.0)
    load.observed(0, 1, 0, 0.1)  # a scrape without the histogram: kept
    assert fleet.load[0].answer_ms == pytest.approx(2000.0)
