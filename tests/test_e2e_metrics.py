"""Each metric moving as it should, read from ace-extproc's own /metrics while real
Envoy serves simulated pods: decisions by mode and action, bypasses by reason, step
latencies, pods by state, the index, the engines' scraped figures, and the observe
filter's per-response reuse, which must equal what the clients were told."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_e2e import Client, conversation, options, running

pytestmark = pytest.mark.envoy

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def stack() -> Iterator[Client]:
    with running(options(router={"usage_capture": True})) as client:
        yield client


def scrape(client: Client) -> Samples:
    async def get() -> str:
        url = f"http://{client.stack.options.metrics}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
            return await resp.text()

    out: Samples = {}
    for family in text_string_to_metric_families(client.run(get())):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(client: Client, check: object, timeout: float = 5.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(client)
        if check(samples) or time.monotonic() > deadline:  # type: ignore[operator]
            return samples
        client.run(asyncio.sleep(0.1))


def test_decisions_bypasses_steps_and_reuse_move_as_they_should(stack: Client) -> None:
    # Start from a settled count: the stack's own readiness request may still be on its
    # way through the observe filter on a busy machine.
    before = wait_for(
        stack,
        lambda s: value(s, "ace_responses_total") >= value(s, "ace_decisions_total") > 0,
    )
    reported = 0
    for turn in range(3):
        status, _, body = stack.chat(conversation(turn, "metrics"))
        assert status == 200
        reported += json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    status, _, _ = stack.chat(
        conversation(0, "metrics-shadow"), **{"x-ace-skill-override": "prefix_kv_cache=shadow"}
    )
    assert status == 200
    status, _, _ = stack.post("/v1/chat/completions", b"{not json")
    # The observe filter's reports arrive as the client gets its answer: wait for them.
    after = wait_for(
        stack, lambda s: value(s, "ace_responses_total") - value(before, "ace_responses_total") >= 5
    )

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("ace_decisions_total", mode="prod", action="miss") == 1
    assert moved("ace_decisions_total", mode="prod", action="hit") == 2
    assert moved("ace_decisions_total", mode="shadow", action="miss") == 1
    assert moved("ace_bypasses_total", reason="bad_json") == 1
    assert moved("ace_decision_step_seconds_count", step="pick") == 4
    assert moved("ace_decision_step_seconds_count", step="rewrite") == 3  # not in shadow
    assert moved("ace_decision_seconds_count") >= 4
    assert moved("ace_estimated_cached_tokens_total", mode="prod") > 0
    assert moved("ace_picks_total", mode="prod") == 3
    # The observe filter: every response, and the engines' own reuse exactly as the
    # clients saw it in usage.cached_tokens, next to the router's estimate.
    assert moved("ace_responses_total", mode="prod") == 4  # the bypassed one too
    assert moved("ace_responses_total", mode="shadow") == 1
    assert moved("ace_response_cached_tokens_total", mode="prod") == reported
    estimate = moved("ace_response_estimated_cached_tokens_total", mode="prod")
    assert 0 < estimate <= reported
    # Envoy's hold of each request that reached a pod, by its own clock: routed, shadow
    # and bypassed alike (each waited for ace-extproc's answer).
    assert moved("ace_gateway_hold_seconds_count", mode="prod") == 4
    assert moved("ace_gateway_hold_seconds_count", mode="shadow") == 1
    assert 0 < moved("ace_gateway_hold_seconds_sum", mode="prod") < 4 * 1.0
    assert value(after, "ace_index_entries") > 0
    assert value(after, "ace_pods", state="available") == 4


def test_engine_figures_and_pods_by_state_follow_the_fleet(stack: Client) -> None:
    # The engines' own counters, scraped every 100 ms, show the reuse too.
    samples = wait_for(stack, lambda s: value(s, "ace_engine_cached_prompt_tokens_total") > 0)
    assert value(samples, "ace_engine_cached_prompt_tokens_total") > 0
    assert value(samples, "ace_engine_prompt_tokens_total") > 0
    assert stack.stack.config is not None
    victim = stack.stack.config.fleet.pods[3].id
    stack.run(stack.stack.stop_process(victim, signal.SIGKILL))
    samples = wait_for(stack, lambda s: value(s, "ace_pods", state="down") == 1)
    assert value(samples, "ace_pods", state="down") == 1
    assert value(samples, "ace_pods", state="available") == 3
    assert value(samples, "ace_pod_up", pod=victim) == 0
