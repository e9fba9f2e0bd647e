"""The fleet simulation with KV events: pods publish BlockStored/BlockRemoved to the
router's precise index (``SimSettings.kv_events``), delivered ``event_delay_s`` later
in simulated time, and the production ``Processor`` keys requests token-exact."""

from __future__ import annotations

import json
from dataclasses import replace

from bench import workloads
from bench.baselines import resolve
from bench.fleetsim import RunResult, SimSettings, simulate, summarize
from bench.precise_sim import VARIANTS, figures, with_clears
from bench.workloads.base import Request, Workload

APPROXIMATE = SimSettings()
PRECISE = SimSettings(kv_events=True, speculate=False)
SPECULATIVE = SimSettings(kv_events=True, speculate=True)


def run(workload: Workload, settings: SimSettings, pods: int) -> RunResult:
    return simulate(workload, resolve("ace"), pods=pods, settings=settings, progress=False)


def saved(result: RunResult) -> float:
    return float(summarize(result)["prefill_saved_ratio"])


def chat(at: float, messages: list[dict[str, str]], session: str) -> Request:
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 20}).encode()
    return Request(at, "/v1/chat/completions", body, 20, "chat", session)


def conversations(n: int = 6, turns: int = 4, gap_s: float = 0.3) -> Workload:
    """``n`` conversations with a long system prompt each, a turn every ``gap_s``."""
    requests = []
    for c in range(n):
        messages = [{"role": "system", "content": f"conversation {c} " + f"x{c} " * 2000}]
        for t in range(turns):
            messages = [*messages, {"role": "user", "content": f"question {t} " + "q" * 400}]
            requests.append(chat(c * 0.05 + t * gap_s, list(messages), f"s{c}"))
            messages = [*messages, {"role": "assistant", "content": "a" * 300}]
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("conversations", "", requests)


def test_the_pods_events_reach_the_precise_index() -> None:
    result = run(conversations(), replace(PRECISE, event_delay_s=0.0), pods=4)
    extra = result.extra
    assert extra["precise_views"] == len(result.records) and extra["precise_unkeyed"] == 0
    assert extra["blocks_stored"] > 0 and extra["blocks_orphaned"] == 0
    assert extra["kv_events_delivered"] > 0


def test_under_kv_pressure_precise_saves_more_than_approximate() -> None:
    # A slice of the suite on 4 pods of 1,024 blocks (16K tokens): engines evict, and
    # what they hold is no longer where the router sent things.
    workload = workloads.get("seed800", limit=200)
    tight = SimSettings(num_gpu_blocks=1024)
    approximate = run(workload, tight, pods=4)
    assert sum(approximate.evictions) > 0
    approx = saved(approximate)
    # With speculation (the default): without it, picks made before their events arrive
    # are invisible to the next, and on this overloaded slice that costs more than the
    # events win (bench/RESULTS.md, "Precise routing").
    assert saved(run(workload, replace(tight, kv_events=True, speculate=True), pods=4)) > approx


def test_event_delay_changes_what_precise_finds_on_back_to_back_turns() -> None:
    workload = conversations(gap_s=0.3)  # the next turn 300 ms after the last
    prompt = replace(PRECISE, event_delay_s=0.0)
    late = replace(PRECISE, event_delay_s=0.5)  # the events arrive after the next turn
    on_time = saved(run(workload, prompt, pods=4))
    assert saved(run(workload, late, pods=4)) < on_time
    # Speculation covers the gap: a pick counts as held until the events say.
    assert saved(run(workload, replace(SPECULATIVE, event_delay_s=0.5), pods=4)) == on_time
    # And with no KV pressure the approximate index already knows as much.
    assert saved(run(workload, APPROXIMATE, pods=4)) == on_time


def test_deterministic_across_runs() -> None:
    workload = workloads.get("seed800", limit=120)
    settings = SimSettings(num_gpu_blocks=1024, kv_events=True, event_delay_s=0.05)
    a, b = run(workload, settings, pods=4), run(workload, settings, pods=4)
    key = [(r.arrival_s, r.pod, r.cached_tokens, r.ttft_s) for r in a.records]
    assert key == [(r.arrival_s, r.pod, r.cached_tokens, r.ttft_s) for r in b.records]
    assert {k: v for k, v in figures(a).items() if k != "wall_s"} == {
        k: v for k, v in figures(b).items() if k != "wall_s"
    }


def test_the_report_runs_every_variant() -> None:
    assert set(VARIANTS) >= {"approximate", "precise@50ms", "precise+spec@500ms"}
    assert not VARIANTS["approximate"]


def test_a_cache_cleared_unannounced_misleads_the_guess_not_the_events() -> None:
    """A pod that loses its cache (a restart) without the router being told: the
    approximate index still counts on what it sent there, the events say it is gone."""
    plain = conversations(n=4, turns=4, gap_s=2.0)
    cleared = with_clears(plain, pods=2, every_s=3.0)  # pod 0 at 3 s, pod 1 at 6 s
    assert [(e.at_s, e.action, e.slot) for e in cleared.events] == [
        (3.0, "clear", 0),
        (6.0, "clear", 1),
    ]

    def error(workload: Workload, settings: SimSettings) -> float:
        """|the router's estimate of each request's cached tokens - the engine's|, over
        the prompt tokens."""
        return float(figures(run(workload, settings, pods=2))["estimate_error"])

    spec = replace(SPECULATIVE, event_delay_s=0.0)
    # Without a clear both are off by the partial blocks each counts its own way only.
    assert error(plain, APPROXIMATE) < 0.05 and error(plain, spec) < 0.05
    # With them the guess promised turns a history the pods had lost; the events did not.
    assert error(cleared, APPROXIMATE) > 0.2
    assert error(cleared, spec) < 0.05
