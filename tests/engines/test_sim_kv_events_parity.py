"""The sim's KV event payloads are byte for byte what vLLM's own classes encode.

A sim pod publishes a few batches (a salted chat prompt, an adapter's, a prompt of ids
and its extension, an eviction, a reset); for each, vLLM (the ``make engines`` venv, in
a subprocess) builds the events its block pool would from the same inputs (hashes,
parent, token ids, block size, salt, adapter), with ``to_event_extra_keys`` and the spec
kind its KV cache manager stamps on a full-attention model, wraps them in
``KVEventBatch`` with the same ``ts`` and encodes them with ``msgspec.msgpack.Encoder()``
as ``ZmqEventPublisher`` does. Only needs the engine venv, no vLLM server.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from ace_extproc.sim.app import SimConfig, SimServer
from ace_extproc.sim.kv_events import KVEventsConfig
from ace_extproc.vllm_pods import EnginesMissing, VllmOptions
from tests.test_sim_kv_events import MESSAGES, ids, post

pytestmark = pytest.mark.engines
BLOCK = 16

VLLM_SIDE = r"""
import json, sys
import msgspec, torch
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import to_event_extra_keys
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window,
)

spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
kind, window = get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)

def stored(e):
    # As BlockPool.cache_full_blocks with generate_block_hash_extra_keys: per block, the
    # adapter's ("lora", name, path), then ("cache_salt", salt) on block 0 only.
    lora = [("lora", e["lora_name"], "/adapters/" + e["lora_name"])] if e["lora_name"] else []
    keys = [
        tuple(lora + ([("cache_salt", e["salt"])] if i == 0 and e["first"] and e["salt"] else []))
        or None
        for i in range(len(e["hashes"]))
    ]
    event = BlockStored(
        block_hashes=e["hashes"], parent_block_hash=e["parent"], token_ids=e["tokens"],
        block_size=e["block_size"], lora_id=e["lora_id"], medium="GPU",
        lora_name=e["lora_name"], extra_keys=to_event_extra_keys(keys), group_idx=0,
    )
    event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = kind, window
    return event

def build(e):
    if e["kind"] == "stored":
        return stored(e)
    if e["kind"] == "removed":
        return BlockRemoved(block_hashes=e["hashes"], medium="GPU", group_idx=0)
    return AllBlocksCleared()

encoder = msgspec.msgpack.Encoder()
out = []
for b in json.load(sys.stdin):
    batch = KVEventBatch(ts=b["ts"], events=[build(e) for e in b["events"]])
    batch.data_parallel_rank = 0  # as ZmqEventPublisher.publish does
    out.append(encoder.encode(batch).hex())
json.dump(out, sys.stdout)
"""


def inputs(event: dict[str, Any]) -> dict[str, Any]:
    """What vLLM builds an event from (not the sim's encoding of it)."""
    kind = event["type"]
    if kind == "BlockRemoved":
        return {"kind": "removed", "hashes": event["block_hashes"]}
    if kind == "AllBlocksCleared":
        return {"kind": "cleared"}
    extra = event["extra_keys"]
    first = extra[0] if extra and extra[0] else []
    named = event["lora_name"] is not None  # the adapter's name comes first, then the salt
    return {
        "kind": "stored",
        "hashes": event["block_hashes"],
        "parent": event["parent_block_hash"],
        "tokens": event["token_ids"],
        "block_size": event["block_size"],
        "first": event["parent_block_hash"] is None,
        "salt": first[-1] if len(first) > named else None,
        "lora_id": event["lora_id"],
        "lora_name": event["lora_name"],
    }


async def sim_payloads() -> list[bytes]:
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
    lora = {"enable_lora": True, "max_loras": 2, "lora_modules": ("sql", "chat")}
    config = SimConfig(time_scale=0.0, num_gpu_blocks=8, kv_events=events, **lora)
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        async with SimServer(config) as server:
            assert server.pod.events is not None and server.pod.events.endpoint is not None
            sub.connect(server.pod.events.endpoint)
            await asyncio.sleep(0.2)  # slow joiner
            async with aiohttp.ClientSession(server.url) as s:
                short = [{"role": "user", "content": MESSAGES[1]["content"] * 2}]
                await post(s, "/v1/chat/completions", {"messages": short, "cache_salt": "t-1"})
                adapter = {"model": "chat", "messages": short, "cache_salt": "t-1"}
                await post(s, "/v1/chat/completions", adapter)
                await post(s, "/v1/completions", {"prompt": ids(1, 2 * BLOCK + 3)})
                await post(s, "/v1/completions", {"prompt": ids(1, 3 * BLOCK + 3)})
                await post(s, "/v1/completions", {"prompt": ids(2, 3 * BLOCK), "max_tokens": 60})
                await post(s, "/reset_prefix_cache", None)
            frames = [
                await asyncio.wait_for(sub.recv_multipart(), 2.0)
                for _ in range(server.pod.events.published)
            ]
    finally:
        ctx.destroy(linger=0)
    return [payload for _, _, payload in frames]


def vllm_payloads(python: str, batches: list[list[Any]]) -> list[bytes]:
    doc = [{"ts": ts, "events": [inputs(e) for e in events]} for ts, events, _ in batches]
    done = subprocess.run(
        [python, "-c", VLLM_SIDE],
        input=json.dumps(doc),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [bytes.fromhex(h) for h in json.loads(done.stdout)]


def test_sim_payloads_are_vllms_bytes() -> None:
    try:
        python = VllmOptions.find().python
    except EnginesMissing as exc:
        pytest.skip(str(exc))
    ours = asyncio.run(sim_payloads())
    batches = [msgspec.msgpack.decode(p) for p in ours]
    kinds = [e["type"] for _, events, _ in batches for e in events]
    # Every kind of event, and a salted block 0, are covered.
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    assert any(inputs(e).get("salt") for _, events, _ in batches for e in events)
    assert any(inputs(e).get("lora_name") for _, events, _ in batches for e in events)
    assert vllm_payloads(python, batches) == ours
