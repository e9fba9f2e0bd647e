"""The simulated engine agrees with a real vLLM on what routing depends on.

One real vLLM pod (``vllm_pods.Pods``: the CPU build and the tiny model) and one
``ace-extproc sim`` configured like it (``bench/engine_pair.py``: same names, block size,
context length, KV size) get the same requests. Checked: the metric names and label keys
the router reads, the KV size in ``vllm:cache_config_info``, cached tokens on repeats
(whole blocks, the same block-boundary rule, ``cache_salt`` isolation, the reset), the
streamed usage chunk, and the status codes of the bad requests the router's retry and
outlier logic sees. The full comparison is ``python -m bench.sim_vs_real``.

Self-contained (its own two pods, started once for the module); skipped without
``make engines``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ace_extproc.routing import metrics_text
from ace_extproc.vllm_pods import BLOCK_SIZE, MAX_MODEL_LEN, EnginesMissing, Pods, VllmOptions
from bench.engine_pair import free_port, kv_blocks, sim_argv, sim_pod
from bench.parity import expected_cached, exposition, labels_of

pytestmark = pytest.mark.engines
CONTEXT = MAX_MODEL_LEN  # the pods' context, sim and real alike

# Every series the router reads (routing/metrics_text.py), and the restart marker.
ROUTER_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:cache_config_info",
    "process_start_time_seconds",
)


class Engines:
    """The two pods, and requests to both from the module's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sim: str, real: str) -> None:
        self.loop, self.urls = loop, {"sim": sim, "real": real}

    def both(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> dict[str, tuple[int, Any]]:
        """``{engine: (status, parsed JSON or text)}`` for the same request."""

        async def one(url: str) -> tuple[int, Any]:
            kw: dict[str, Any] = {"json": body} if raw is None else {"data": raw}
            timeout = aiohttp.ClientTimeout(total=120)
            async with (
                aiohttp.ClientSession(timeout=timeout) as http,
                http.request(method, url + path, **kw) as resp,
            ):
                if resp.content_type == "application/json":
                    return resp.status, await resp.json()
                return resp.status, await resp.text()

        return {name: self.loop.run_until_complete(one(url)) for name, url in self.urls.items()}

    def ok(self, path: str, body: Any) -> dict[str, Any]:
        out = {}
        for name, (status, answer) in self.both("POST", path, body).items():
            assert status == 200, (name, answer)
            out[name] = answer
        return out


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """Both pods, once for the module; every test skips without ``make engines``. (Looked
    for here, not at import, so a run that deselects the marker says nothing of it.)"""
    try:
        options = VllmOptions.find(dev_mode=True)
    except EnginesMissing as exc:
        pytest.skip(f"no real vLLM to compare the sim with: {exc}")
    loop = asyncio.new_event_loop()
    workdir = Path(tempfile.mkdtemp(prefix="ace-sim-parity-"))
    stack = contextlib.AsyncExitStack()
    try:
        pods = loop.run_until_complete(
            stack.enter_async_context(Pods(options, [free_port()], workdir))
        )
        real = pods.urls[0]
        port = free_port()
        argv = sim_argv(port, options, loop.run_until_complete(kv_blocks(real)))
        sim = loop.run_until_complete(
            stack.enter_async_context(
                sim_pod(argv, f"http://127.0.0.1:{port}", workdir / "sim.log")
            )
        )
        yield Engines(loop, sim, real)
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 7990) for _ in range(n)]  # valid ids for both vocabularies


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_series_the_router_reads_exist_in_both_with_the_same_label_keys(
    engines: Engines,
) -> None:
    engines.ok("/v1/completions", {"prompt": _ids(1, 100), "max_tokens": 1})  # counters move
    texts = {name: body for name, (_, body) in engines.both("GET", "/metrics").items()}
    families = {name: exposition(text) for name, text in texts.items()}
    for metric in ROUTER_METRICS:
        keys = {name: fams[metric].label_keys for name, fams in families.items() if metric in fams}
        assert set(keys) == {"sim", "real"}, f"{metric} is missing from {set(families) - set(keys)}"
        if metric != "vllm:cache_config_info":  # an info metric: compared below
            assert keys["sim"] == keys["real"], metric
    # What the router makes of each: the same fields found, the same KV size.
    stats = {name: metrics_text.parse(text) for name, text in texts.items()}
    for name, s in stats.items():
        assert s.engine == "vllm" and s.reason == "", (name, s.reason)
        assert None not in (s.running, s.waiting, s.kv_usage, s.cache_queries, s.cache_hits)
        assert s.prompt_tokens and s.cached_prompt_tokens is not None and s.start_time
    assert stats["sim"].capacity_tokens == stats["real"].capacity_tokens


def test_both_answer_the_routers_read_with_only_the_series_it_reads(engines: Engines) -> None:
    """The monitor asks for its series by name (``metrics_text.SCRAPE_PATH``): each
    engine answers just those, which the router reads as it reads the whole text."""
    engines.ok("/v1/completions", {"prompt": _ids(2, 100), "max_tokens": 1})
    whole = {name: body for name, (_, body) in engines.both("GET", "/metrics").items()}
    asked = engines.both("GET", metrics_text.SCRAPE_PATH)
    for name, (status, text) in asked.items():
        assert status == 200, name
        assert len(text) < len(whole[name]), name  # vLLM's: a tenth (below); the sim's: half
        assert set(exposition(text)) <= set(metrics_text.SCRAPED_SERIES), name
        full, part = metrics_text.parse(whole[name]), metrics_text.parse(text)
        assert part.reason == "" and part.start_time == full.start_time, name
        assert (part.capacity_tokens, part.model_name) == (full.capacity_tokens, full.model_name)
        assert part.prompt_tokens == full.prompt_tokens and part.first_tokens == full.first_tokens
    real = asked["real"][1]
    assert len(real) < len(whole["real"]) / 4, (len(real), len(whole["real"]))


def test_cache_config_info_carries_the_kv_size_in_both(engines: Engines) -> None:
    info = {
        name: labels_of(exposition(text), "vllm:cache_config_info")
        for name, (_, text) in engines.both("GET", "/metrics").items()
    }
    for name, labels in info.items():
        blocks, block = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        assert block == BLOCK_SIZE, name
        assert int(labels["kv_cache_size_tokens"]) == blocks * block, name
        assert labels["enable_prefix_caching"] == "True", name
    assert info["sim"]["num_gpu_blocks"] == info["real"]["num_gpu_blocks"]


@pytest.mark.parametrize("tokens", [31, 32, 33, 64, 65, 1000, 1024])
def test_a_repeat_reuses_whole_blocks_but_never_the_last_token(
    engines: Engines, tokens: int
) -> None:
    body = {"prompt": _ids(100 + tokens, tokens), "max_tokens": 1}
    first = engines.ok("/v1/completions", body)
    again = engines.ok("/v1/completions", body)
    want = expected_cached(tokens, BLOCK_SIZE)  # k whole blocks: k - 1 reused
    for name in ("sim", "real"):
        assert _cached(first[name]) == 0, name
        assert _cached(again[name]) == want, (name, _cached(again[name]), want)


def test_a_chat_repeat_follows_each_engines_own_token_count(engines: Engines) -> None:
    """The tokenizers differ, so the rule is checked against each one's prompt_tokens."""
    text = " ".join(
        random.Random(5).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(900)
    )
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    engines.ok("/v1/chat/completions", body)
    again = engines.ok("/v1/chat/completions", body)
    for name, answer in again.items():
        prompt = answer["usage"]["prompt_tokens"]
        assert _cached(answer) == expected_cached(prompt, BLOCK_SIZE) > 0, name


def test_a_shared_prefix_hits_its_whole_blocks(engines: Engines) -> None:
    shared = _ids(7, 1000)
    engines.ok("/v1/completions", {"prompt": shared + _ids(8, 50), "max_tokens": 1})
    later = engines.ok("/v1/completions", {"prompt": shared + _ids(9, 70), "max_tokens": 1})
    for name, answer in later.items():
        assert _cached(answer) == expected_cached(1070, BLOCK_SIZE, 1000) == 992, name


def test_another_cache_salt_finds_nothing(engines: Engines) -> None:
    body = {"prompt": _ids(11, 500), "max_tokens": 1, "cache_salt": "tenant-a"}
    engines.ok("/v1/completions", body)
    same = engines.ok("/v1/completions", body)
    other = engines.ok("/v1/completions", {**body, "cache_salt": "tenant-b"})
    bare = engines.ok("/v1/completions", {k: v for k, v in body.items() if k != "cache_salt"})
    for name in ("sim", "real"):
        assert _cached(same[name]) == 480, name
        assert _cached(other[name]) == 0, name
        assert _cached(bare[name]) == 0, name


def test_the_streamed_usage_chunk_reports_cached_tokens(engines: Engines) -> None:
    body = {"prompt": _ids(13, 300), "max_tokens": 3, "stream": True}
    engines.both("POST", "/v1/completions", body)
    counted = engines.both(
        "POST", "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    plain = engines.both("POST", "/v1/completions", body)
    for name, (status, text) in counted.items():
        assert status == 200, name
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", name
        assert '"cached_tokens":288' in events[-2].replace(" ", ""), (name, events[-2])
        assert '"choices":[]' in events[-2].replace(" ", ""), name
    for name, (_, text) in plain.items():
        assert '"usage"' not in text, name


# Bad requests, and the status vLLM 0.32 answers. The router's outlier detection counts
# only 5xx, its retries only gateway errors: none of these may be a 5xx on either side.
BAD_REQUESTS: list[tuple[str, str, str, Any, int]] = [
    ("unknown model", "POST", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "sim-llama"}, 400),
    ("bad JSON", "POST", "/v1/chat/completions", b"{not json", 400),
    ("max_tokens over the context", "POST", "/v1/completions",
     {"prompt": [5, 6], "max_tokens": CONTEXT + 8_000}, 400),
    ("prompt over the context", "POST", "/v1/completions",
     {"prompt": [5] * (CONTEXT + 8_000)}, 400),
    ("prompt filling the context", "POST", "/v1/completions",
     {"prompt": [5] * CONTEXT, "max_tokens": 4}, 400),
    ("answer cut to the context left", "POST", "/v1/completions",
     {"prompt": [5] * (CONTEXT - 8), "max_tokens": 100}, 200),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("cache_salt not a string", "POST", "/v1/completions", {"prompt": "hi", "cache_salt": 7}, 400),
    ("cache_salt with a slash", "POST", "/v1/completions",
     {"prompt": "hi", "cache_salt": "a/b"}, 400),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400),
    ("stream_options without stream", "POST", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("unknown route", "POST", "/v1/nothing", {}, 404),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_get_the_same_status(
    engines: Engines, method: str, path: str, body: Any, status: int
) -> None:
    raw = body if isinstance(body, bytes) else None
    got = engines.both(method, path, None if raw else body, raw)
    assert {name: s for name, (s, _) in got.items()} == {"sim": status, "real": status}, got
    if status == 200:
        assert got["sim"][1]["usage"]["completion_tokens"] == 8  # 32,768 - 32,760
        assert got["real"][1]["usage"]["completion_tokens"] <= 8  # the model may stop early


def test_reset_prefix_cache_empties_both(engines: Engines) -> None:
    body = {"prompt": _ids(17, 200), "max_tokens": 1}
    engines.ok("/v1/completions", body)
    warm = engines.ok("/v1/completions", body)
    reset = engines.both("POST", "/reset_prefix_cache")
    cold = engines.ok("/v1/completions", body)
    for name in ("sim", "real"):
        assert reset[name] == (200, {"success": True}), name
        assert (_cached(warm[name]), _cached(cold[name])) == (192, 0), name
