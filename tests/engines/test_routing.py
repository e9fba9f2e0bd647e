"""Routing on real vLLM servers: the engine, not the router, says what was cached."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from ace_extproc.vllm_pods import BLOCK_SIZE, Pods
from tests.engines.conftest import cached, document, front, trace, usage

KEYS = {"key-acme": "acme", "key-globex": "globex"}


def conversation(topic: str, turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": document(topic)}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"{topic}: question {i}, in some detail. " * 8})
        msgs.append({"role": "assistant", "content": f"{topic}: answer {i}. " * 12})
    msgs.append({"role": "user", "content": f"{topic}: and the last question?"})
    return msgs


def test_turns_of_a_conversation_stick_to_one_pod_and_the_engine_reports_them_cached(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    with front(pods, loop) as ace:
        for topic in ("billing", "shipping", "returns", "warranty"):
            served, hits = [], []
            for turn in range(3):
                status, headers, body = ace.chat(conversation(topic, turn))
                assert status == 200, body
                served.append(headers["x-ace-served-by"])
                hits.append((cached(body), usage(body)["prompt_tokens"]))
            assert len(set(served)) == 1, (topic, served)
            assert hits[0][0] == 0
            for got, prompt in hits[1:]:
                # The earlier turn's prompt is this one's prefix: all of it, in whole
                # blocks, is the engine's cache hit.
                assert got % BLOCK_SIZE == 0 and got >= 0.8 * prompt, hits


def test_new_conversations_spread_over_the_pods(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    with front(pods, loop) as ace:
        served = Counter(
            ace.chat(conversation(f"spread-{i}", 0))[1]["x-ace-served-by"] for i in range(12)
        )
    assert len(served) == len(pods.urls), served


def test_two_tenants_identical_prompts_never_share_cached_tokens(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    router = {"tenants": {"api_keys": KEYS}}
    prompts = [conversation(f"shared-{i}", 1) for i in range(6)]
    with front(pods, loop, router=router) as ace:
        acme = [ace.chat(p, authorization="Bearer key-acme") for p in prompts]
        globex = [ace.chat(p, authorization="Bearer key-globex") for p in prompts]
        again = [ace.chat(p, authorization="Bearer key-globex") for p in prompts]
    assert all(s == 200 for s, _, _ in acme + globex + again)
    same_pod = [
        a[1]["x-ace-served-by"] == g[1]["x-ace-served-by"]
        for a, g in zip(acme, globex, strict=True)
    ]
    assert any(same_pod)  # the case that matters: acme's blocks are warm right there
    assert all(cached(b) == 0 for _, _, b in globex), [cached(b) for _, _, b in globex]
    assert all(cached(b) > 1000 for _, _, b in again)  # globex's own are reused


def test_a_client_cache_salt_or_prefix_id_changes_nothing(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    """A client cannot opt out of its tenant's salt, nor reach another's cache by naming
    its prefix: the router replaces both fields before the engine sees them."""
    router = {"tenants": {"api_keys": KEYS}}
    msgs = conversation("salted", 1)
    with front(pods, loop, router=router) as ace:
        status, headers, body = ace.chat(msgs, authorization="Bearer key-acme")
        assert status == 200 and cached(body) == 0
        acme_prefix = f"ace-kv-acme-{trace(headers)['prefix_key']}"
        forged = {
            "model": "tiny",
            "messages": msgs,
            "max_tokens": 2,
            "cache_prefix_id": acme_prefix,
            "cache_salt": "acme",
        }
        status, _, body = ace.post(
            "/v1/chat/completions", forged, authorization="Bearer key-globex"
        )
        assert status == 200 and cached(body) == 0  # acme's blocks stay acme's
        status, _, body = ace.post(
            "/v1/chat/completions",
            {**forged, "cache_salt": "something-else"},
            authorization="Bearer key-acme",
        )
        # acme's own prompt is still warm: its salt is the tenant's, not the client's.
        assert status == 200 and cached(body) > 1000
