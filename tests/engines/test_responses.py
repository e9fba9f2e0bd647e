"""The Responses API on real vLLM servers (their store on:
VLLM_ENABLE_RESPONSES_API_STORE=1): a turn naming a stored response is served only by the
server that stored it, and ace-extproc sends every such turn there."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ace_extproc.vllm_pods import Pods
from tests.engines.conftest import document, front, post, trace


def turn(topic: str, text: str, previous: str | None = None) -> dict[str, Any]:
    # Instructions do not carry over to a continuation: resent, so they stay cached.
    body: dict[str, Any] = {
        "model": "tiny",
        "instructions": document(topic, 60),
        "input": text,
        "max_output_tokens": 2,
    }
    if previous is not None:
        body["previous_response_id"] = previous
    return body


def test_turns_continuing_a_stored_response_go_to_the_server_that_stored_it(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    with front(pods, loop) as ace:
        for topic in ("billing", "shipping", "returns"):
            status, headers, body = ace.post("/v1/responses", turn(topic, f"{topic}: hello"))
            assert status == 200, body
            home, previous = headers["x-ace-served-by"], json.loads(body)["id"]
            for i in range(3):
                status, headers, body = ace.post(
                    "/v1/responses", turn(topic, f"{topic}: question {i}", previous)
                )
                assert status == 200, body
                assert headers["x-ace-served-by"] == home
                assert trace(headers)["previous_response"] == "pinned"
                answer = json.loads(body)
                assert answer["usage"]["input_tokens_details"]["cached_tokens"] > 0
                previous = answer["id"]
            # The other server has never heard of it: the engine's own 404.
            index = int(home.rsplit("-", 1)[1])  # vllm/pod-<i>: pods.urls[i]
            other = pods.urls[(index + 1) % len(pods.urls)]
            status, _, body = loop.run_until_complete(
                post(other, "/v1/responses", turn(topic, "again", previous))
            )
            assert status == 404 and "not found" in json.loads(body)["error"]["message"]
