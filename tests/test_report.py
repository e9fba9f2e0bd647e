"""bench.report end to end on a small slice: the JSON other tools read, and the plots."""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench import report


def suite_report(out: Path, requests: int, policies: str) -> dict[str, Any]:
    """``bench.report`` on the suite's first requests, 4 pods: the JSON it wrote."""
    args = ["--suite", "seed800", "--limit", str(requests), "--pods", "4", "--no-progress"]
    assert report.main([*args, "--policies", policies, "--out", str(out)]) == 0
    data: dict[str, Any] = json.loads((out / "report-seed800-4pods.json").read_text())
    return data


def test_report_json_shape_and_plots(tmp_path: Path, capsys) -> None:
    data = suite_report(tmp_path, 60, "ace,round_robin,bound_pooled,bound_unbounded")
    assert data["workload"] == "seed800" and data["pods"] == 4 and data["requests"] == 60
    assert set(data["policies"]) == {"ace", "round_robin", "bound_pooled", "bound_unbounded"}
    for p in data["policies"].values():
        for key in ("hit_ratio", "prefill_saved_ratio", "ttft_p50_ms", "ttft_p95_ms",
                    "ttft_p99_ms", "imbalance"):  # fmt: skip
            assert isinstance(p[key], float)
        assert 0.0 <= p["prefill_saved_ratio"] <= 1.0
        assert p["hits"] + p["misses"] == 60
    # Unbounded caches can only reuse as much as or more than the same policy bounded.
    pol = data["policies"]
    assert pol["bound_unbounded"]["cached_tokens"] >= pol["ace"]["cached_tokens"]
    # The engines' compute: the prefill a router saves is compute no pod spends.
    assert pol["ace"]["cached_tokens"] > pol["round_robin"]["cached_tokens"]
    assert 0 < pol["ace"]["compute_s"] < pol["round_robin"]["compute_s"]
    assert all(Path(p).stat().st_size > 1000 for p in data["plots"])
    out = capsys.readouterr().out
    assert "Total prompts:" in out and "Saved prefill tokens:" in out and "TTFT speedup" in out


def test_report_simulates_the_real_engine_tiers_pods(tmp_path: Path) -> None:
    """``--engines cpu-vllm``: the pods of ``bench.live --engine vllm`` (their blocks, KV,
    calibrated TTFT model), written beside the default fleet's report, not over it."""
    from ace_extproc import vllm_pods

    args = ["--workload", "lora-mix", "--limit", "40", "--pods", "2", "--no-progress"]
    assert (
        report.main([*args, "--engines", "cpu-vllm", "--policies", "ace", "--out", str(tmp_path)])
        == 0
    )
    data = json.loads((tmp_path / "report-lora-mix-2pods-cpu-vllm.json").read_text())
    settings = data["settings"]
    assert settings["block_size"] == vllm_pods.BLOCK_SIZE
    assert settings["num_gpu_blocks"] == vllm_pods.DEFAULT_KV_BLOCKS
    assert settings["ttft_model"] == vllm_pods.TTFT_MODEL
    assert settings["max_loras"] == 4  # the workload's --max-loras still applies
    assert report.main([*args, "--policies", "ace", "--out", str(tmp_path)]) == 0
    default = json.loads((tmp_path / "report-lora-mix-2pods.json").read_text())
    assert default["settings"]["block_size"] == 16
    # Another engine, other timings: the prediction is the CPU pods' own.
    assert data["policies"]["ace"]["ttft_p50_ms"] != default["policies"]["ace"]["ttft_p50_ms"]


def test_report_rejects_unknown_policy_and_bad_trace(tmp_path: Path) -> None:
    assert report.main(["--suite", "seed800", "--policies", "nope", "--out", str(tmp_path)]) == 2
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}\n')
    assert report.main(["--trace", str(bad), "--out", str(tmp_path)]) == 2
    # churn removes and adds pod slots up to 7: 4 pods cannot replay it
    assert report.main(["--workload", "churn", "--pods", "4", "--out", str(tmp_path)]) == 2


def test_seeds_runs_every_policy_on_each_seeds_workload(tmp_path: Path) -> None:
    from bench import seeds

    out = tmp_path / "seeds.json"
    code = seeds.main(
        ["--workload", "seed800", "--seeds", "0,1", "--limit", "40", "--pods", "4",
         "--policies", "ace,round_robin", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert data["seeds"] == [0, 1] and data["pods"] == 4
    ace, rr = data["policies"]["ace"], data["policies"]["round_robin"]
    assert [r["seed"] for r in ace] == [0, 1]
    # Each seed is its own workload: the figures differ between seeds.
    assert ace[0]["prefill_saved_ratio"] != ace[1]["prefill_saved_ratio"]
    # Same requests per seed for every policy: prefix routing saves more than round-robin.
    assert all(
        a["prefill_saved_ratio"] > r["prefill_saved_ratio"] for a, r in zip(ace, rr, strict=True)
    )
    assert seeds.main(["--workload", "churn", "--pods", "4", "--out", str(out)]) == 2


def test_policy_spec_builds_ours_with_those_router_settings() -> None:
    from ace_extproc.config import default_fleet
    from ace_extproc.routing import BlockIndex, FleetState, PrefixAffinityPicker
    from ace_extproc.routing.lora import LoraCost
    from ace_extproc.routing.pipeline import NearBest, Pipeline
    from bench.baselines import POLICIES, resolve

    def build(spec: str) -> object:
        return resolve(spec)(FleetState(default_fleet(4)), BlockIndex(1000))

    assert resolve("ace") is POLICIES["ace"]
    tuned = build("ace@min_match=0.3@place_sessions=false")
    assert isinstance(tuned, Pipeline)
    assert tuned.min_match == 0.3 and tuned.place_sessions is False
    assert isinstance(tuned.picker, NearBest) and not tuned.picker.balance_new
    default = build("ace")
    assert isinstance(default, Pipeline) and default.min_match == 0.1 and default.place_sessions
    balanced = build("ace@policy=cost-balanced")
    assert isinstance(balanced, Pipeline) and isinstance(balanced.picker, NearBest)
    assert balanced.picker.balance_new
    assert isinstance(build("ace@policy=affinity"), PrefixAffinityPicker)
    assert isinstance(build("ace@min_match=0"), Pipeline)  # YAML's int, as fleet.yaml takes it
    wide = build("ace@affinity_slack=0.5@affinity_slack_ms=20")
    assert isinstance(wide, Pipeline) and isinstance(wide.picker, NearBest)
    assert wide.picker.slack_ratio == 0.5 and wide.picker.slack_ms == 20.0
    assert isinstance(default, Pipeline) and isinstance(default.picker, NearBest)
    assert default.picker.slack_ratio == 0.1
    # lora_busy_ms: the default scorers, the lora one's busy_ms set (router.pipeline).
    waits = build("ace@lora_busy_ms=500@min_match=0.2")
    assert isinstance(waits, Pipeline) and waits.min_match == 0.2
    assert [type(w.scorer) for w in waits.scorers] == [type(w.scorer) for w in default.scorers]
    assert waits.scorers[-1].scorer == LoraCost(busy_ms=500.0)
    assert default.scorers[-1].scorer == LoraCost()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown policy 'nope'"),
        ("round_robin@min_match=0.1", "unknown policy"),
        ("ace@", "expected setting=value"),
        ("ace@min_match", "expected setting=value"),
        ("ace@block_bytes=64", "'block_bytes' is not a setting the pick reads"),
        ("ace@min_match=2", "router.min_match: expected a number <= 1.0, got 2"),
        ("ace@place_sessions=maybe", "router.place_sessions: expected true or false"),
        ("ace@policy=nope", "router.policy: unknown policy 'nope'"),
        ("ace@min_match=0.1@min_match=0.2", "min_match given twice"),
        ("ace@min_match=[1", "cannot read '[1'"),
        ("ace@lora_busy_ms=-1", "busy_ms must not be negative"),
    ],
)
def test_policy_spec_errors_say_what_is_wrong(spec: str, message: str, tmp_path: Path) -> None:
    from bench.baselines import resolve

    with pytest.raises(ValueError, match=re.escape(message)) as err:
        resolve(spec)
    if spec.startswith("ace@"):
        assert str(err.value).startswith(f"{spec}: ")  # which of several policies
    # Before any simulation: the report and the seeds runner refuse it at once.
    args = ["--suite", "seed800", "--policies", f"ace,{spec}", "--out", str(tmp_path)]
    assert report.main(args) == 2
    from bench import seeds

    with pytest.raises(SystemExit) as exit_:
        seeds.main(["--workload", "seed800", "--policies", spec, "--out", str(tmp_path / "s.json")])
    assert exit_.value.code == 2


def test_report_runs_a_policy_spec_as_the_policy_it_names(tmp_path: Path) -> None:
    """``ace@policy=affinity`` is the first version, figure for figure, and not the default:
    the settings reach the picker the simulation runs."""
    specs = "ace,ace_affinity,ace@policy=affinity,ace@min_match=0.1"
    pol = suite_report(tmp_path, 80, specs)["policies"]

    def figures(policy: str) -> list[float]:
        return [pol[policy][f] for f in ("cached_tokens", "hits", "ttft_p99_ms", "evictions")]

    assert figures("ace@policy=affinity") == figures("ace_affinity")
    assert figures("ace@min_match=0.1") == figures("ace")
    assert figures("ace") != figures("ace_affinity")
