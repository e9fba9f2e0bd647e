"""The native API and shadow mode against real engines: the router's own figures are
held to what vLLM reports."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ace_extproc.vllm_pods import Pods
from bench.shadow import TOLERANCE
from tests.engines.conftest import document, front, metric


def envelope(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "input": {"messages": messages, "max_tokens": 2},
        "target": {"model": "tiny"},
        "skill_overrides": {"prefix_kv_cache": {"mode": "prod"}},
    }


def turns(topic: str, n: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": document(topic)}]
    for i in range(n):
        msgs += [
            {"role": "user", "content": f"{topic}: question {i}. " * 10},
            {"role": "assistant", "content": f"{topic}: answer {i}. " * 10},
        ]
    return [*msgs, {"role": "user", "content": "and then?"}]


def test_execute_round_trips_with_a_trace_the_engine_bears_out(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    with front(pods, loop) as ace:
        for turn in range(3):
            status, headers, raw = ace.post("/v1/execute", envelope(turns("execute", turn)))
            assert status == 200, raw
            assert headers["content-type"] == "application/json"
            doc = json.loads(raw)
            assert doc["output"]["object"] == "chat.completion"
            assert doc["output"]["model"] == "tiny"  # the real engine's answer, enveloped
            (entry,) = doc["trace"]
            cached = doc["output"]["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn == 0:
                assert entry["action"] == "miss" and cached == 0
            else:
                assert entry["action"] == "hit" and cached > 1000
        bad = envelope(turns("execute", 0))
        bad["target"]["model"] = "no-such-model"
        status, _, raw = ace.post("/v1/execute", bad)
        doc = json.loads(raw)
        assert status == 404 and doc["status"] == 404 and doc["output"] is None
        assert "no-such-model" in json.dumps(doc["error"])  # vLLM's own error, enveloped


def replay(ace: Any) -> None:
    """Eight conversations of three turns, interleaved as users would send them."""
    for turn in range(3):
        for c in range(8):
            status, _, body = ace.chat(turns(f"shadow-{c}", turn))
            assert status == 200, body


def ledger(ace: Any, mode: str, requests: int) -> dict[str, float]:
    """The response ledger once Envoy's access log has reported every request."""
    deadline = time.monotonic() + 10
    while True:
        text = ace.metrics()
        try:
            if metric(text, "ace_responses_total", mode=mode) >= requests:
                break
        except KeyError:
            pass
        assert time.monotonic() < deadline, "the access log never reported every response"
        time.sleep(0.2)
    return {
        name: metric(text, f"ace_response_{name}_total", mode=mode)
        for name in ("prompt_tokens", "cached_tokens", "estimated_cached_tokens")
    }


def test_shadow_predicts_what_prod_then_gets_from_the_engines(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    router = {"usage_capture": True}
    with front(pods, loop, router=router, mode="shadow") as ace:
        replay(ace)
        shadow = ledger(ace, "shadow", 24)
    loop.run_until_complete(pods.reset_prefix_caches())
    with front(pods, loop, router=router, mode="prod") as ace:
        replay(ace)
        prod = ledger(ace, "prod", 24)
    predicted = shadow["estimated_cached_tokens"] / shadow["prompt_tokens"]
    default = shadow["cached_tokens"] / shadow["prompt_tokens"]
    measured = prod["cached_tokens"] / prod["prompt_tokens"]
    assert measured > default  # pinning pays on this workload...
    error = (predicted - measured) / measured
    # ... and shadow said how much, as closely as the simulation's own check requires.
    assert abs(error) <= TOLERANCE, (predicted, measured, default)
