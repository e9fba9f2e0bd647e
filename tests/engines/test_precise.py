"""Precise routing on real vLLM servers: the router's token ids are the engine's (its
KV events say so, block for block), and what another gateway placed is found."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ace_extproc.config import TenantConfig
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.tenants import Tenants
from ace_extproc.tokens import ModelTokens, block_keys, chain_seed
from ace_extproc.vllm_pods import BLOCK_SIZE, Pods
from tests.engines.conftest import (
    SALT_SECRET,
    cached,
    document,
    following,
    front,
    post,
    trace,
    usage,
)

CHAT = "/v1/chat/completions"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find an order.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    }
]


def bodies(salt: str) -> list[tuple[str, dict[str, Any]]]:
    doc = document("precise")
    chat = [{"role": "system", "content": doc}, {"role": "user", "content": "Summarize it."}]
    turns = [*chat, {"role": "assistant", "content": "It says things. " * 20}]
    parts = [{"type": "text", "text": doc[:2000]}, {"type": "text", "text": doc[2000:4000]}]
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": "7"}'}}
    ]
    # A long message cut into segments (lines ending in a letter or digit), a document
    # and its question in one message as the suite sends them.
    notes = "\n".join(
        f"[{i}] the {salt} handbook says check the ledger {i} times" for i in range(400)
    )
    question = f"{notes}\n\nQuestion: which line says 7 times?\nAnswer:"
    cases: list[tuple[str, dict[str, Any]]] = [
        ("chat", {"messages": chat}),
        ("docqa", {"messages": [{"role": "user", "content": question}]}),
        ("turns", {"messages": [*turns, {"role": "user", "content": "And then?"}]}),
        ("tools", {"messages": chat, "tools": TOOLS}),
        ("parts", {"messages": [{"role": "user", "content": parts}]}),
        (
            "tool-calls",
            {
                "messages": [
                    *chat,
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "c1", "content": "order 7: shipped"},
                ],
                "tools": TOOLS,
            },
        ),
    ]
    return [
        (name, {"model": "tiny", "max_tokens": 1, "cache_salt": f"{salt}-{name}", **body})
        for name, body in cases
    ]


def test_the_routers_token_ids_are_the_engines(pods: Pods, loop: asyncio.AbstractEventLoop) -> None:
    """Each body sent straight to a server: the blocks its events report stored are,
    keyed from their token ids, exactly the keys the router computes from the body with
    the model's own template and tokenizer, and as many as the prompt's full blocks."""
    tokens = ModelTokens(pods.options.model)
    index = PreciseIndex()

    cases = bodies(f"exact-{time.time_ns()}")
    # Off the event loop: there a long new document is tokenized aside (not keyed).
    expected = {name: tokens.token_ids(CHAT, json.dumps(body).encode()) for name, body in cases}

    async def go() -> list[tuple[str, int, int, int]]:
        stream = await following(pods, index)
        out = []
        for name, body in cases:
            status, _, answer = await post(pods.urls[0], CHAT, body)
            assert status == 200, answer
            ids = expected[name]
            assert ids is not None, name
            keys = block_keys(ids, BLOCK_SIZE, chain_seed(body["cache_salt"]))
            await asyncio.sleep(0.3)  # its events arrive
            depth = index.match(keys, 1).get(0, (0, 0))[0]
            out.append((name, len(ids), usage(answer)["prompt_tokens"], depth))
        await stream.stop()
        return out

    for name, ours, engines, depth in loop.run_until_complete(go()):
        assert ours == engines, (name, ours, engines)
        assert depth == ours // BLOCK_SIZE, (name, depth, ours)


def test_what_another_gateway_placed_is_found_and_other_salts_are_not(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    salt = Tenants(TenantConfig(), SALT_SECRET.encode()).salt("anon")
    with front(pods, loop, precise=True) as ace:
        deadline = time.monotonic() + 30
        while ace.metrics().count('state="precise"} 1.0') < len(pods.urls):
            assert time.monotonic() < deadline, "the servers' events never followed"
            time.sleep(0.1)
        for i, url in enumerate(pods.urls):
            messages = [
                {"role": "system", "content": document(f"elsewhere-{i}")},
                {"role": "user", "content": "What is it about?"},
            ]
            # Another gateway's replica, salting for the same tenant, sends it to pod i.
            body = {"model": "tiny", "messages": messages, "max_tokens": 1, "cache_salt": salt}
            assert ace.run(post(url, CHAT, body))[0] == 200
            # A stranger's salt on the other pod: the same prompt, nobody's to find.
            other = pods.urls[1 - i]
            stranger = {**body, "cache_salt": "not-issued-by-ace"}
            assert ace.run(post(other, CHAT, stranger))[0] == 200
            time.sleep(0.3)
            status, headers, answer = ace.chat(messages)
            assert status == 200 and headers["x-ace-served-by"] == f"vllm/pod-{i}"
            assert trace(headers)["action"] == "hit" and cached(answer) > 0
