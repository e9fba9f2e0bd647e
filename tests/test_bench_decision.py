"""Smoke test of ``python -m bench.decision``: every size and step, with tiny numbers."""

from __future__ import annotations

import json
from pathlib import Path

from bench import decision


def test_every_size_and_step_gets_numbers(tmp_path: Path) -> None:
    out = tmp_path / "decision.json"
    assert decision.main(["--iterations", "16", "--no-compare", "--out", str(out)]) == 0

    result = json.loads(out.read_text())
    assert [row["tokens"] for row in result["sizes"]] == list(decision.SIZES)
    for row in result["sizes"]:
        # ~4 bytes a token, hashed in 512-byte blocks.
        assert abs(row["blocks"] - row["tokens"] * 4 / 512) <= 0.1 * row["tokens"] * 4 / 512
        steps = row["steps_us"]
        assert set(steps) == {"parse", "hash", "pick", "rewrite", "total"}
        # The whole decision in each upstream mode, side by side.
        assert set(row["total_by_mode_p50_us"]) == {"cluster", "endpoint"}
        assert all(us > 0 for us in row["total_by_mode_p50_us"].values())
        for step in steps.values():
            assert 0 < step["p50"] <= step["p99"]
        parts = sum(steps[n]["p50"] for n in ("parse", "hash", "pick", "rewrite"))
        assert abs(row["other_p50_us"] - (steps["total"]["p50"] - parts)) < 0.05
        # The table's premise: the timed requests were warm hits.
        assert row["hit_share"] == 1.0
    assert set(result["hash_32k_by_block_bytes"]) == {"64", "128", "256", "512", "1024"}
