"""bench.report end to end on a small slice: the JSON other tools read, and the plots."""

import json
from pathlib import Path

from bench import report


def test_report_json_shape_and_plots(tmp_path: Path, capsys) -> None:
    code = report.main(
        [
            "--suite", "seed800", "--limit", "60", "--pods", "4", "--no-progress",
            "--policies", "ace,round_robin,bound_pooled,bound_unbounded",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "report-seed800-4pods.json").read_text())
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
    assert all(Path(p).stat().st_size > 1000 for p in data["plots"])
    out = capsys.readouterr().out
    assert "Total prompts:" in out and "Saved prefill tokens:" in out and "TTFT speedup" in out


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
