"""LoRA adapters on a real vLLM pod: what LoRA-aware routing reads and relies on.

One server for the module (its own, like test_sim_parity's), serving eight random-weight
rank-8 adapters made here (``make_adapters``) with ``--max-loras 2``: two adapters in a
batch, the default ``max_cpu_loras`` (also 2) held loaded. Seen on it (docs/engines.md,
"LoRA adapters"): every adapter answers as its own model; ``vllm:lora_requests_info`` has
one series per label set ever seen, its value the time it was last set, so the current
one is the newest; a third adapter waits (``reason="deferred"``) while two run; the prefix
cache is per adapter. A cold adapter's load is not measurable at this size (about a
millisecond), so it is reported, not asserted.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ace_extproc.routing import metrics_text
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.tokens import ModelTokens, block_keys, chain_seed
from ace_extproc.vllm_pods import BLOCK_SIZE, EnginesMissing, Pods, VllmOptions, make_adapters
from bench.parity import exposition
from tests.conftest import free_port
from tests.engines.conftest import following, metric

ADAPTERS = 8
MAX_LORAS = 2
TOKENS = 500  # each answer under load: long enough for a few scrapes per phase
LORA_LABELS = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}


class Pod:
    def __init__(self, loop: asyncio.AbstractEventLoop, pods: Pods) -> None:
        self.loop, self.pods, self.url = loop, pods, pods.urls[0]

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def metrics(self) -> str:
        async def get() -> str:
            async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as r:
                return await r.text()

        text: str = self.run(get())
        return text

    def chat(self, model: str, content: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        answer: dict[str, Any] = self.run(chat(self.url, model, content, max_tokens, **extra))
        return answer


async def chat(
    url: str, model: str, content: str, max_tokens: int = 1, **extra: Any
) -> dict[str, Any]:
    """A streamed chat: its final usage, and ``ttft_ms`` to the first content chunk."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start, ttft, usage, text = time.perf_counter(), None, None, ""
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert chunk["model"] == model
            for choice in chunk.get("choices") or ():
                if choice["delta"].get("content") is not None:
                    ttft = ttft if ttft is not None else (time.perf_counter() - start) * 1000
                    text += choice["delta"]["content"]
            usage = chunk.get("usage") or usage
    assert usage is not None and ttft is not None
    return {"usage": usage, "ttft_ms": ttft, "text": text}


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def lora_info(text: str) -> list[tuple[dict[str, str], float]]:
    """``vllm:lora_requests_info``'s samples, newest (the current state) first; none
    before the first LoRA request is scheduled (the family is declared, sampleless)."""
    assert "# TYPE vllm:lora_requests_info gauge" in text, "no vllm:lora_requests_info"
    family = exposition(text).get("vllm:lora_requests_info")
    if family is None:  # declared without a sample: the parse keeps no family
        return []
    assert family.type == "gauge"
    return sorted(family.samples, key=lambda s: s[1], reverse=True)


def adapters(label: str) -> set[str]:
    return set(label.split(",")) - {""}


@pytest.fixture(scope="module")
def pod() -> Iterator[Pod]:
    try:
        options = VllmOptions.find(dev_mode=True, kv_blocks=16_384)
    except EnginesMissing as exc:
        pytest.skip(f"no real vLLM: {exc}")
    workdir = Path(tempfile.mkdtemp(prefix="ace-engines-lora-"))
    modules = make_adapters(workdir / "adapters", ADAPTERS)
    options = replace(options, lora_modules=modules, max_loras=MAX_LORAS, kv_events=True)
    loop = asyncio.new_event_loop()
    pods = Pods(options, [free_port()], workdir, kv_events_ports=[free_port()])
    try:
        loop.run_until_complete(pods.__aenter__())
        yield Pod(loop, pods)
    finally:
        loop.run_until_complete(pods.stop())
        loop.close()


def test_adapters_are_deterministic(tmp_path: Path) -> None:
    try:
        model = VllmOptions.find().model
    except EnginesMissing as exc:
        pytest.skip(str(exc))
    one = make_adapters(tmp_path / "a", 2, model=Path(model), seed=3)
    two = make_adapters(tmp_path / "b", 2, model=Path(model), seed=3)
    other = make_adapters(tmp_path / "c", 1, model=Path(model), seed=4)
    weights = [Path(m.path, "adapter_model.safetensors").read_bytes() for m in (*one, *two)]
    assert weights[0] == weights[2] and weights[1] == weights[3] and weights[0] != weights[1]
    assert Path(other[0].path, "adapter_model.safetensors").read_bytes() != weights[0]


def test_the_slots_show_from_the_first_request_of_any_model(pod: Pod) -> None:
    """vLLM samples the gauge after an engine step: a server that has had no request
    shows no ``max_lora`` (the router takes a sibling's until then, ``load.py``), and
    one base-model request is enough for it to (the simulated engines do the same).
    First in the module: the server has had no request before it."""
    assert lora_info(pod.metrics()) == []
    pod.chat("tiny", "hello")
    samples: list[tuple[dict[str, str], float]] = []
    deadline = time.monotonic() + 10
    while not samples and time.monotonic() < deadline:
        samples = lora_info(pod.metrics())
        time.sleep(0.1)
    assert samples, "no sample after a base-model request"
    labels = samples[0][0]
    assert labels["max_lora"] == str(MAX_LORAS)
    assert adapters(labels["running_lora_adapters"]) == set()


def test_lora_requests_info_names_the_running_adapters(pod: Pod) -> None:
    # The family is declared from the start, with no sample until a LoRA request runs.
    assert "# TYPE vllm:lora_requests_info gauge" in pod.metrics()

    async def load() -> tuple[list[str], list[dict[str, Any]]]:
        # Two adapters fill the batch's LoRA slots with long answers; a third waits.
        long = {"ignore_eos": True}
        names = ["lora-0", "lora-1", "lora-2"]
        tasks = []
        for name in names:
            tasks.append(asyncio.create_task(chat(pod.url, name, f"busy {name}", TOKENS, **long)))
            await asyncio.sleep(0.05)  # lora-0 and lora-1 are scheduled first
        seen = []  # parsed afterwards: the client shares two cores with the server
        async with aiohttp.ClientSession() as http:
            while not all(t.done() for t in tasks):
                async with http.get(pod.url + "/metrics") as r:
                    seen.append(await r.text())
                await asyncio.sleep(0.02)
        return seen, [await t for t in tasks]

    seen, answers = pod.run(load())
    assert all(a["usage"]["completion_tokens"] == TOKENS for a in answers)
    deferred = max(
        metric(text, "vllm:num_requests_waiting_by_reason", reason="deferred") for text in seen
    )
    current = [lora_info(text)[0][0] for text in seen if lora_info(text)]
    for labels in current:
        assert set(labels) == LORA_LABELS, labels
        assert labels["max_lora"] == str(MAX_LORAS)
        # vLLM 0.32 lists in both labels every adapter with a request it has scheduled;
        # one still waiting for a slot is in neither (it counts as "deferred" instead).
        assert labels["waiting_lora_adapters"] == labels["running_lora_adapters"]
        assert len(adapters(labels["running_lora_adapters"])) <= MAX_LORAS
    running = [adapters(labels["running_lora_adapters"]) for labels in current]
    assert {"lora-0", "lora-1"} in running, running
    assert any("lora-2" in r for r in running), running
    assert deferred >= 1, "the third adapter never waited for a slot"
    # The router reads the deferred count beside the slots (routing/lora.py keeps its
    # waiting pick open by it): the same figure through its parser.
    parsed = [metrics_text.parse(text).lora for text in seen]
    assert max(info.deferred for info in parsed if info is not None) == deferred
    # Done: the newest sample is the empty one.
    final = lora_info(pod.metrics())[0][0]
    assert final["running_lora_adapters"] == "" and final["waiting_lora_adapters"] == ""


def test_a_request_is_named_only_from_its_first_token(pod: Pod) -> None:
    """vLLM learns of a request's adapter from the events on its outputs, so while a
    long prompt is still prefilling, the engine counts it running and names its adapter
    in no label; from its first token on, both name it. (The router keeps its picks that
    no label names open by this: ``routing/lora.py``, ``Adapters._settle``.)"""
    prompt = f"{time.time_ns()} " + " ".join(f"w{i % 977}" for i in range(12_000))

    async def run() -> tuple[list[tuple[float, str]], float]:
        task = asyncio.create_task(chat(pod.url, "lora-6", prompt, 200, ignore_eos=True))
        start = time.perf_counter()
        seen = []
        async with aiohttp.ClientSession() as http:
            while not task.done():
                async with http.get(pod.url + "/metrics") as r:
                    seen.append((time.perf_counter() - start, await r.text()))
                await asyncio.sleep(0.02)
        return seen, (await task)["ttft_ms"] / 1000

    seen, first_token_s = pod.run(run())

    def named(text: str) -> bool:
        samples = lora_info(text)
        return bool(samples) and "lora-6" in adapters(samples[0][0]["running_lora_adapters"])

    prefilling = [
        text
        for at, text in seen
        if at < first_token_s - 0.05 and metric(text, "vllm:num_requests_running") >= 1
    ]
    assert prefilling, f"no scrape while it prefilled ({first_token_s:.2f} s to its first token)"
    assert not any(named(text) for text in prefilling)
    assert any(named(text) for at, text in seen if at > first_token_s), "never named"


def test_every_adapter_answers_as_its_own_model(pod: Pod) -> None:
    prompt = "Tell me about the ledger."
    texts = {m: pod.chat(m, prompt, 6)["text"] for m in ("tiny", "lora-3", "lora-4", "lora-5")}
    assert len(set(texts.values())) == len(texts), texts  # greedy, yet each its own
    assert pod.chat("lora-3", prompt, 6)["text"] == texts["lora-3"]


def test_cold_adapter_first_request(pod: Pod) -> None:
    """Cycling through eight adapters with two held, each first request loads its adapter
    from disk. Reported only: with these 30 KB adapters the load is lost in the noise."""
    cold, warm, base = [], [], []
    for i in range(3 * ADAPTERS):
        name = f"lora-{i % ADAPTERS}"
        cold.append(pod.chat(name, f"cold {i}")["ttft_ms"])
        warm.append(pod.chat(name, f"warm {i}")["ttft_ms"])
        base.append(pod.chat("tiny", f"base {i}")["ttft_ms"])
    report = {
        k: round(statistics.median(v), 1)
        for k, v in (("cold", cold), ("warm", warm), ("base", base))
    }
    print(f"TTFT medians, ms: {report}")


def test_the_prefix_cache_is_per_adapter(pod: Pod) -> None:
    pod.run(pod.pods.reset_prefix_caches())
    doc = "".join(f"[per adapter] Section {i}: check the ledger twice.\n" for i in range(60))
    first = pod.chat("lora-5", doc)
    prompt = first["usage"]["prompt_tokens"]
    assert cached(first) == 0
    full = (prompt - 1) // 32 * 32  # whole blocks, never the last token
    assert cached(pod.chat("lora-5", doc)) == full
    assert cached(pod.chat("lora-6", doc)) == 0  # another adapter: nothing shared
    assert cached(pod.chat("tiny", doc)) == 0  # nor with the base model
    assert cached(pod.chat("lora-6", doc)) == full
    assert cached(pod.chat("lora-5", doc)) == full  # the first adapter's blocks remain


def test_the_events_key_an_adapters_blocks_as_the_router_does(pod: Pod) -> None:
    """What the engine stored for an adapter's request, keyed from its events (they name
    the adapter), is what the router keys from the body seeded by the adapter's name, and
    nothing the base model's or another adapter's keys find (precise routing)."""
    pods = pod.pods
    pod.run(pods.reset_prefix_caches())
    index = PreciseIndex()
    doc = "".join(f"[precise adapter] Clause {i}: read it twice.\n" for i in range(60))
    body = {"model": "lora-7", "messages": [{"role": "user", "content": doc}], "max_tokens": 1}
    ids = ModelTokens(pods.options.model).token_ids(
        "/v1/chat/completions", json.dumps(body).encode()
    )
    assert ids is not None

    async def go() -> dict[str | None, int]:
        stream = await following(pods, index)
        answer = await chat(pods.urls[0], "lora-7", doc)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        await asyncio.sleep(0.3)  # its events arrive
        depths = {
            name: index.match(block_keys(ids, BLOCK_SIZE, chain_seed(None, name)), 1).get(
                0, (0, 0)
            )[0]
            for name in ("lora-7", "lora-6", None)
        }
        await stream.stop()
        return depths

    depths = pod.run(go())
    assert depths == {"lora-7": len(ids) // BLOCK_SIZE, "lora-6": 0, None: 0}, depths
