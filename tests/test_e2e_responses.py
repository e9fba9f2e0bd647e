"""The Responses API end to end: a client -> the real Envoy -> ace-extproc -> simulated
pods whose store is on (VLLM_ENABLE_RESPONSES_API_STORE=1, as vLLM needs it).

A turn continuing a stored response (``previous_response_id``) can be served only by
the pod that stored it: every such turn must land there, whatever its prefix says; a
pod that went down is named in a clear error, as is one that came back without the
state; streams pass byte for byte; tenants and replicas behave as the unit tests say."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as redis
import yaml

from ace_extproc.routing import replicas
from ace_extproc.sim.app import POD_HEADER, SimConfig, SimServer
from ace_extproc.sim.responses import STORE_ENV
from ace_extproc.stack import Stack, StackOptions, redis_server_binary
from tests import test_e2e as e2e
from tests.conftest import Sent, free_ports
from tests.test_e2e import KEYS, SYSTEM, Client, running, trace

pytestmark = pytest.mark.envoy

RESPONSES = "/v1/responses"
ACME = {"authorization": "Bearer key-acme"}
GLOBEX = {"authorization": "Bearer key-globex"}


def options(pods: int = 4, **kw: Any) -> StackOptions:
    opts = e2e.options(**kw)
    return dataclasses.replace(opts, pods=pods, env={**opts.env, STORE_ENV: "1"})


@pytest.fixture(scope="module")
def prod() -> Iterator[Client]:
    with running(options(router={"tenants": {"api_keys": KEYS}})) as client:
        yield client


def first_turn(topic: str, **extra: Any) -> dict[str, Any]:
    # The topic leads, so each conversation is a prefix of its own from block 0.
    return {
        "model": "sim-llama",
        "instructions": f"[{topic}] {SYSTEM}",
        "input": f"{topic}: the first question",
        "max_output_tokens": 4,
        **extra,
    }


def next_turn(previous: str, i: int, topic: str = "", **extra: Any) -> dict[str, Any]:
    """A turn continuing ``previous``. Instructions do not carry over (vLLM drops the
    stored turn's system message), so a client resends them to find its prefix cached."""
    return {
        "model": "sim-llama",
        "instructions": f"[{topic}] {SYSTEM}",
        "input": f"question {i} " * 10,
        "previous_response_id": previous,
        "max_output_tokens": 4,
        **extra,
    }


def read_stream(body: bytes) -> tuple[str, dict[str, Any]]:
    """A streamed answer's response id (response.created) and its final response."""
    data = [
        json.loads(line[len(b"data: ") :])
        for line in body.split(b"\n")
        if line.startswith(b"data:")
    ]
    assert data[0]["type"] == "response.created" and data[-1]["type"] == "response.completed"
    return data[0]["response"]["id"], data[-1]["response"]


def answer(status: int, body: bytes, stream: bool) -> tuple[str, dict[str, Any]]:
    """The response id and the whole response of a turn's answer."""
    assert status == 200, body
    if stream:
        return read_stream(body)
    response = json.loads(body)
    return response["id"], response


def cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["input_tokens_details"]["cached_tokens"])


def test_a_responses_request_is_routed_by_prefix_like_its_chat(prod: Client) -> None:
    """The same conversation as chat and as Responses keys alike: the same pod, whose
    engine finds the chat's blocks cached for the Responses request (one salt)."""
    chat = {
        "model": "sim-llama",
        "messages": [
            {"role": "system", "content": f"[prefix] {SYSTEM}"},
            {"role": "user", "content": "prefix: the first question"},
        ],
        "max_tokens": 2,
    }
    status, chat_headers, _ = prod.post("/v1/chat/completions", chat, **ACME)
    assert status == 200
    status, headers, body = prod.post(RESPONSES, first_turn("prefix", store=False), **ACME)
    _, response = answer(status, body, False)
    assert headers["x-ace-served-by"] == chat_headers["x-ace-served-by"]
    assert trace(headers)["action"] == "hit" and cached(response) > 500


def test_every_turn_lands_on_the_pod_that_stored_the_response_it_continues(
    prod: Client,
) -> None:
    """Eight conversations of five turns, streamed and not, each turn naming the last
    one's response: each conversation stays on the pod that stored its first answer
    (any other would answer 404), reusing its cache there; they spread over the pods."""

    async def conversation(http: aiohttp.ClientSession, n: int) -> tuple[set[str], list[int]]:
        served, hits, previous = set(), [], ""
        for turn in range(5):
            stream = bool((n + turn) % 2)
            topic = f"topic-{n}"
            body = first_turn(topic) if not turn else next_turn(previous, turn, topic)
            body["stream"] = stream
            async with http.post(prod.stack.url + RESPONSES, json=body, headers=ACME) as resp:
                raw, headers = await resp.read(), resp.headers
                previous, response = answer(resp.status, raw, stream)
            served.add(headers[POD_HEADER])
            assert headers["x-ace-served-by"].endswith("/" + headers[POD_HEADER])
            if turn:
                t = trace(dict(headers))
                assert (t["action"], t["previous_response"]) == ("previous_response", "pinned")
                hits.append(cached(response))
        return served, hits

    async def main() -> list[tuple[set[str], list[int]]]:
        async with aiohttp.ClientSession() as http:
            return list(await asyncio.gather(*(conversation(http, n) for n in range(8))))

    results = prod.run(main())
    for served, hits in results:
        assert len(served) == 1 and all(h > 500 for h in hits), (served, hits)
    assert len(set.union(*(served for served, _ in results))) >= 2


def test_a_tenant_cannot_continue_another_tenant_s_response(prod: Client) -> None:
    status, _, body = prod.post(RESPONSES, first_turn("scoped"), **ACME)
    rid, _ = answer(status, body, False)
    status, headers, body = prod.post(RESPONSES, next_turn(rid, 1), **GLOBEX)
    # Unknown to globex: routed by its own prefix (where the engine 404s unless it lands
    # on the storing pod; vLLM's store is not scoped by tenant, nor could the router's be).
    assert trace(headers)["previous_response"] == "unknown"
    assert trace(headers)["action"] != "previous_response"
    status, headers, body = prod.post(RESPONSES, next_turn(rid, 1), **ACME)
    assert status == 200 and trace(headers)["previous_response"] == "pinned"


def test_a_continuation_whose_pod_went_down_or_restarted_fails_saying_why() -> None:
    """Down (its health checks failing): a 503 naming the pod, which may pass. Back, but
    a new process (its metrics say it restarted): a 404 saying the state is lost. Never
    a silent reroute to a pod that can only answer 404."""
    router = {"probe_interval_s": 0.2, "unhealthy_after": 1, "healthy_after": 1}
    with running(options(pods=2, router=router)) as client:
        status, headers, body = client.post(RESPONSES, first_turn("doomed"))
        rid, _ = answer(status, body, False)
        home = headers[POD_HEADER]
        client.run(client.stack.stop_process(home, signal.SIGKILL))

        async def until(expected: int) -> tuple[int, dict[str, str], bytes]:
            for _ in range(100):
                got = await client._post(RESPONSES, next_turn(rid, 1))
                if got[0] == expected:
                    return got
                await asyncio.sleep(0.1)
            raise AssertionError(f"never {expected}: {got}")

        status, headers, body = client.run(until(503))
        error = json.loads(body)["error"]
        assert f"'{rid}'" in error["message"] and home in error["message"]
        assert trace(headers)["action"] == "reject_response_unavailable"
        client.run(client.stack.restart_process(home))
        status, headers, body = client.run(until(404))
        message = json.loads(body)["error"]["message"]
        assert "is lost" in message and "restarted" in message
        assert trace(headers)["action"] == "reject_response_lost"


# ------------------------------------------------------------------ the engine's bytes


@contextlib.asynccontextmanager
async def in_process(
    tmp_path: Path, sent: Sent, router: dict[str, Any]
) -> AsyncIterator[tuple[Stack, list[SimServer]]]:
    """Two simulated pods in this process (their writes recorded), and a stack (Envoy,
    ace-extproc) in front of them from a fleet file."""
    ports = free_ports(7)
    sims = []
    for i, port in enumerate(ports[:2]):
        config = SimConfig(pod_id=f"pod-{i}", time_scale=0, tpot_ms=0, responses_store=True)
        sim = SimServer(config, port=port)
        sim.app.middlewares.append(sent.middleware(f"pod-{i}"))
        sims.append(sim)
    pods = [{"id": f"pod-{i}", "base_url": sim.url} for i, sim in enumerate(sims)]
    doc = {
        "destinations": [{"id": "sim", "base_url": pods[0]["base_url"], "pods": pods}],
        "router": router,
    }
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(doc))
    opts = StackOptions(
        fleet_path=str(fleet),
        listen=f"127.0.0.1:{ports[2]}",
        admin=f"127.0.0.1:{ports[3]}",
        ext_proc=f"127.0.0.1:{ports[4]}",
        metrics=f"127.0.0.1:{ports[5]}",
        admin_api=f"127.0.0.1:{ports[6]}",
        env={"ACE_SALT_SECRET": "e2e-secret"},
        workdir=tmp_path,
    )
    async with contextlib.AsyncExitStack() as stack:
        for sim in sims:
            await stack.enter_async_context(sim)
        yield await stack.enter_async_context(Stack(opts)), sims


@pytest.mark.parametrize("capture", [False, True], ids=["capture-off", "capture-on"])
def test_streams_pass_byte_for_byte_and_their_ids_and_usage_are_read(
    tmp_path: Path, sent: Sent, capture: bool
) -> None:
    """A streamed answer reaches the client exactly as the pod wrote it; its id is read
    on the way (the next turn is pinned), with usage capture or without; with it, the
    usage of response.completed is counted as the clients were told it."""

    async def main() -> None:
        async with in_process(tmp_path, sent, {"usage_capture": capture}) as (stack, _):
            told = 0
            async with aiohttp.ClientSession() as http:
                previous = ""
                for turn in range(4):
                    body = first_turn("bytes") if not turn else next_turn(previous, turn, "bytes")
                    body.update(stream=True, max_output_tokens=40)
                    async with http.post(stack.url + RESPONSES, json=body) as resp:
                        raw, headers = await resp.read(), resp.headers
                    assert raw == sent.by_pod[headers[POD_HEADER]][-1]
                    previous, response = answer(resp.status, raw, True)
                    told += cached(response)
                    if turn:
                        assert trace(dict(headers))["previous_response"] == "pinned"
                assert told > 0
                url = f"http://{stack.options.metrics}/metrics"
                if not capture:
                    assert await counted(http, url) in (None, 0)
                    # The observe filter ran for the Responses API alone: a chat opens no
                    # stream of it.
                    before = await observe_streams(http, stack)
                    chat = {"model": "sim-llama", "messages": [{"role": "user", "content": "x"}]}
                    async with http.post(stack.url + "/v1/chat/completions", json=chat) as resp:
                        assert resp.status == 200
                    assert before == 4 and await observe_streams(http, stack) == before
                    return
                for _ in range(50):  # the observe stream's last report may trail the client
                    if await counted(http, url) == told:
                        break
                    await asyncio.sleep(0.05)
                assert await counted(http, url) == told

    asyncio.run(asyncio.wait_for(main(), 120))


async def observe_streams(http: aiohttp.ClientSession, stack: Stack) -> int:
    """The streams Envoy opened to the observe-only filter (its admin's counter)."""
    url = f"http://{stack.options.admin}/stats?filter=ace_observe.streams_started$"
    async with http.get(url) as resp:
        text = await resp.text()
    return int(text.rsplit(":", 1)[1]) if ":" in text else 0


async def counted(http: aiohttp.ClientSession, url: str) -> float | None:
    """The cached tokens the observe filter read from the engines' usage (prod)."""
    async with http.get(url) as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith('ace_response_cached_tokens_total{mode="prod"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


# ------------------------------------------------------------------ replicas


@pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")
def test_replicas_share_where_stored_responses_live() -> None:
    """Two ace-extproc replicas behind one Envoy, each turn's routing and its answer's
    observation going to either: once the answer's home is on the channel, whichever
    replica gets the next turn pins it to the pod that stored the response."""

    async def main() -> None:
        async with Stack(options(ext_proc_replicas=2, share=True)) as stack:
            assert stack.config is not None
            listener = redis.Redis.from_url(stack.config.settings.share_url)
            pubsub = listener.pubsub(ignore_subscribe_messages=True)
            await pubsub.subscribe(replicas.DEFAULT_CHANNEL)

            async def shared(response_id: str) -> None:
                """Until a replica has told the other where ``response_id`` lives."""
                deadline = asyncio.get_running_loop().time() + 10
                while True:
                    assert asyncio.get_running_loop().time() < deadline
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    batch = replicas.decode_any(message["data"])
                    if isinstance(batch, replicas.HomesBatch) and any(
                        h.response_id == response_id for h in batch.homes
                    ):
                        await asyncio.sleep(0.05)  # for the other replica to take it in
                        return

            served: set[str] = set()
            async with aiohttp.ClientSession() as http:
                previous = ""
                for turn in range(10):
                    body = first_turn("replicas") if not turn else next_turn(previous, turn)
                    async with http.post(stack.url + RESPONSES, json=body) as resp:
                        raw, headers = await resp.read(), resp.headers
                    previous, _ = answer(resp.status, raw, False)
                    served.add(headers[POD_HEADER])
                    if turn:
                        assert trace(dict(headers))["previous_response"] == "pinned"
                    await shared(previous)
            assert len(served) == 1
            await pubsub.aclose()
            await listener.aclose()

    asyncio.run(asyncio.wait_for(main(), 120))
