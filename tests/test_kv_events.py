"""Each pod's KV event stream (routing/kv_events.py), against a publisher that speaks
vLLM's wire format over real ZMQ sockets: stores reach the index, and every fault
(never connecting, dropping mid-run, gaps with and without replay, garbage frames, a
restarted engine, a pod that left, a block size the engine disagrees with) leaves the
pod routed approximately, never a crash or a stalled loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import zmq
from aiohttp import web

from ace_extproc.routing.kv_events import (
    CONNECTING,
    MISMATCH,
    OFF,
    PRECISE,
    UNCERTAIN,
    Endpoints,
    PodStream,
    sources_from,
)
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.tokens import block_keys, chain_seed

BS = 4
IDS = list(range(1, 17))
KEYS = block_keys(IDS, BS, chain_seed("s"))


def stored(hashes: list[int], ids: list[int], parent: int | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["s"] if parent is None and i == 0 else None for i in range(len(hashes))],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Publisher:
    """vLLM's ZMQ publisher, as the tests need it: PUB frames [topic, seq, payload],
    a replay ROUTER answering from a buffer, and a way to skip sequence numbers."""

    def __init__(self, port: int | None = None, replay: bool = False) -> None:
        self.ctx = zmq.Context()
        self.port = port or free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_port = free_port() if replay else None
        self._stop = threading.Event()
        if replay:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    @property
    def endpoints(self) -> Endpoints:
        replay = f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None
        return Endpoints(f"tcp://127.0.0.1:{self.port}", replay, "kv")

    def publish(self, events: list[dict[str, Any]], *, deliver: bool = True) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self.buffer.append((self.seq, payload))
        if deliver:
            self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        router.close()

    def close(self) -> None:
        self._stop.set()
        self.pub.close()
        if self.replay_port:
            self._thread.join()
        self.ctx.term()


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def stream(index: PreciseIndex, endpoints: Endpoints | None, **kw: Any) -> PodStream:
    index.add_pod(0)
    return PodStream(
        0,
        "d/pod-0",
        index,
        endpoints,
        kw.pop("discover", None),
        rebuild_s=kw.pop("rebuild_s", 0.5),
        retry_s=0.1,
        **kw,
    )


async def connected(s: PodStream) -> None:
    await until(lambda: s.refresh() == PRECISE)
    await asyncio.sleep(0.1)  # the subscription reaches the publisher (ZMQ's slow joiner)


@contextlib.asynccontextmanager
async def streaming(
    replay: bool = False, **kw: Any
) -> AsyncIterator[tuple[Publisher, PreciseIndex, PodStream]]:
    """A publisher, an index, and a stream between them, connected."""
    pub, index = Publisher(replay=replay), PreciseIndex()
    s = stream(index, pub.endpoints, **kw)
    s.start()
    try:
        await connected(s)
        yield pub, index, s
    finally:
        await s.stop()
        pub.close()


def test_stores_reach_the_index_and_the_pod_is_precise() -> None:
    async def go() -> None:
        async with streaming() as (pub, index, s):
            pub.publish([stored([10, 11], IDS[:8])])
            pub.publish([stored([12, 13], IDS[8:], parent=11)])
            await until(lambda: index.match(KEYS, 1) == {0: (4, 4)})
            assert s.stats.batches == 2 and s.stats.last_seq == 1 and s.stats.lag_s < 5

    run(go)


def test_a_stream_that_never_connects_leaves_the_pod_approximate() -> None:
    async def go() -> None:
        index = PreciseIndex()
        s = stream(index, Endpoints(f"tcp://127.0.0.1:{free_port()}"))
        s.start()
        try:
            await asyncio.sleep(0.3)
            assert s.refresh() == CONNECTING and not index.live_mask
            started = time.perf_counter()
            await asyncio.sleep(0.05)  # the loop is not held by the stream
            assert time.perf_counter() - started < 0.2
        finally:
            await s.stop()

    run(go)


def test_a_gap_without_replay_untrusts_the_pod_until_rebuilt() -> None:
    async def go() -> None:
        async with streaming(rebuild_s=0.5) as (pub, index, s):
            pub.publish([stored([10], IDS[:4])])
            pub.publish([stored([11], IDS[4:8], parent=10)], deliver=False)  # lost
            pub.publish([stored([12], IDS[8:12], parent=11)])
            await until(lambda: s.stats.gaps == 1)
            assert s.refresh() == UNCERTAIN and not index.live_mask
            await until(lambda: s.refresh() == PRECISE, timeout=3)  # rebuild_s later
            # What it learned meanwhile is kept; the lost store's child is an orphan.
            assert index.match(KEYS, 1) == {0: (1, 1)} and index.pods[0].orphans == 1

    run(go)


def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async def go() -> None:
        async with streaming(replay=True, rebuild_s=60) as (pub, index, s):
            pub.publish([stored([10], IDS[:4])])
            pub.publish([stored([11], IDS[4:8], parent=10)], deliver=False)  # lost
            pub.publish([stored([12, 13], IDS[8:], parent=11)])
            await until(lambda: index.match(KEYS, 1) == {0: (4, 4)})
            # Replays: the first contact's (what it held before), and the gap's.
            assert s.stats.gaps == 1 and s.stats.replays == s.stats.replayed == 2
            assert s.refresh() == PRECISE

    run(go)


def test_a_dropped_stream_is_not_trusted_until_it_is_back() -> None:
    async def go() -> None:
        pub, index = Publisher(), PreciseIndex()
        s = stream(index, pub.endpoints, rebuild_s=0.2)
        s.start()
        try:
            await connected(s)
            pub.publish([stored([10], IDS[:4])])
            await until(lambda: s.stats.batches == 1)
            port = pub.port
            pub.close()  # the engine goes away mid-run
            await until(lambda: s.stats.disconnects == 1)
            assert s.refresh() == UNCERTAIN and not index.live_mask
            pub = Publisher(port=port)  # and comes back on the same port
            await until(lambda: s.refresh() == PRECISE)
            await asyncio.sleep(0.1)
            pub.seq = 1  # the same engine, carrying on
            pub.publish([stored([11], IDS[4:8], parent=10)])
            await until(lambda: index.match(KEYS, 1) == {0: (2, 2)})
        finally:
            await s.stop()
            pub.close()

    run(go)


def test_garbage_frames_are_counted_and_skipped() -> None:
    async def go() -> None:
        async with streaming() as (pub, index, s):
            pub.raw([b"kv", b"\x00" * 8, b"\xc1\xff not msgpack"])
            pub.raw([b"kv", b"short", b""])
            pub.raw([b"kv"])
            pub.publish([stored([10], IDS[:4]), {"type": "FutureEvent", "x": 1}])
            await until(lambda: s.stats.batches == 1)
            assert s.stats.bad_frames == 3 and s.stats.skipped_events == 1
            assert index.match(KEYS, 1) == {0: (1, 1)} and s.refresh() == PRECISE

    run(go)


def test_a_sequence_that_starts_again_is_a_restarted_engine() -> None:
    async def go() -> None:
        async with streaming() as (pub, index, s):
            pub.publish([stored([10, 11], IDS[:8])])
            pub.publish([])
            await until(lambda: s.stats.last_seq == 1)
            pub.seq = 0  # a new engine process: its cache is empty
            pub.publish([stored([50], IDS[:4])])
            await until(lambda: s.stats.restarts == 1)
            assert index.match(KEYS, 1) == {0: (1, 1)} and 10 not in index.pods[0].blocks

    run(go)


def test_a_block_size_the_engine_disagrees_with_is_a_mismatch() -> None:
    async def go() -> None:
        async with streaming() as (pub, index, s):
            index.set_engine_cache(0, 16, 16_000)  # cache_config_info says 16
            pub.publish([stored([10], IDS[:4])])  # events say 4
            await until(lambda: s.refresh() == MISMATCH)
            assert not index.live_mask and index.match(KEYS, 1) == {}

    run(go)


def test_the_endpoint_is_asked_of_the_engine() -> None:
    async def go() -> None:
        pub, index = Publisher(), PreciseIndex()
        answers: dict[str, Any] = {"doc": {}}

        async def sources(request: web.Request) -> web.Response:
            return web.json_response(answers["doc"])

        app = web.Application()
        app.router.add_get("/kv_event_sources", sources)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        import aiohttp

        session = aiohttp.ClientSession()
        s = stream(
            index,
            None,
            discover=f"http://127.0.0.1:{port}/kv_event_sources",
            session=lambda: session,
        )
        s.start()
        try:
            await until(lambda: s.refresh() == OFF)  # an engine that publishes nothing
            answers["doc"] = {
                "0": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{pub.port}",
                    "topic": "kv",
                }
            }
            await connected(s)
            pub.publish([stored([10], IDS[:4])])
            await until(lambda: index.match(KEYS, 1) == {0: (1, 1)})
        finally:
            await s.stop()
            await session.close()
            await runner.cleanup()
            pub.close()

    run(go)


def test_sources_are_read_as_vllm_writes_them() -> None:
    doc = {
        "0": {
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv",
        }
    }
    assert sources_from(doc, "10.0.0.7") == Endpoints(
        "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv"
    )
    assert sources_from({"endpoint": "tcp://[::]:9"}, "fd00::1") == Endpoints("tcp://[fd00::1]:9")
    assert sources_from({"0": {"publisher": "null"}}, "h") is None
    assert sources_from([1, 2], "h") is None
    assert sources_from({"0": {"endpoint": 5}}, "h") is None


def test_a_pod_that_leaves_stops_its_stream_and_its_view_and_one_that_joins_starts() -> None:
    from dataclasses import replace

    from ace_extproc.config import Fleet, Pod, sim_fleet
    from ace_extproc.routing.fleet import FleetState
    from ace_extproc.routing.kv_events import KvEvents

    async def go() -> None:
        base = sim_fleet(["127.0.0.1:1", "127.0.0.1:2"])
        fleet = FleetState(Fleet((replace(base.destinations[0], tokenizer="sim"),)))
        index = PreciseIndex()
        events = KvEvents(fleet, index, frozenset({"sim"}), rebuild_s=1)
        await events.start()
        try:
            assert set(events.streams) == {0, 1}
            index.apply(1, [stored([10], IDS[:4])])
            fleet.remove_pod(1)
            await asyncio.sleep(0.05)
            assert set(events.streams) == {0} and 1 not in index.pods
            index.apply(1, [stored([10], IDS[:4])])  # a late event for it: ignored
            assert index.blocks_held(1) == 0
            slot = fleet.add_pod(Pod("sim", "pod-2", "127.0.0.1", 3))
            assert slot in events.streams and events.streams[slot].name == "sim/pod-2"
        finally:
            await events.stop()

    run(go)
