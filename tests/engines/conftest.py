"""The real-engine tier: real Envoy, real ace-extproc and real vLLM servers (CPU build),
as ``make engines`` installs them. On demand only (``make test-engines``): the default
run deselects the ``engines`` marker, and without ``.engines/`` every test here skips.

Two vLLM servers start once per session (a minute or so) with a 16,384-block cache
each and ``/reset_prefix_cache`` on; each test puts its own Envoy and ace-extproc
(``Stack`` with a fleet file naming the servers) in front of them, from cold caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from ace_extproc.routing.kv_events import PRECISE, Endpoints, PodStream
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.stack import Stack, StackOptions, envoy_binary
from ace_extproc.vllm_pods import EnginesMissing, Pods, VllmOptions, fleet_doc
from tests.conftest import free_ports

PODS = 2
KV_BLOCKS = 16_384  # per server: 524,288 tokens of 32-token blocks
SALT_SECRET = "engines-tier"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def engines() -> VllmOptions:
    """What ``make engines`` built (skips every test here without it)."""
    try:
        envoy_binary()
        # The Responses API's store too (tests/engines/test_responses.py): it changes
        # nothing for the other APIs.
        store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
        return VllmOptions.find(kv_blocks=KV_BLOCKS, dev_mode=True, kv_events=True, env=store)
    except (EnginesMissing, RuntimeError) as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def vllm(engines: VllmOptions, loop: asyncio.AbstractEventLoop) -> Iterator[Pods]:
    options = engines
    workdir = Path(tempfile.mkdtemp(prefix="ace-engines-"))
    # Each server publishes its KV events (a port each); precise routing follows them.
    ports = free_ports(2 * PODS)
    pods = Pods(options, ports[:PODS], workdir, kv_events_ports=ports[PODS:])
    loop.run_until_complete(pods.__aenter__())
    try:
        yield pods
    finally:
        loop.run_until_complete(pods.stop())


@pytest.fixture
def pods(vllm: Pods, loop: asyncio.AbstractEventLoop) -> Pods:
    """The servers, each running (one a test killed is started again) with an empty
    prefix cache."""
    loop.run_until_complete(vllm.start())
    loop.run_until_complete(vllm.reset_prefix_caches())
    return vllm


class Front:
    """Envoy and ace-extproc before the servers, driven from the test's thread."""

    def __init__(self, stack: Stack, loop: asyncio.AbstractEventLoop, pods: Pods) -> None:
        self.stack, self.loop, self.pods = stack, loop, pods

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def metrics_url(self) -> str:
        return f"http://{self.stack.options.metrics}/metrics"

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def post(
        self, path: str, body: dict[str, Any] | bytes, base: str | None = None, **headers: str
    ) -> tuple[int, dict[str, str], bytes]:
        answer: tuple[int, dict[str, str], bytes] = self.run(
            post(base or self.url, path, body, headers)
        )
        return answer

    def chat(
        self, messages: list[dict[str, Any]], **headers: str
    ) -> tuple[int, dict[str, str], bytes]:
        body = {"model": "tiny", "messages": messages, "max_tokens": 2}
        return self.post("/v1/chat/completions", body, **headers)

    def metrics(self) -> str:
        text: str = self.run(get_text(self.metrics_url))
        return text


async def post(
    base: str, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(base + path, data=data, headers=hdrs) as resp,
    ):
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        resp.raise_for_status()
        return await resp.text()


@contextlib.contextmanager
def front(
    pods: Pods,
    loop: asyncio.AbstractEventLoop,
    router: dict[str, Any] | None = None,
    mode: str | None = None,
    addresses: list[str] | None = None,
    precise: bool = False,
) -> Iterator[Front]:
    """A Stack before ``pods`` (or before ``addresses``, e.g. a recording proxy);
    ``precise``: following the servers' KV events with the model's tokenizer."""
    workdir = Path(tempfile.mkdtemp(prefix="ace-engines-front-"))
    urls = pods.urls if addresses is None else [f"http://{a}" for a in addresses]
    events = [f"tcp://{pods.host}:{p}" for p in pods.kv_events_ports] if precise else []
    tokenizer = pods.options.model if precise else ""
    doc = fleet_doc(urls, router, tokenizer=tokenizer, kv_events=events)
    (workdir / "fleet.yaml").write_text(yaml.safe_dump(doc))
    ports = free_ports(5)
    options = StackOptions(
        fleet_path=str(workdir / "fleet.yaml"),
        listen=f"127.0.0.1:{ports[0]}",
        admin=f"127.0.0.1:{ports[1]}",
        ext_proc=f"127.0.0.1:{ports[2]}",
        metrics=f"127.0.0.1:{ports[3]}",
        admin_api=f"127.0.0.1:{ports[4]}",
        mode=mode,
        env={"ACE_SALT_SECRET": SALT_SECRET},
        workdir=workdir,
    )
    stack = Stack(options)
    loop.run_until_complete(stack.start())
    try:
        yield Front(stack, loop, pods)
    finally:
        loop.run_until_complete(stack.stop())


def usage(body: bytes) -> dict[str, Any]:
    use: dict[str, Any] = json.loads(body)["usage"]
    return use


def cached(body: bytes) -> int:
    return int(usage(body)["prompt_tokens_details"]["cached_tokens"])


def trace(headers: dict[str, str]) -> dict[str, str]:
    raw = headers["x-ace-trace-prefix-kv-cache"]
    return dict(item.split("=", 1) for item in raw.split(","))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total, found = 0.0, False
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", re.M)
    for m in pattern.finditer(text):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
            found = True
    if not found:
        raise KeyError(f"{name}{labels} not in the exposition")
    return total


def document(topic: str, repeats: int = 120) -> str:
    """A long system prompt of its own from its first characters (a prefix per topic)."""
    line = f"[{topic}] Section {{i}}: the {topic} handbook says to check the ledger twice.\n"
    return "".join(line.format(i=i) for i in range(repeats))


async def following(pods: Pods, index: PreciseIndex) -> PodStream:
    """A stream of the first server's KV events into ``index``, once they are trusted
    and the subscription has reached the publisher; the caller stops it."""
    endpoints = Endpoints(f"tcp://{pods.host}:{pods.kv_events_ports[0]}", topic="kv")
    stream = PodStream(0, "vllm/pod-0", index, endpoints, None, rebuild_s=60)
    stream.start()
    deadline = time.monotonic() + 10
    while stream.refresh() != PRECISE:
        assert time.monotonic() < deadline, "the server's events never connected"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # the subscription reaches the publisher
    return stream
