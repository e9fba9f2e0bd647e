"""Precise routing end to end: simulated pods publish KV events in vLLM's wire format,
ace-extproc follows them with the sim's tokenizer, behind the real Envoy.

What the approximate index cannot know and the events tell: blocks another gateway
(or replica) placed on a pod, and a pod whose cache was cleared."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from ace_extproc.config import TenantConfig
from ace_extproc.tenants import Tenants
from tests.test_e2e import Client, cached, options, running, trace

pytestmark = pytest.mark.envoy

SECRET = "e2e-secret"


@pytest.fixture(scope="module")
def precise() -> Iterator[Client]:
    with running(options(precise=True, router={"max_body_bytes": 256 * 1024})) as client:
        _wait_precise(client)
        yield client


def metrics(client: Client) -> str:
    return str(client.run(client._text(f"http://{client.stack.options.metrics}/metrics")))


def _wait_precise(client: Client) -> None:
    deadline = time.monotonic() + 20
    while metrics(client).count('state="precise"} 1.0') < 4:
        assert time.monotonic() < deadline, "pods never became precise"
        time.sleep(0.1)


def chat(topic: str, turns: int = 0) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"{topic} " + "context " * 400}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"q{i}"})
        messages.append({"role": "assistant", "content": f"a{i}"})
    return [*messages, {"role": "user", "content": "next?"}]


def served_by(headers: dict[str, str]) -> str:
    return headers["x-ace-served-by"]


def test_every_pod_publishes_and_is_followed(precise: Client) -> None:
    text = metrics(precise)
    assert text.count('ace_kv_events_state{pod="sim/pod-') >= 4 * 5
    assert 'ace_tokenizer_loaded{destination="sim"} 1.0' in text


def test_a_conversation_sticks_and_the_events_confirm_it(precise: Client) -> None:
    pods = set()
    hits = []
    for turn in range(3):
        status, headers, body = precise.chat(chat("sticky", turn))
        assert status == 200
        pods.add(served_by(headers))
        hits.append(cached(body))
    assert len(pods) == 1 and hits[0] == 0 and all(h > 500 for h in hits[1:])
    assert "ace_precise_speculative_total" in metrics(precise)


def test_blocks_another_gateway_placed_are_found(precise: Client) -> None:
    """A prompt sent straight to a pod with this tenant's salt, as another gateway's
    replica would: the router never saw it, the engine's events say where it is.
    Once for each pod, so the rendezvous placement cannot pass it by chance."""
    config = precise.stack.config
    assert config is not None
    salt = Tenants(TenantConfig(), SECRET.encode()).salt("anon")
    for pod in config.fleet.pods:
        messages = chat(f"elsewhere-{pod.id}")
        body = {"model": "sim-llama", "messages": messages, "max_tokens": 2, "cache_salt": salt}
        url = f"{pod.base_url}/v1/chat/completions"
        status, _, _ = precise.run(precise._post_url(url, body))
        assert status == 200
        time.sleep(0.1)  # its events arrive
        status, headers, answer = precise.chat(messages)
        assert status == 200 and served_by(headers) == pod.key
        assert cached(answer) > 500 and trace(headers).get("action") == "hit"


def test_a_cleared_cache_is_not_believed(precise: Client) -> None:
    status, headers, _ = precise.chat(chat("cleared"))
    first = served_by(headers)
    config = precise.stack.config
    assert config is not None
    pod = next(p for p in config.fleet.pods if p.key == first)
    precise.run(precise._post_url(f"{pod.base_url}/reset_prefix_cache", {}))
    time.sleep(0.2)  # AllBlocksCleared arrives
    status, headers, answer = precise.chat(chat("cleared", 1))
    assert status == 200 and cached(answer) == 0
    assert trace(headers).get("action") == "miss"  # priced as the miss it is
