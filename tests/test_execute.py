"""The native API, ``POST /v1/execute``: envelope validation, and round trips through
the real Envoy to simulated engines with the trace, in each mode and on errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from ace_extproc import execute
from ace_extproc.config import Mode
from tests.test_e2e import Client, conversation, options, running


def envelope(messages: list[dict[str, Any]], mode: str | None = None, **chat: Any) -> Any:
    doc: dict[str, Any] = {
        "input": {"messages": messages, "max_tokens": 4, **chat},
        "target": {"model": "sim-llama"},
    }
    if mode is not None:
        doc["skill_overrides"] = {"prefix_kv_cache": {"mode": mode}}
    return doc


def test_an_envelope_becomes_a_chat_completion() -> None:
    chat, mode = execute.to_chat(
        json.dumps(envelope([{"role": "user", "content": "hi"}], "shadow")).encode()
    )
    assert mode is Mode.SHADOW
    assert json.loads(chat) == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "model": "sim-llama",
    }


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        (b"not json", "body"),
        (b"[1, 2]", "body"),
        (b'{"input": ' + b"[" * 1000 + b"]" * 1000 + b"}", "body"),  # was a RecursionError
        ({"target": {"model": "m"}}, "input"),
        ({"input": {"messages": []}, "target": {"model": "m"}}, "input.messages"),
        ({"input": {"messages": ["hi"]}, "target": {"model": "m"}}, "input.messages"),
        (
            {"input": {"messages": [{"role": "user"}], "stream": True}, "target": {"model": "m"}},
            "input.stream",
        ),
        ({"input": {"messages": [{"role": "user"}]}}, "target"),
        ({"input": {"messages": [{"role": "user"}]}, "target": {"model": 7}}, "target.model"),
        ({"input": {"messages": [{"role": "user"}]}, "target": {"model": ""}}, "target.model"),
        (
            {
                "input": {"messages": [{"role": "user"}]},
                "target": {"model": "m"},
                "skill_overrides": {"prefix_kv_cache": {"mode": "turbo"}},
            },
            "skill_overrides.prefix_kv_cache.mode",
        ),
        (
            {
                "input": {"messages": [{"role": "user"}]},
                "target": {"model": "m"},
                "skill_overrides": [],
            },
            "skill_overrides",
        ),
    ],
)
def test_invalid_envelopes_name_the_field(doc: Any, param: str) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(execute.EnvelopeError) as err:
        execute.to_chat(raw)
    assert err.value.param == param
    error = json.loads(err.value.body())["error"]
    assert error["param"] == param and error["code"] == 400


def test_engine_errors_and_plain_text_replies_keep_their_status() -> None:
    entry = execute.trace("prod", "hit", "k", 10, 2.0)
    wrapped = json.loads(execute.wrap(404, b'{"error": {"message": "no such model"}}', entry))
    assert wrapped == {
        "output": None,
        "error": {"message": "no such model"},
        "status": 404,
        "trace": [entry],
    }
    text = json.loads(execute.wrap(503, b"upstream connect error", entry))
    assert text["error"] == "upstream connect error" and text["status"] == 503


# ---------------------------------------------------------------- through Envoy


@pytest.fixture(scope="module")
def stack() -> Iterator[Client]:
    with running(options()) as client:
        yield client


def run(client: Client, doc: Any, **headers: str) -> tuple[int, dict[str, str], Any]:
    status, hdrs, body = client.post("/v1/execute", doc, **headers)
    return status, hdrs, json.loads(body)


@pytest.mark.envoy
def test_execute_round_trips_with_a_trace_that_matches_the_engine(stack: Client) -> None:
    traces = []
    for turn in range(3):
        status, headers, doc = run(stack, envelope(conversation(turn, "execute")))
        assert status == 200, doc
        assert doc["output"]["object"] == "chat.completion"
        (entry,) = doc["trace"]
        traces.append(entry)
        assert entry["skill"] == "prefix_kv_cache" and entry["mode"] == "prod"
        assert headers["content-type"] == "application/json"
        # The trace's estimate against what the engine itself reports as reused.
        cached = doc["output"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        if turn:
            assert entry["action"] == "hit" and entry["saved_prefill_tokens"] > 0
            assert cached >= entry["saved_prefill_tokens"] * 0.8
            assert entry["estimated_ttft_speedup"] > 1.0
    assert traces[0]["action"] == "miss" and traces[0]["saved_prefill_tokens"] == 0
    assert len({t["prefix_key"] for t in traces}) == 3  # each turn's prefix is new
    # The engine got a chat completion on its chat path, with the router's fields.
    records = [r for recs in stack.records().values() for r in recs]
    assert records and all(r["path"] == "/v1/chat/completions" for r in records[-3:])


@pytest.mark.envoy
def test_execute_in_shadow_and_off_still_reaches_the_engine(stack: Client) -> None:
    for mode, action in (("shadow", "miss"), ("off", "off")):
        status, _, doc = run(stack, envelope(conversation(0, f"exec-{mode}"), mode))
        assert status == 200, doc
        assert doc["output"]["choices"]
        assert doc["trace"][0]["mode"] == mode and doc["trace"][0]["action"] == action


@pytest.mark.envoy
def test_execute_errors_come_back_in_the_envelope(stack: Client) -> None:
    status, _, doc = run(stack, {"input": {"messages": []}, "target": {"model": "sim-llama"}})
    assert status == 400 and doc["error"]["param"] == "input.messages"
    status, _, doc = run(stack, b"{")
    assert status == 400 and doc["error"]["param"] == "body"
    # An engine error: the sim fleet's one destination takes every model, so the pod
    # answers 404 for one it does not serve; status and error come back enveloped.
    doc_in = envelope(conversation(0, "nomodel"))
    doc_in["target"]["model"] = "no-such-model"
    status, _, doc = run(stack, doc_in)
    assert status == 404, doc
    assert doc["output"] is None and doc["status"] == 404 and doc["error"]
    assert doc["trace"][0]["mode"] == "prod"
    # A body that exceeds the engine's context gets the engine's 400, enveloped.
    status, _, doc = run(stack, envelope(conversation(0, "big"), max_tokens=10**9))
    assert status == 400 and doc["status"] == 400 and doc["output"] is None
