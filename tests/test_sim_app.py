"""The simulated pod over real HTTP, in-process (one aiohttp server per test)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ace_extproc.latency import DEFAULT_MODEL, get_model
from ace_extproc.routing import metrics_text
from ace_extproc.sim.app import (
    TTFT_FIELD,
    SimConfig,
    SimServer,
    add_arguments,
    config_from_args,
)
from ace_extproc.sim.protocol import filler_text
from ace_extproc.sim.tokenizer import encode, render_chat

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a meticulous assistant. " * 8  # long enough for several full blocks


@asynccontextmanager
async def pod(**overrides: Any) -> AsyncIterator[tuple[SimServer, aiohttp.ClientSession]]:
    config = SimConfig(**{"time_scale": 0.0, "tpot_ms": 1.0, **overrides})
    async with SimServer(config) as server, aiohttp.ClientSession(server.url) as session:
        yield server, session


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def test_metrics_by_name_answer_only_those_samples_where_vllm_does() -> None:
    """As vLLM 0.32: ``/metrics/`` (prometheus-client's app) renders only the samples
    ``name[]`` names, each family's HELP and TYPE with them; ``/metrics`` ignores it."""

    async def go() -> None:
        async with pod() as (_, session):
            await post(session, "/v1/completions", {"prompt": SYSTEM, "max_tokens": 2})
            names = ("vllm:num_requests_running", "vllm:time_to_first_token_seconds_count")
            query = [("name[]", n) for n in names]
            async with session.get("/metrics/", params=query) as resp:
                assert resp.status == 200
                text = await resp.text()
            samples = [line for line in text.splitlines() if not line.startswith("#")]
            assert [line.partition("{")[0] for line in samples] == list(names)
            assert text.count("# HELP") == text.count("# TYPE") == 2
            async with session.get("/metrics", params=query) as resp:
                whole = await resp.text()
            assert "vllm:prefix_cache_hits_total" in whole and len(whole) > 2 * len(text)
            # The router's own read gives what the whole text gives.
            async with session.get(metrics_text.SCRAPE_PATH) as resp:
                asked = await resp.read()
            assert len(asked) < len(whole)
            assert metrics_text.parse(asked) == metrics_text.parse(whole)

    run(go)


async def post(
    session: aiohttp.ClientSession, path: str, body: Any, status: int = 200
) -> dict[str, Any]:
    async with session.post(path, json=body) as resp:
        assert resp.status == status, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def stream(session: aiohttp.ClientSession, path: str, body: Any) -> list[Any]:
    """The decoded SSE events of a streamed response; "[DONE]" kept as a string."""
    async with session.post(path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-sim-pod"] == "pod-0"
        raw = (await resp.read()).decode()
    events = []
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def metrics(session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Answer number {i}."})
        messages.append({"role": "user", "content": f"Question number {i}?"})
    return messages


def expected_cached(earlier: list[int], later: list[int], block: int = 16) -> int:
    common = 0
    for a, b in zip(earlier, later, strict=False):
        if a != b:
            break
        common += 1
    return min(common, len(earlier), len(later) - 1) // block * block


def test_second_turn_hits_the_first_turns_blocks() -> None:
    async def main() -> None:
        async with pod() as (_, s):
            first = await post(s, "/v1/chat/completions", {"messages": conversation(1)})
            second = await post(s, "/v1/chat/completions", {"messages": conversation(2)})
        t1, t2 = encode(render_chat(conversation(1))), encode(render_chat(conversation(2)))
        assert first["usage"]["prompt_tokens"] == len(t1)
        # vLLM 0.32's chat usage: the full blocks written counted too, no completion details.
        assert first["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": len(t1) // 16 * 16,
            "multimodal_tokens": None,
        }
        assert first["usage"]["completion_tokens_details"] is None
        want = expected_cached(t1, t2)
        assert want >= 64
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == want
        assert second["usage"]["prompt_tokens_details"]["created_cache_tokens"] == (
            len(t2) // 16 * 16 - want
        )
        assert second["usage"]["prompt_tokens"] == len(t2)

    run(main)


def test_cache_salt_isolates() -> None:
    async def main() -> None:
        body = {"model": "sim-llama", "messages": conversation(1), "cache_salt": "tenant-a"}
        async with pod() as (_, s):
            await post(s, "/v1/chat/completions", body)
            same = await post(s, "/v1/chat/completions", body)
            other = await post(s, "/v1/chat/completions", {**body, "cache_salt": "tenant-b"})
            unsalted = await post(
                s, "/v1/chat/completions", {"messages": conversation(1), "max_tokens": 1}
            )
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    run(main)


def test_chat_response_shape_and_filler() -> None:
    async def main() -> None:
        async with pod() as (_, s):
            out = await post(
                s,
                "/v1/chat/completions",
                {"messages": conversation(1), "max_completion_tokens": 7, "cache_prefix_id": "x"},
            )
            default = await post(s, "/v1/chat/completions", {"messages": conversation(1)})
            two = await post(
                s, "/v1/chat/completions", {"messages": conversation(1), "max_tokens": 3, "n": 2}
            )
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert out["model"] == "sim-llama"
        (choice,) = out["choices"]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["role"] == "assistant"
        assert len(encode(choice["message"]["content"])) == 7
        assert out["usage"]["completion_tokens"] == 7
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 7
        assert default["usage"]["completion_tokens"] == 16  # --max-tokens-default
        assert [c["index"] for c in two["choices"]] == [0, 1]
        assert two["usage"]["completion_tokens"] == 6

    run(main)


def test_streaming_matches_non_streaming() -> None:
    async def main() -> None:
        body = {"messages": conversation(1), "max_tokens": 6}
        async with pod() as (_, s):
            whole = await post(s, "/v1/chat/completions", body)
            plain = await stream(s, "/v1/chat/completions", {**body, "stream": True})
            counted = await stream(
                s,
                "/v1/chat/completions",
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            )
        text = whole["choices"][0]["message"]["content"]
        for events in (plain, counted):
            assert events[-1] == "[DONE]"
            chunks = [e for e in events[:-1] if e["choices"]]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
            assert "".join(pieces) == text
            finishes = [c["choices"][0]["finish_reason"] for c in chunks]
            assert finishes == [None] * (len(chunks) - 1) + ["length"]
            assert len({e["id"] for e in events[:-1]}) == 1
        assert not any("usage" in e for e in plain[:-1])
        usage = counted[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
        # The streamed request found the prompt that the first request cached.
        assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert not any("usage" in e for e in counted[:-2])

    run(main)


def test_completions_string_batch_and_token_ids() -> None:
    async def main() -> None:
        async with pod() as (_, s):
            one = await post(s, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3})
            batch = await post(
                s, "/v1/completions", {"prompt": ["a" * 40, "b" * 80], "max_tokens": 2}
            )
            ids = await post(s, "/v1/completions", {"prompt": list(range(40)), "max_tokens": 2})
            again = await post(s, "/v1/completions", {"prompt": [list(range(40))], "max_tokens": 2})
            streamed = await stream(
                s,
                "/v1/completions",
                {
                    "prompt": ["a" * 40, "b" * 80],
                    "max_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
        assert one["usage"]["prompt_tokens"] == len(encode("Once upon a time"))
        assert one["choices"][0]["text"] == "the and for"
        assert [c["index"] for c in batch["choices"]] == [0, 1]
        assert batch["usage"]["prompt_tokens"] == 10 + 20
        assert batch["usage"]["completion_tokens"] == 4
        assert ids["usage"]["prompt_tokens"] == 40
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        texts: dict[int, str] = {}
        for event in streamed[:-2]:
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == {0: "the and for", 1: "the and for"}
        assert streamed[-2]["usage"]["prompt_tokens"] == 30
        # 10 tokens: no full block below the last token; 20 tokens: one block.
        assert streamed[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 16

    run(main)


def test_metrics_move_by_the_right_amounts() -> None:
    async def main() -> None:
        async with pod(time_scale=0.001) as (_, s):
            before = await metrics(s)
            body = {"messages": conversation(1), "max_tokens": 5}
            first = await post(s, "/v1/chat/completions", body)
            second = await post(s, "/v1/chat/completions", body)
            after = await metrics(s)
            async with s.get("/metrics") as resp:
                text = await resp.text()
                content_type = resp.headers["Content-Type"]
        prompt = len(encode(render_chat(conversation(1))))
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt - 1) // 16 * 16

        def delta(name: str) -> float:
            key = name + '{engine="0",model_name="sim-llama"}'
            return after[key] - before[key]

        assert delta("vllm:prompt_tokens_total") == 2 * prompt
        assert delta("vllm:prefix_cache_queries_total") == 2 * prompt
        assert delta("vllm:prefix_cache_hits_total") == cached
        assert delta("vllm:prompt_tokens_cached_total") == cached
        assert delta("vllm:generation_tokens_total") == 10
        assert delta("vllm:time_to_first_token_seconds_count") == 2
        # Wall-clock seconds, as vLLM's: the simulated TTFTs on the pods' clock.
        simulated_s = (first[TTFT_FIELD] + second[TTFT_FIELD]) / 1000
        assert delta("vllm:time_to_first_token_seconds_sum") == pytest.approx(
            0.001 * simulated_s, rel=0.01
        )
        assert delta("vllm:num_requests_running") == 0
        assert after['vllm:kv_cache_usage_perc{engine="0",model_name="sim-llama"}'] == 0.0
        # Label names sorted, as vLLM 0.32 writes them; its five finish reasons.
        success = (
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-llama"}'
        )
        assert after[success] - before[success] == 2
        reasons = re.findall(r'vllm:request_success_total\{[^}]*finished_reason="(\w+)"', text)
        assert sorted(reasons) == ["abort", "error", "length", "repetition", "stop"]
        inf = 'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="sim-llama"}'
        assert after[inf] == 2
        info = re.search(r"vllm:cache_config_info\{([^}]*)\} 1\.0", text)
        assert info is not None
        config = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
        assert list(config) == sorted(config)
        # The KV size the router reads, in blocks and (vLLM 0.32's label) in tokens.
        assert (config["block_size"], config["num_gpu_blocks"]) == ("16", "8192")
        assert config["kv_cache_size_tokens"] == str(16 * 8192)
        assert content_type == "text/plain; version=1.0.0; charset=utf-8"
        for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert f"# TYPE {name} gauge" in text
        assert "# TYPE vllm:prefix_cache_hits_total counter" in text
        assert "# TYPE vllm:time_to_first_token_seconds histogram" in text

    run(main)


BAD_REQUESTS: list[tuple[str, Any, str | None]] = [
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": conversation(1), "max_tokens": "9"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": conversation(1), "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": conversation(1), "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": conversation(1), "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": conversation(1), "tools": {}}, "tools"),
    (
        "/v1/chat/completions",
        {"messages": conversation(1), "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 200_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": 5}, "model"),
    ("/tokenize", {}, "prompt"),
]


@pytest.mark.parametrize("salt", ["", "x" * 129, "a@b", "a/b", "a\\b", "a\x00b", 7, ["a"]])
def test_invalid_cache_salt_is_a_400(salt: Any) -> None:
    async def main() -> None:
        async with pod() as (_, s):
            body = {"messages": conversation(1), "cache_salt": salt}
            err = await post(s, "/v1/chat/completions", body, status=400)
            ok = await post(s, "/v1/completions", {"prompt": "hi", "cache_salt": "x" * 128})
        assert err["error"]["type"] == "BadRequestError"
        assert err["error"]["param"] == "cache_salt"
        assert err["error"]["code"] == 400
        assert ok["usage"]["prompt_tokens"] == 1

    run(main)


def test_error_envelopes() -> None:
    async def main() -> None:
        async with pod() as (_, s):
            for path, body, param in BAD_REQUESTS:
                err = await post(s, path, body, status=400)
                assert set(err) == {"error"}, (path, body)
                assert err["error"]["type"] == "BadRequestError", (path, body)
                assert err["error"]["code"] == 400
                assert err["error"]["param"] == param, (path, body, err)
                assert err["error"]["message"]
            async with s.post("/v1/chat/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["type"] == "BadRequestError"
            async with s.post("/v1/completions", data=b"[1, 2]") as resp:
                assert resp.status == 400
            for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
                body = {"model": "gpt-9", "messages": conversation(1), "prompt": "hi"}
                err = await post(s, path, body, status=404)
                assert err == {
                    "error": {
                        "message": "The model `gpt-9` does not exist.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
                }
            # Nothing was admitted by the failures.
            assert (await post(s, "/v1/completions", {"prompt": "ok"}))["usage"]["prompt_tokens"]

    run(main)


def test_answers_are_cut_to_the_context_left_as_vllm_does() -> None:
    """vLLM 0.32 (seen on the real pod): a max_tokens over the context length, or a prompt
    over it, is a 400; otherwise the answer is cut to the room left, and a prompt that
    leaves none is a 400 about max_tokens."""

    messages = [{"role": "user", "content": "x" * 250}]
    prompt = len(encode(render_chat(messages)))
    assert 84 < prompt < 100

    async def main() -> None:
        async with pod(max_model_len=100) as (_, s):
            cut = await post(s, "/v1/completions", {"prompt": list(range(95)), "max_tokens": 50})
            default = await post(s, "/v1/completions", {"prompt": list(range(90))})
            batch = await post(
                s, "/v1/completions", {"prompt": [list(range(97)), [1, 2]], "max_tokens": 8}
            )
            streamed = await stream(
                s,
                "/v1/chat/completions",
                {
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            full = await post(s, "/v1/completions", {"prompt": list(range(100))}, status=400)
            over = await post(s, "/v1/completions", {"prompt": list(range(101))}, status=400)
            asked = await post(s, "/v1/completions", {"prompt": [1], "max_tokens": 101}, status=400)
        assert cut["usage"]["completion_tokens"] == 5
        assert cut["choices"][0]["finish_reason"] == "length"
        assert default["usage"]["completion_tokens"] == 10  # the default 16, cut to 10
        assert batch["usage"]["completion_tokens"] == 3 + 8
        assert [c["text"] for c in batch["choices"]] == ["the and for", filler_text(8)]
        assert streamed[-2]["usage"]["prompt_tokens"] == prompt
        chunks = [e for e in streamed[:-2] if e["choices"]][1:]  # after the role chunk
        assert len(chunks) == 100 - prompt == streamed[-2]["usage"]["completion_tokens"]
        assert full["error"]["param"] == "max_tokens"
        assert "at least 1, got 0" in full["error"]["message"]
        assert over["error"]["param"] == "input_tokens"
        assert asked["error"]["param"] == "max_tokens"

    run(main)


def test_served_names_and_usage_shapes_follow_vllm() -> None:
    async def main() -> None:
        async with pod(model="tiny", aliases=("sim-llama",)) as (_, s):
            chat = await post(
                s, "/v1/chat/completions", {"model": "sim-llama", "messages": conversation(1)}
            )
            text = await post(s, "/v1/completions", {"model": "tiny", "prompt": "hello"})
            await post(s, "/v1/completions", {"model": "sim", "prompt": "hello"}, status=404)
            async with s.get("/v1/models") as resp:
                models = await resp.json()
            usage = {"stream": True, "stream_options": {"include_usage": True}}
            chat_stream = await stream(
                s, "/v1/chat/completions", {"messages": conversation(1), **usage}
            )
            text_stream = await stream(s, "/v1/completions", {"prompt": "hello", **usage})
            async with s.post("/v1/completions", json={"prompt": "a", **usage}) as resp:
                content_type = resp.headers["Content-Type"]
                assert "Cache-Control" not in resp.headers
                await resp.read()
        # Answers and metrics say the first name; requests may use any.
        assert chat["model"] == text["model"] == "tiny"
        assert [m["id"] for m in models["data"]] == ["tiny", "sim-llama"]
        assert {m["root"] for m in models["data"]} == {"tiny"}
        # Completions leave created_cache_tokens null; streams drop the null fields.
        assert text["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
        chat_details = chat_stream[-2]["usage"]["prompt_tokens_details"]
        assert set(chat_details) == {"cached_tokens", "created_cache_tokens"}
        assert chat_details["cached_tokens"] > 0
        assert "completion_tokens_details" not in chat_stream[-2]["usage"]
        assert text_stream[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert content_type == "text/event-stream; charset=utf-8"

    run(main)


def test_reset_prefix_cache_answers_success_and_empties_the_cache() -> None:
    async def main() -> None:
        body = {"messages": conversation(1), "max_tokens": 1}
        async with pod() as (_, s):
            await post(s, "/v1/chat/completions", body)
            warm = await post(s, "/v1/chat/completions", body)
            assert await post(s, "/reset_prefix_cache", None) == {"success": True}
            cold = await post(s, "/v1/chat/completions", body)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    run(main)


def test_request_larger_than_the_kv_cache_is_a_400() -> None:
    async def main() -> None:
        async with pod(num_gpu_blocks=4) as (_, s):
            err = await post(s, "/v1/completions", {"prompt": "x" * 400}, status=400)
        assert "KV blocks" in err["error"]["message"]

    run(main)


def test_tokenize_render_and_info_endpoints() -> None:
    async def main() -> None:
        messages = conversation(2)
        want = encode(render_chat(messages))
        async with pod() as (server, s):
            async with s.get("/health") as resp:
                assert resp.status == 200 and await resp.read() == b""
                assert resp.headers["x-sim-pod"] == "pod-0"
            async with s.get("/v1/models") as resp:
                models = await resp.json()
            tok = await post(s, "/tokenize", {"messages": messages})
            tok_prompt = await post(s, "/tokenize", {"prompt": "hello world"})
            chat = await post(s, "/v1/chat/completions/render", {"messages": messages})
            salted = await post(
                s, "/v1/chat/completions/render", {"messages": messages, "cache_salt": "t1"}
            )
            await post(
                s, "/v1/completions/render", {"prompt": "a", "cache_salt": "a/b"}, status=400
            )
            async with s.post("/v1/completions/render", json={"prompt": ["ab", "cd"]}) as resp:
                rendered = await resp.json()
            async with s.post("/v1/completions/render", json={"prompt": [1, 2]}) as resp:
                rendered_ids = await resp.json()
            async with s.get("/get_load") as resp:
                load = await resp.json()
            async with s.get("/server_info") as resp:
                info = await resp.json()
            async with s.get("/version") as resp:
                assert "version" in await resp.json()
            async with s.get("/debug/requests") as resp:
                assert resp.status == 404  # recording is off by default
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["sim-llama"]
        assert tok == {
            "count": len(want),
            "max_model_len": 131072,
            "tokens": want,
            "token_strs": None,
        }
        assert tok_prompt["tokens"] == encode("hello world")
        assert chat["token_ids"] == want and "cache_salt" not in chat
        assert salted["token_ids"] == want and salted["cache_salt"] == "t1"
        assert [r["token_ids"] for r in rendered] == [encode("ab"), encode("cd")]
        assert [r["token_ids"] for r in rendered_ids] == [[1, 2]]
        assert load == {"load": 0}
        assert info["pod_id"] == "pod-0" and info["block_size"] == 16
        assert server.pod.engine.running == 0

    run(main)


def test_get_load_counts_running_and_waiting() -> None:
    async def main() -> None:
        async with pod(time_scale=0.2, tpot_ms=1.0, max_num_seqs=1) as (server, s):
            body = {"prompt": "x" * 40_000, "max_tokens": 1}
            tasks = [asyncio.create_task(post(s, "/v1/completions", body)) for _ in range(2)]
            for _ in range(200):
                async with s.get("/get_load") as resp:
                    if (await resp.json())["load"] == 2:
                        break
                await asyncio.sleep(0.005)
            else:
                pytest.fail("the load never reached 2")
            engine = server.pod.engine
            assert (engine.running, engine.waiting) == (1, 1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(main)


def test_time_scale_orders_ttft() -> None:
    async def ttft(scale: float) -> float:
        async with pod(time_scale=scale, tpot_ms=0.0) as (_, s):
            loop = asyncio.get_running_loop()
            begin = loop.time()
            body = {"prompt": "y" * 16_000, "max_tokens": 1, "stream": True}
            async with s.post("/v1/completions", json=body) as resp:
                await resp.content.readuntil(b"\n\n")
                return loop.time() - begin

    async def main() -> None:
        # At the model's own pace the 4000-token prompt takes a few hundred ms: well above
        # what a loaded CI machine adds to an unscaled (instant) pod's answer.
        slow = await ttft(1.0)
        fast = await ttft(0.0)
        assert slow > fast
        # The model TTFT of 4000 uncached tokens, scaled: the sleep never ends early.
        assert slow >= get_model(DEFAULT_MODEL).ttft_ms(4000) / 1000 * 0.9

    run(main)


def test_answers_carry_the_engines_ttft_on_its_simulated_clock() -> None:
    """``sim_ttft_ms`` sits next to the usage: for a request alone on an idle pod, the TTFT
    model's figure for its uncached and cached tokens, at any time scale; queueing behind
    another prefill adds to it; a request of several prompts reports its first token's."""
    model = get_model(DEFAULT_MODEL)

    def alone(answer: dict[str, Any]) -> float:
        use = answer["usage"]
        cached = use["prompt_tokens_details"]["cached_tokens"]
        return model.ttft_ms(use["prompt_tokens"] - cached, cached)

    async def main() -> None:
        doc = [{"role": "system", "content": "alpha " * 3000}]  # past the step floor
        turn = [{"role": "user", "content": "first?"}]
        more = [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "then?"}]
        async with pod(time_scale=0.002) as (_, s):
            first = await post(s, "/v1/chat/completions", {"messages": doc + turn})
            body = {"messages": doc + turn + more, "stream": True, "max_tokens": 3}
            streamed = await stream(
                s, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
            )
            plain = await stream(s, "/v1/chat/completions", body)
            batch = await post(
                s, "/v1/completions", {"prompt": ["x " * 3000, "y " * 50], "max_tokens": 2}
            )
        # At the model's own pace, a long prompt sent while another's prefill runs waits
        # for it: its TTFT counts that wait. Each prefill takes ~480 ms, so the second
        # still waits most of the first's though a loaded machine delays its sending
        # (with ~140 ms prefills, a CI run once saw it arrive near the first's end).
        async with pod(time_scale=1.0) as (_, s):

            async def long(c: str, after_s: float) -> dict[str, Any]:
                await asyncio.sleep(after_s)
                body = {"prompt": f"{c} " * 20000, "max_tokens": 1}
                return await post(s, "/v1/completions", body)

            queued = await asyncio.gather(long("p", 0.0), long("q", 0.03))
        assert first["sim_ttft_ms"] == pytest.approx(alone(first), abs=0.01)
        last = streamed[-2]
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert last["sim_ttft_ms"] == pytest.approx(alone(last), abs=0.01)
        assert last["sim_ttft_ms"] < first["sim_ttft_ms"]  # warm: less to prefill
        assert not any("sim_ttft_ms" in e for e in plain[:-1])  # no usage, no figure
        # Both prompts' prefills run in one batch: its end brings either's first token.
        x, y = len(encode("x " * 3000)), len(encode("y " * 50))
        assert model.ttft_ms(x) < batch["sim_ttft_ms"] <= model.ttft_ms(x + y) + 0.01
        low, high = (q["sim_ttft_ms"] for q in queued)
        assert low == pytest.approx(alone(queued[0]), rel=0.01)
        assert high > 1.5 * low  # its own prefill after most of the other's

    run(main)


def test_record_keeps_the_last_n_requests() -> None:
    async def main() -> None:
        async with pod(record=2) as (_, s):
            for i in range(3):
                async with s.post(
                    "/v1/completions",
                    json={"prompt": f"p{i}", "max_tokens": 1},
                    headers={"X-Route-Tag": f"t{i}"},
                ) as resp:
                    assert resp.status == 200
            async with s.get("/health"), s.get("/metrics"):
                pass  # polled paths are not recorded
            async with s.get("/debug/requests") as resp:
                records = await resp.json()
            async with s.delete("/debug/requests") as resp:
                assert (await resp.json()) == {"cleared": 2}
            async with s.get("/debug/requests") as resp:
                assert await resp.json() == []
        assert [r["headers"]["x-route-tag"] for r in records] == ["t1", "t2"]
        assert records[0]["path"] == "/v1/completions" and records[0]["method"] == "POST"
        assert json.loads(records[1]["body"]) == {"prompt": "p2", "max_tokens": 1}

    run(main)


def test_client_disconnect_mid_stream_frees_the_request() -> None:
    async def main() -> None:
        async with pod(time_scale=1.0, tpot_ms=5.0) as (server, s):
            body = {"messages": conversation(1), "max_tokens": 1000, "stream": True}
            async with s.post("/v1/chat/completions", json=body) as resp:
                await resp.content.readuntil(b"\n\n")
                resp.close()
            engine = server.pod.engine
            for _ in range(200):
                if engine.running == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.running == 0
            assert server.pod.cache.used_blocks == 0
            assert engine.stats.finished.get("abort") == 1

    run(main)


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.pod_id, args.model) == (
        "127.0.0.1",
        8001,
        "pod-0",
        ["sim-llama"],
    )
    assert config_from_args(args) == SimConfig()
    named = config_from_args(parser.parse_args(["--model", "tiny", "sim-llama"]))
    assert (named.model, named.aliases) == ("tiny", ("sim-llama",))
    args = parser.parse_args(["--pod-id", "pod-3", "--time-scale", "0.5", "--record", "10"])
    config = config_from_args(args)
    assert (config.pod_id, config.time_scale, config.record) == ("pod-3", 0.5, 10)
    for bad in (["--time-scale", "-1"], ["--block-size", "0"], ["--ttft-model", "nope"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_module_runs_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "ace_extproc.sim", "--port", "0", "--pod-id", "pod-7"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.fullmatch(r"sim pod-7 listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, line

        async def check() -> None:
            async with aiohttp.ClientSession() as s, s.get(match.group(1) + "/health") as resp:
                assert resp.status == 200
                assert resp.headers["x-sim-pod"] == "pod-7"

        asyncio.run(check())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
