"""Streams from a real engine pass through Envoy and ace-extproc unchanged, and usage
capture reads the engine's own final chunk."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from ace_extproc.vllm_pods import Pods
from tests.engines.conftest import document, front, metric
from tests.engines.proxy import RecordingProxy, http_bodies


def test_a_stream_arrives_byte_identical_and_its_usage_is_captured(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    proxies = [RecordingProxy("127.0.0.1", p) for p in pods.ports]
    for proxy in proxies:
        loop.run_until_complete(proxy.start())
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": document("streams")},
            {"role": "user", "content": "stream it"},
        ],
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        router = {"usage_capture": True}
        with front(pods, loop, router=router, addresses=[p.address for p in proxies]) as ace:

            async def stream() -> tuple[dict[str, str], bytes]:
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(ace.url + "/v1/chat/completions", json=body) as resp,
                ):
                    assert resp.status == 200
                    return {k.lower(): v for k, v in resp.headers.items()}, await resp.read()

            got = [ace.run(stream()) for _ in range(2)]
            finals = [final_usage(raw) for _, raw in got]
            assert finals[0]["prompt_tokens_details"]["cached_tokens"] == 0
            assert finals[1]["prompt_tokens_details"]["cached_tokens"] > 1000
            # ace-extproc's ledger holds what the engine's final chunks said, exactly.
            want_prompt = sum(u["prompt_tokens"] for u in finals)
            want_cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in finals)
            deadline = time.monotonic() + 10
            while True:
                text = ace.metrics()
                try:
                    prompt = metric(text, "ace_response_prompt_tokens_total", mode="prod")
                    if prompt >= want_prompt or time.monotonic() > deadline:
                        break
                except KeyError:
                    assert time.monotonic() < deadline
                time.sleep(0.2)
            assert prompt == want_prompt
            assert metric(text, "ace_response_cached_tokens_total", mode="prod") == want_cached
    finally:
        for proxy in proxies:
            loop.run_until_complete(proxy.stop())
    # What the engine wrote, decoded from its chunked HTTP/1.1, is what the client read.
    engine_streams = [
        b
        for conn in (p.sent_by_engine for p in proxies)
        for raw in conn
        for h, b in http_bodies(bytes(raw))
        if h.get("content-type", "").startswith("text/event-stream")
    ]
    for headers, raw in got:
        assert headers["content-type"].startswith("text/event-stream")
        assert raw in engine_streams


def final_usage(raw: bytes) -> dict[str, Any]:
    events = [ln[len(b"data: ") :] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    use: dict[str, Any] = json.loads(events[-2])["usage"]
    return use
