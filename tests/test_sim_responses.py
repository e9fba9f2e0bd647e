"""The simulated pod's Responses API (sim/responses.py) over real HTTP: vLLM 0.32's
bodies and event sequence, its per-process store and its 404, behind the same
prefix cache as chat."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from ace_extproc.sim.app import SimConfig, SimServer, add_arguments, config_from_args
from ace_extproc.sim.responses import STORE_ENV, store_enabled

SYSTEM = "You are a meticulous assistant. " * 8  # several full blocks

# vLLM 0.32's ResponsesResponse, field by field in its order (dumped from its models).
RESPONSE_FIELDS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
    "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p",
    "background", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt",
    "reasoning", "service_tier", "status", "text", "top_logprobs", "truncation", "usage",
    "user", "presence_penalty", "frequency_penalty", "kv_transfer_params",
    "ec_transfer_params", "input_messages", "output_messages",
]  # fmt: skip
# A text answer's events, as vLLM's simple (non-harmony) path emits them.
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 3,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@asynccontextmanager
async def pods(n: int = 1, store: bool = True) -> AsyncIterator[list[aiohttp.ClientSession]]:
    config = SimConfig(time_scale=0.0, tpot_ms=1.0, responses_store=store)
    servers = [SimServer(config) for _ in range(n)]
    for server in servers:
        await server.start()
    sessions = [aiohttp.ClientSession(server.url) for server in servers]
    try:
        yield sessions
    finally:
        for session in sessions:
            await session.close()
        for server in servers:
            await server.stop()


async def respond(session: aiohttp.ClientSession, status: int = 200, **body: Any) -> dict[str, Any]:
    async with session.post("/v1/responses", json=body) as resp:
        assert resp.status == status, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def events(session: aiohttp.ClientSession, **body: Any) -> list[tuple[str, dict[str, Any]]]:
    async with session.post("/v1/responses", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = (await resp.read()).decode()
    out = []
    for block in raw.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            out.append((kind[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


def run(test: Any) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def test_an_answer_has_vllm_s_shape_and_usage() -> None:
    async def main() -> None:
        async with pods() as (s,):
            a = await respond(s, input="Hi", instructions=SYSTEM, max_output_tokens=4)
            assert list(a)[: len(RESPONSE_FIELDS)] == RESPONSE_FIELDS
            assert a["id"].startswith("resp_") and len(a["id"]) == len("resp_") + 16
            assert (a["object"], a["status"], a["model"]) == ("response", "incomplete", "sim-llama")
            assert a["incomplete_details"] == {"reason": "max_output_tokens"}
            (message,) = a["output"]
            assert message["type"] == "message" and message["role"] == "assistant"
            assert message["content"][0]["type"] == "output_text"
            use = a["usage"]
            assert use["output_tokens"] == 4 and use["total_tokens"] == use["input_tokens"] + 4
            details = use["input_tokens_details"]
            assert details["cached_tokens"] == 0 and details["cache_write_tokens"] > 0
            assert a["tool_choice"] == "none" and a["tools"] == []  # vLLM's, without tools

    run(main)


def test_the_stream_is_vllm_s_event_sequence_ending_with_the_whole_response() -> None:
    async def main() -> None:
        async with pods() as (s,):
            got = await events(s, input="Hi", instructions=SYSTEM, max_output_tokens=3)
            assert [kind for kind, _ in got] == EVENTS
            for seq, (kind, data) in enumerate(got):
                assert data["type"] == kind and data["sequence_number"] == seq
                assert list(data) == sorted(data)  # the OpenAI types' field order
            created, final = got[0][1]["response"], got[-1][1]["response"]
            assert created["id"] == final["id"] and created["status"] == "in_progress"
            assert created["output"] == [] and created["usage"] is None
            text = "".join(d["delta"] for k, d in got if k == "response.output_text.delta")
            assert final["output"][0]["content"][0]["text"] == text
            assert final["usage"]["output_tokens"] == 3

    run(main)


def test_a_stored_response_continues_on_its_own_pod_only() -> None:
    """previous_response_id: the stored turn's conversation and answer come first, so
    its blocks are cached (same salt); another pod, or a store left off, answers vLLM's
    404."""

    async def main() -> None:
        async with pods(2) as (home, other):
            first = await respond(home, input="Question one?", instructions=SYSTEM, cache_salt="s")
            rid = first["id"]
            second = await respond(home, input="Two?", previous_response_id=rid, cache_salt="s")
            assert second["previous_response_id"] == rid
            alone = await respond(home, input="Two?", cache_salt="s")
            # The stored turn (without its instructions) and its answer, then the new input.
            assert second["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 4
            prompt = first["usage"]["input_tokens"]
            # Its instructions do not carry over: the stored system message is dropped,
            # so the cached prefix is only what the turns share from the start.
            again = await respond(
                home, input="Two?", instructions=SYSTEM, previous_response_id=rid, cache_salt="s"
            )
            cached = again["usage"]["input_tokens_details"]["cached_tokens"]
            assert cached >= prompt // 16 * 16 - 16 and cached > 0
            missing = await respond(other, 404, input="Two?", previous_response_id=rid)
            assert missing == {
                "error": {
                    "message": f"Response with id '{rid}' not found.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 404,
                }
            }
            unstored = await respond(home, input="x", store=False)
            await respond(home, 404, input="y", previous_response_id=unstored["id"])
            streamed = await events(home, input="Three?", previous_response_id=rid)
            await respond(
                home, input="Four?", previous_response_id=streamed[0][1]["response"]["id"]
            )
        async with pods(store=False) as (off,):
            kept = await respond(off, input="x")
            await respond(off, 404, input="y", previous_response_id=kept["id"])

    run(main)


def test_a_conversation_sent_as_responses_reuses_the_blocks_of_its_chat() -> None:
    """The same conversation renders alike in both APIs, on the same prefix cache."""

    async def main() -> None:
        async with pods() as (s,):
            async with s.post(
                "/v1/chat/completions",
                json={
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Hi"},
                    ],
                    "max_tokens": 1,
                },
            ) as resp:
                chat = await resp.json()
            items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
            answer = await respond(s, input=items, instructions=SYSTEM)
            prompt = chat["usage"]["prompt_tokens"]
            assert answer["usage"]["input_tokens"] == prompt
            assert (
                answer["usage"]["input_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
            )

    run(main)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"input": 5},
        {"input": [{"type": "web_search_call"}]},
        {"input": [5]},
        {"input": "x", "stream": "yes"},
        {"input": "x", "max_output_tokens": 0},
        {"input": "x", "cache_salt": "a/b"},
        {"input": "x", "background": True},
    ],
)
def test_bad_requests_are_400s(body: dict[str, Any]) -> None:
    async def main() -> None:
        async with pods() as (s,):
            answer = await respond(s, 400, **body)
            assert answer["error"]["code"] == 400

    run(main)


def test_the_store_follows_vllm_s_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not store_enabled({}) and not store_enabled({STORE_ENV: "0"})
    assert store_enabled({STORE_ENV: "1"}) and not store_enabled({STORE_ENV: "yes"})
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv(STORE_ENV, "1")
    assert config_from_args(parser.parse_args([])).responses_store
