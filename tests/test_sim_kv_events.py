"""The sim pod's KV events: vLLM's ZMQ wire format, read here with plain msgpack."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from ace_extproc.sim import engine as engine_mod
from ace_extproc.sim.app import SimConfig, SimServer, add_arguments, config_from_args
from ace_extproc.sim.kv_events import END_SEQ, KVEventsConfig
from ace_extproc.sim.kvcache import block_hashes, text_block_keys
from ace_extproc.sim.tokenizer import encode, render_chat

BLOCK = 16
TOPIC = b"kv"
STORED_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
]
Frames = tuple[bytes, int, list[Any]]  # topic, seq, decoded payload


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def events_config(**overrides: Any) -> KVEventsConfig:
    base: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv",
    }
    return KVEventsConfig(**{**base, **overrides})


class Subscriber:
    """A SUB socket on the pod's endpoint, decoding with msgspec alone."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(endpoint)

    async def recv(self, timeout: float = 2.0) -> Frames:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    async def nothing(self, within: float) -> bool:
        return not await self.sock.poll(int(within * 1000))


@asynccontextmanager
async def pod(
    events: KVEventsConfig | None = None, **overrides: Any
) -> AsyncIterator[tuple[SimServer, aiohttp.ClientSession, Subscriber]]:
    config = SimConfig(
        **{"time_scale": 0.0, "tpot_ms": 1.0, "kv_events": events or events_config(), **overrides}
    )
    ctx = zmq.asyncio.Context()
    try:
        async with SimServer(config) as server, aiohttp.ClientSession(server.url) as session:
            async with session.get("/kv_event_sources") as resp:
                source = (await resp.json())["0"]
            sub = Subscriber(ctx, source["endpoint"])
            await asyncio.sleep(0.2)  # the subscription reaches the PUB socket (slow joiner)
            yield server, session, sub
    finally:
        ctx.destroy(linger=0)


async def post(session: aiohttp.ClientSession, path: str, body: Any) -> dict[str, Any]:
    async with session.post(path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 100_000 for i in range(n)]


MESSAGES = [
    {"role": "system", "content": "You are a meticulous assistant. " * 8},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_a_chat_prompts_blocks_arrive_as_one_block_stored() -> None:
    async def main() -> None:
        async with pod() as (server, s, sub):
            body = {"messages": MESSAGES, "cache_salt": "tenant-a", "max_tokens": 2}
            await post(s, "/v1/chat/completions", body)
            topic, seq, batch = await sub.recv()
            cache = server.pod.cache
        prompt = render_chat(MESSAGES).encode()
        keys = text_block_keys(prompt, BLOCK, "tenant-a")
        assert len(keys) >= 4
        assert (topic, seq) == (TOPIC, 0)
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(time.time() - ts) < 5 and rank == 0
        [event] = events
        assert list(event) == STORED_KEYS  # vLLM's fields, in vLLM's order
        assert event["type"] == "BlockStored"
        assert event["block_hashes"] == keys  # the sim's own keys
        assert all(cache.match_keys(keys[: i + 1], (i + 1) * BLOCK + 1) for i in range(len(keys)))
        assert event["parent_block_hash"] is None
        assert event["token_ids"] == encode(render_chat(MESSAGES))[: len(keys) * BLOCK]
        assert event["block_size"] == BLOCK
        assert (event["lora_id"], event["medium"], event["lora_name"]) == (None, "GPU", None)
        assert event["extra_keys"] == [["tenant-a"]] + [None] * (len(keys) - 1)
        assert (event["group_idx"], event["kv_cache_spec_kind"]) == (0, "full_attention")

    run(main)


def test_a_longer_prompt_stores_only_its_new_blocks_with_their_parent() -> None:
    async def main() -> None:
        first, second = ids(1, 3 * BLOCK + 5), ids(1, 5 * BLOCK + 3)
        async with pod() as (_, s, sub):
            await post(s, "/v1/completions", {"prompt": first, "max_tokens": 1})
            await post(s, "/v1/completions", {"prompt": second, "max_tokens": 1})
            (_, seq0, (_, [a], _)), (_, seq1, (_, [b], _)) = await sub.recv(), await sub.recv()
        keys = block_hashes(second, BLOCK)
        assert (seq0, seq1) == (0, 1)
        assert a["block_hashes"] == keys[:3] and a["parent_block_hash"] is None
        assert b["block_hashes"] == keys[3:5] and b["parent_block_hash"] == keys[2]
        assert b["token_ids"] == second[3 * BLOCK : 5 * BLOCK]
        assert b["extra_keys"] == [None, None]  # one entry per block, no salt past block 0

    run(main)


def test_an_adapters_blocks_name_it_as_vllms_do() -> None:
    """vLLM keys every block of an adapter's request by the adapter, and its event says
    so: ``lora_id`` (the adapter's registration order, from 1), ``lora_name``, and the
    name first among each block's extra keys, block 0's salt after it."""

    async def main() -> None:
        lora = {"enable_lora": True, "max_loras": 2, "lora_modules": ("sql", "chat")}
        async with pod(**lora) as (_, s, sub):
            body = {"model": "chat", "messages": MESSAGES, "cache_salt": "t", "max_tokens": 1}
            await post(s, "/v1/chat/completions", body)
            (_, _, (_, [event], _)) = await sub.recv()
            await post(s, "/v1/chat/completions", {**body, "model": "sim-llama"})
            (_, _, (_, [base], _)) = await sub.recv()
        n = len(event["block_hashes"])
        assert (event["lora_id"], event["lora_name"]) == (2, "chat")
        assert event["extra_keys"] == [["chat", "t"]] + [["chat"]] * (n - 1)
        # The base model's blocks of the same prompt: other keys, no adapter named.
        assert (base["lora_id"], base["lora_name"]) == (None, None)
        assert base["extra_keys"] == [["t"]] + [None] * (n - 1)
        assert not set(base["block_hashes"]) & set(event["block_hashes"])

    run(main)


def test_one_prefill_batch_is_one_event_batch() -> None:
    async def main() -> None:
        async with pod() as (_, s, sub):
            prompts = [ids(2, 2 * BLOCK), ids(3, 3 * BLOCK)]
            await post(s, "/v1/completions", {"prompt": prompts, "max_tokens": 1})
            _, _, (_, events, _) = await sub.recv()
            assert await sub.nothing(0.1)
        assert sorted(len(e["block_hashes"]) for e in events) == [2, 3]

    run(main)


def test_eviction_publishes_block_removed_before_the_new_blocks() -> None:
    async def main() -> None:
        # 8 blocks: A caches 4; B needs 5 (4 prompt + output) and evicts A's leaf.
        async with pod(num_gpu_blocks=8) as (_, s, sub):
            a, b = ids(4, 4 * BLOCK), ids(5, 4 * BLOCK)
            await post(s, "/v1/completions", {"prompt": a, "max_tokens": 1})
            await post(s, "/v1/completions", {"prompt": b, "max_tokens": 8})
            await sub.recv()
            _, _, (_, events, _) = await sub.recv()
        removed, stored = events
        assert removed == {
            "type": "BlockRemoved",
            "block_hashes": [block_hashes(a, BLOCK)[3]],
            "medium": "GPU",
            "group_idx": 0,
        }
        assert stored["type"] == "BlockStored"
        assert stored["block_hashes"] == block_hashes(b, BLOCK)

    run(main)


def test_reset_publishes_all_blocks_cleared_and_seqs_are_consecutive() -> None:
    async def main() -> None:
        async with pod() as (_, s, sub):
            await post(s, "/v1/completions", {"prompt": ids(6, 2 * BLOCK), "max_tokens": 1})
            await post(s, "/reset_prefix_cache", None)
            await post(s, "/v1/completions", {"prompt": ids(6, 2 * BLOCK), "max_tokens": 1})
            got = [await sub.recv() for _ in range(3)]
        assert [seq for _, seq, _ in got] == [0, 1, 2]
        assert got[1][2][1] == [{"type": "AllBlocksCleared"}]
        assert got[2][2][1][0]["type"] == "BlockStored"  # cold again

    run(main)


def test_replay_serves_missed_batches_then_the_end_marker() -> None:
    async def main() -> None:
        async with pod() as (server, s, sub):
            for seed in range(3):
                await post(s, "/v1/completions", {"prompt": ids(seed, BLOCK + 1), "max_tokens": 1})
            live = [await sub.recv() for _ in range(3)]
            replay = server.pod.events.replay_endpoint  # type: ignore[union-attr]
            async with s.get("/kv_event_sources") as resp:
                assert (await resp.json())["0"]["replay_endpoint"] == replay
            ctx = zmq.asyncio.Context()
            try:
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(replay)
                await dealer.send_multipart((b"", (1).to_bytes(8, "big")))
                frames = [await asyncio.wait_for(dealer.recv_multipart(), 2.0) for _ in range(3)]
            finally:
                ctx.destroy(linger=0)
        for (_, seq, batch), (empty, topic, seq_bytes, payload) in zip(
            live[1:], frames[:2], strict=True
        ):
            assert (empty, topic, int.from_bytes(seq_bytes, "big")) == (b"", TOPIC, seq)
            assert msgspec.msgpack.decode(payload) == batch
        assert frames[2] == [b"", b"", END_SEQ, b""]

    run(main)


def test_the_delay_holds_each_batch_back() -> None:
    async def main() -> None:
        async with pod(kv_events_delay_ms=300) as (server, s, sub):
            await post(s, "/v1/completions", {"prompt": ids(7, 2 * BLOCK), "max_tokens": 1})
            await post(s, "/reset_prefix_cache", None)
            sent = time.time()
            assert await sub.nothing(0.15)
            _, seq0, (ts0, _, _) = await sub.recv()
            _, seq1, (_, [cleared], _) = await sub.recv()
            arrived = time.time()
            assert server.pod.events is not None and server.pod.events.published == 2
        assert (seq0, seq1) == (0, 1) and cleared["type"] == "AllBlocksCleared"
        assert arrived - ts0 >= 0.29  # ts says when the step ended, as from vLLM
        assert arrived - sent < 1.5

    run(main)


def test_block_stored_is_published_before_the_first_token_goes_out() -> None:
    async def main() -> None:
        async with pod() as (server, s, sub):
            body = {"prompt": ids(8, 3 * BLOCK), "max_tokens": 4, "stream": True}
            async with s.post("/v1/completions", json=body) as resp:
                await resp.content.readuntil(b"\n\n")  # the first token's chunk
                assert server.pod.events is not None and server.pod.events.published == 1
                await resp.read()
            _, _, (_, [event], _) = await sub.recv()
        assert event["block_hashes"] == block_hashes(body["prompt"], BLOCK)  # type: ignore[arg-type]

    run(main)


def test_wildcard_endpoints_report_the_pods_address() -> None:
    async def main() -> None:
        config = events_config(endpoint="tcp://*:0", replay_endpoint=None, buffer_steps=5)
        async with pod(config) as (_, s, _sub), s.get("/kv_event_sources") as resp:
            source = await resp.json()
        [entry] = source.values()
        assert list(source) == ["0"]
        assert entry["endpoint"].startswith("tcp://127.0.0.1:") and "*" not in entry["endpoint"]
        assert entry["endpoint"] != "tcp://127.0.0.1:0"
        assert entry["replay_endpoint"] is None
        assert entry == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": entry["endpoint"],
            "replay_endpoint": None,
            "buffer_steps": 5,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": "kv",
        }

    run(main)


def test_events_off_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tokens(data: bytes) -> list[int]:
        raise AssertionError("token ids computed with KV events off")

    monkeypatch.setattr(engine_mod, "encode_utf8", no_tokens)

    async def main() -> None:
        for events in (None, KVEventsConfig(enable_kv_cache_events=False)):
            config = SimConfig(time_scale=0.0, tpot_ms=1.0, kv_events=events)
            async with SimServer(config) as server, aiohttp.ClientSession(server.url) as s:
                assert server.pod.events is None and server.pod.cache.events is None
                assert server.pod.engine.events is None
                await post(s, "/v1/chat/completions", {"messages": MESSAGES})
                await post(s, "/reset_prefix_cache", None)
                async with s.get("/kv_event_sources") as resp:
                    assert await resp.json() == {}

    run(main)


def test_cli_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
            ' "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 100}',
            "--kv-events-delay-ms",
            "25",
        ]
    )
    config = config_from_args(args)
    assert config.kv_events == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        topic="kv",
        buffer_steps=100,
    )
    assert config.kv_events_delay_ms == 25.0
    assert config_from_args(parser.parse_args([])).kv_events is None
    for bad in ("{", "[]", '{"enable": true}', '{"publisher": "kafka"}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-events-config", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-delay-ms", "-1"])
