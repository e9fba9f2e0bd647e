"""Streamed responses through real Envoy and ace-extproc arrive unchanged and undelayed,
with usage capture off (the default) and on (bench.streaming, in small)."""

from __future__ import annotations

import asyncio

import pytest

from bench.streaming import run_variant

pytestmark = pytest.mark.envoy


@pytest.mark.parametrize("capture", [False, True], ids=["capture-off", "capture-on"])
def test_stream_chunks_arrive_unchanged_and_undelayed(capture: bool) -> None:
    result = asyncio.run(run_variant(capture, requests=4, tokens=24, tpot_ms=10.0))
    assert result["text_unchanged"]  # every delta, in order, as the pod sent it
    direct, proxied = result["direct"], result["through_envoy"]
    # Inter-token gaps are the pod's 10 ms either way: the proxy path adds at most noise.
    assert 8.0 < direct["itl_p50_ms"] < 14.0
    assert abs(result["added_itl_p50_ms"]) < 1.5, result
    # With capture on, ace-extproc asked for the usage chunk (the client did not).
    assert proxied["with_usage_chunk"] == (4 if capture else 0)
    assert direct["with_usage_chunk"] == 0
    # ... and its observe filter read the same cached tokens the clients were told.
    assert result["cached_tokens_observed"] == result["cached_tokens_in_usage_chunks"]
    if capture:
        assert result["cached_tokens_observed"] > 0
