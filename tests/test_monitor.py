"""Load and health off the request path: the /metrics parser, and the monitor against
simulated pods served in-process."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from ace_extproc import server
from ace_extproc.app import build
from ace_extproc.config import Config, Destination, Fleet, Mode, Pod, Settings, sim_fleet
from ace_extproc.latency import get_model
from ace_extproc.routing import BlockIndex, FleetState, metrics_text
from ace_extproc.routing.load import UNSEEN_MS, LoadAccounting
from ace_extproc.routing.metrics_text import EngineStats, parse, restarted
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.sim.app import SimConfig, SimServer
from ace_extproc.telemetry import Telemetry
from tests.conftest import free_port, serving

# ------------------------------------------------------------------ the parser

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 1.0
vllm:num_requests_waiting{engine="1",model_name="llama"} NaN
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="llama"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 1500.0 1712345678000
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="llama"} 4.5e+04
vllm:prompt_tokens_total{engine="1",model_name="llama"} 5000
vllm:prompt_tokens_cached_total{engine="0",model_name="llama"} 99.0
vllm:num_requests_running_total{engine="0"} 1000.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 7.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="8192"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="a} b",engine="1",num_gpu_blocks="4096"} 1.0
this line is garbage {{{
vllm:num_requests_running{engine="2"} not-a-number
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.71234e+09
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="qwen"} 4.0
sglang:num_running_reqs{dp_rank="1",model_name="qwen"} 6.0
sglang:num_queue_reqs{dp_rank="0",model_name="qwen"} 2.0
sglang:num_queue_reqs{dp_rank="1",model_name="qwen"} 0.0
sglang:token_usage{dp_rank="0",model_name="qwen"} 0.2
sglang:token_usage{dp_rank="1",model_name="qwen"} 0.4
sglang:cache_hit_rate{dp_rank="0",model_name="qwen"} 0.5
sglang:cache_hit_rate{dp_rank="1",model_name="qwen"} 0.7
sglang:max_total_num_tokens{dp_rank="0",model_name="qwen"} 161721.0
sglang:max_total_num_tokens{dp_rank="1",model_name="qwen"} 161721.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="qwen"} 8.128902e+06
sglang:cached_tokens_total{model_name="qwen"} 4000000.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="qwen"} 3.0
"""


def test_vllm_text_is_summed_over_label_sets() -> None:
    s = parse(VLLM)
    assert s.engine == "vllm"
    assert (s.running, s.waiting) == (5, 1)  # NaN and garbage skipped, not summed
    assert s.kv_usage == pytest.approx(0.375)  # a fraction: the mean
    assert s.capacity_tokens == 16 * (8192 + 4096)  # braces inside a label value
    assert (s.prompt_tokens, s.cache_queries, s.cache_hits) == (50_000, 2000, 1500)
    assert s.hit_rate == pytest.approx(0.75)
    assert s.cached_prompt_tokens == 99  # vllm:prompt_tokens_cached_total, not prompt_tokens
    assert s.start_time == pytest.approx(1.71234e9)
    assert s.usable
    assert "NaN" in s.reason and "not-a-number" in s.reason


def test_bytes_crlf_and_leading_blanks() -> None:
    text = VLLM.replace("\n", "\r\n").replace("vllm:num_requests_w", "  vllm:num_requests_w")
    s = parse(text.encode())
    assert (s.running, s.waiting, s.capacity_tokens) == (5, 1, 16 * 12288)


def test_sglang_text() -> None:
    s = parse(SGLANG.encode())
    assert s.engine == "sglang"
    assert (s.running, s.waiting) == (10, 2)
    assert s.kv_usage == pytest.approx(0.3)
    assert s.hit_rate == pytest.approx(0.6)
    assert s.capacity_tokens == 2 * 161721
    assert (s.prompt_tokens, s.cache_hits, s.cache_queries) == (8128902, 4_000_000, None)
    assert s.cached_prompt_tokens == 4_000_000  # sglang:cached_tokens_total
    assert s.reason == ""


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"\x00\xff\xfe garbage",
        "<html><body>404 Not Found</body></html>",
        "# only comments\n# TYPE vllm:num_requests_running gauge\n",
        'vllm:cache_config_info{block_size="x"} 1\n',
        "vllm:num_requests_running{" + "x" * 100_000,
    ],
)
def test_bad_text_never_raises(text: str | bytes) -> None:
    s = parse(text)
    assert not s.usable and s.reason
    assert s.capacity_tokens is None


def test_restart_detection() -> None:
    before = EngineStats(prompt_tokens=100.0, cache_queries=50.0, start_time=1.0)
    assert restarted(before, EngineStats(prompt_tokens=100.0, cache_queries=60.0)) is None
    assert "prompt_tokens" in (restarted(before, EngineStats(prompt_tokens=3.0)) or "")
    assert "start_time" in (restarted(before, EngineStats(prompt_tokens=200, start_time=2)) or "")
    assert restarted(EngineStats(), EngineStats(prompt_tokens=0.0)) is None


# ------------------------------------------------------------- against pods

FAST = Settings(
    salt_secret=b"s",
    scrape_interval_s=0.02,
    probe_interval_s=0.02,
    probe_timeout_s=0.5,
    unhealthy_after=2,
    healthy_after=2,
)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def sim(pod_id: str, port: int = 0, **kw: Any) -> SimServer:
    kw = {"time_scale": 0.0, "tpot_ms": 1.0, **kw}
    return SimServer(SimConfig(pod_id=pod_id, **kw), port=port)


class Watched:
    def __init__(self, pods: list[SimServer]) -> None:
        self.pods = pods
        self.fleet = FleetState(sim_fleet([f"127.0.0.1:{p.port}" for p in pods]))
        self.index = BlockIndex(1000)
        for slot in range(len(pods)):
            self.index.add_pod(slot)
        self.monitor = FleetMonitor(self.fleet, self.index, FAST)

    def up(self, slot: int) -> bool:
        return bool(self.fleet.available >> slot & 1)


@asynccontextmanager
async def watched(*pods: SimServer) -> AsyncIterator[Watched]:
    async with AsyncExitStack() as stack:
        for p in pods:
            await stack.enter_async_context(p)
        w = Watched(list(pods))
        await w.monitor.start()
        stack.push_async_callback(w.monitor.stop)
        yield w


async def chat(url: str, text: str, max_tokens: int = 1) -> dict[str, Any]:
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": text}]}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": max_tokens}) as r,
    ):
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


def test_load_figures_follow_the_pod() -> None:
    async def go() -> None:
        slow: dict[str, Any] = {"time_scale": 1.0, "tpot_ms": 10.0}  # a request: ~0.4 s
        async with watched(sim("pod-0", **slow), sim("pod-1", **slow)) as w:
            request = asyncio.create_task(chat(w.pods[0].url, "hello " * 200, max_tokens=40))
            await until(lambda: w.fleet.load[0].running == 1)
            load = w.fleet.load[0]
            assert load.inflight == 1  # reset to the engine's running + waiting
            assert load.kv_usage > 0
            assert w.fleet.load[1].running == 0 and w.fleet.load[1].inflight == 0
            await request
            await until(lambda: w.fleet.load[0].running == 0)
            assert w.fleet.load[0].inflight == 0

    run(go)


def test_capacity_bounds_the_index() -> None:
    async def go() -> None:
        # 64 engine blocks of 16 tokens = 1024 tokens = 8 router blocks of ~128 tokens.
        small = sim("pod-0", block_size=16, num_gpu_blocks=64)
        big = sim("pod-1")
        async with AsyncExitStack() as stack:
            for p in (small, big):
                await stack.enter_async_context(p)
            w = Watched([small, big])
            w.index.record(0, list(range(1, 21)))
            w.index.record(1, list(range(1, 21)))
            await w.monitor.start()
            stack.push_async_callback(w.monitor.stop)
            await until(lambda: None not in w.fleet.capacity_tokens)
            assert w.fleet.capacity_tokens == [1024, 8192 * 16]
            assert (w.index.capacity_of(0), w.index.capacity_of(1)) == (8, 1024)
            assert w.index.blocks_held(0) == 8  # the oldest evicted
            assert w.index.longest_match([1, 2, 3], 0b01) == (3, 0b01)  # the head kept
            assert w.index.blocks_held(1) == 20

    run(go)


def test_a_stopped_pod_goes_down_and_comes_back_empty(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ace_extproc.monitor")

    async def go() -> None:
        async with sim("pod-0") as steady:
            flaky = sim("pod-1")
            await flaky.start()
            w = Watched([steady, flaky])
            await w.monitor.start()
            try:
                await until(lambda: w.monitor.stats(1) is not None)
                w.index.record(0, [1, 2, 3])
                w.index.record(1, [1, 2, 3])
                await flaky.stop()
                await until(lambda: not w.up(1))
                await asyncio.sleep(0.1)  # failures go on: still one warning
                assert w.up(0) and not w.up(1)
                async with sim("pod-1", port=flaky.port):
                    await until(lambda: w.up(1))
                    # A new process (its start time says so): its index goes.
                    await until(lambda: w.index.blocks_held(1) == 0)
                    assert w.index.blocks_held(0) == 3
                    await until(lambda: w.monitor.stats(1) is not None)  # scraped again
            finally:
                await w.monitor.stop()

    run(go)
    downs = [r for r in caplog.records if "marked down" in r.getMessage()]
    assert len(downs) == 1 and downs[0].levelno == logging.WARNING
    assert "sim/pod-1" in downs[0].getMessage()


def test_a_pod_whose_metrics_answer_late_stays_in() -> None:
    """A busy engine's API server answers /metrics late while /health is fine: the slow
    scrapes lose their figures, not the pod (two of them between probes took it out).
    A pod that refuses connections still goes down."""
    from tests.conftest import serving

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow_metrics(_: web.Request) -> web.Response:
        await asyncio.sleep(2 * FAST.probe_timeout_s)
        return web.Response(text=VLLM)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", slow_metrics)

    async def go() -> None:
        async with serving(app) as port:
            fleet = FleetState(sim_fleet([f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]))
            index = BlockIndex(1000)
            # Probes as seldom as by default, so late scrapes follow one another.
            settings = Settings(
                salt_secret=b"s", scrape_interval_s=0.02, probe_interval_s=1.0, probe_timeout_s=0.5
            )
            monitor = FleetMonitor(fleet, index, settings)
            await monitor.start()
            try:
                await until(lambda: not fleet.available >> 1 & 1)  # refused: down
                await asyncio.sleep(6 * FAST.probe_timeout_s)  # several scrapes timed out
                assert fleet.available >> 0 & 1
                assert monitor.stats(0) is None  # no figures from them
            finally:
                await monitor.stop()

    run(go)


def test_counters_going_back_empty_only_that_pods_index() -> None:
    async def go() -> None:
        async with watched(sim("pod-0"), sim("pod-1")) as w:
            for p in w.pods:
                await chat(p.url, "some prompt " * 50)

            def counted(slot: int) -> bool:
                s = w.monitor.stats(slot)
                return s is not None and (s.prompt_tokens or 0) > 0

            await until(lambda: counted(0) and counted(1))
            w.index.record(0, [1, 2, 3])
            w.index.record(1, [1, 2, 3])
            engine, cache = w.pods[0].pod.engine, w.pods[0].pod.cache
            engine.stats.prompt_tokens = 0  # what a restarted engine reports
            cache.queries = cache.hits = 0
            await until(lambda: w.monitor.restarts == 1)
            assert w.index.blocks_held(0) == 0
            assert w.index.blocks_held(1) == 3
            assert w.up(0) and w.up(1)
            await asyncio.sleep(0.1)
            assert w.monitor.restarts == 1  # once, not at every scrape after

    run(go)


def test_a_pod_down_a_while_but_not_restarted_keeps_its_index() -> None:
    """A pod whose /health failed for a while (an engine stalled, a network blip) comes
    back with its index: its scrape before and after tell it is the same process. A
    new process start time empties it, down or not."""
    state = {"health": 200, "started": 1.7e9}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=state["health"])

    async def metrics(_: web.Request) -> web.Response:
        text = VLLM.replace("1.71234e+09", repr(state["started"]))
        return web.Response(text=text)

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/metrics", metrics)])

    async def go() -> None:
        async with serving(app) as port:
            fleet = FleetState(sim_fleet([f"127.0.0.1:{port}"]))
            index = BlockIndex(100)
            index.add_pod(0)
            monitor = FleetMonitor(fleet, index, FAST)
            await monitor.start()
            try:
                await until(lambda: monitor.stats(0) is not None)
                index.record(0, [1, 2, 3])
                state["health"] = 500
                await until(lambda: not fleet.is_available(0))
                state["health"] = 200
                await until(lambda: fleet.is_available(0))
                await asyncio.sleep(0.1)  # scraped again since
                assert index.blocks_held(0) == 3 and monitor.restarts == 0
                state["started"] += 60  # restarted
                await until(lambda: index.blocks_held(0) == 0)
                assert monitor.restarts == 1
            finally:
                await monitor.stop()

    run(go)


def test_the_monitor_asks_for_its_series_and_reads_the_whole_text_where_that_fails() -> None:
    """A pod is asked for the router's series by name (vLLM's ``/metrics/``); a server
    that answers that with a 404, or with no engine series, is read at ``/metrics``
    from then on, and its figures come through all the same."""
    asked: dict[str, list[tuple[str, tuple[str, ...]]]] = {"named": [], "missing": [], "page": []}

    def app(kind: str) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            asked[kind].append((request.path, tuple(request.query.getall("name[]", ()))))
            if request.path == "/metrics/" and kind == "missing":
                raise web.HTTPNotFound()
            if request.path == "/metrics/" and kind == "page":
                return web.Response(text="<html>a dashboard</html>")
            return web.Response(text=VLLM)

        application = web.Application()
        application.add_routes([web.get("/metrics", handle), web.get("/metrics/", handle)])
        return application

    async def go() -> None:
        async with AsyncExitStack() as stack:
            ports = [await stack.enter_async_context(serving(app(k))) for k in asked]
            fleet = FleetState(sim_fleet([f"127.0.0.1:{p}" for p in ports]))
            index = BlockIndex(100)
            monitor = FleetMonitor(fleet, index, FAST)
            await monitor.start()
            stack.push_async_callback(monitor.stop)
            await until(lambda: all(len(a) >= 4 for a in asked.values()))
            for slot in range(3):
                stats = monitor.stats(slot)
                assert stats is not None and stats.running == 5, slot  # summed
        series = metrics_text.SCRAPED_SERIES
        assert set(asked["named"]) == {("/metrics/", series)}
        for kind in ("missing", "page"):  # asked once by name, then for the whole text
            assert asked[kind][0] == ("/metrics/", series)
            assert {path for path, _ in asked[kind][1:]} == {"/metrics"}, kind

    run(go)


def test_hosted_api_pods_are_not_watched() -> None:
    vllm = Destination("a", "vllm", "http://h:1", (Pod("a", "p", "h", 1),))
    hosted = Destination("b", "openai", "http://o:2", (Pod("b", "p", "o", 2),))
    monitor = FleetMonitor(FleetState(Fleet((vllm, hosted))), BlockIndex(10), FAST)
    assert monitor.watched == [0]


def test_stop_is_safe_anytime() -> None:
    async def go() -> None:
        fleet = FleetState(sim_fleet([f"127.0.0.1:{free_port()}"]))  # nobody listens
        monitor = FleetMonitor(fleet, BlockIndex(10), FAST)
        await monitor.stop()  # never started
        await monitor.start()
        await until(lambda: monitor.is_down(0))
        await monitor.stop()
        await monitor.stop()
        await monitor.start()  # and again
        stopping = asyncio.create_task(monitor.stop())
        await asyncio.sleep(0)
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        await monitor.stop()

    run(go)


def test_the_server_runs_a_monitor_and_counts_picks(port: int) -> None:
    async def go() -> None:
        async with sim("pod-0") as pod:
            cfg = Config(
                sim_fleet([f"127.0.0.1:{pod.port}"]),
                msgspec.structs.replace(FAST, listen=f"127.0.0.1:{port}"),
            )
            app = build(cfg)
            processor = app.processor
            srv, _health = await server.start(app)
            monitor = app.monitor
            assert monitor is not None
            try:
                await until(lambda: monitor.stats(0) is not None)
                await monitor.stop()  # no scrape resets what the picks add from now
                body = msgspec.json.encode(
                    {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
                )
                headers = {":path": "/v1/chat/completions", ":method": "POST"}
                for _ in range(2):
                    processor.on_body(processor.on_headers(headers, False), body)
                assert processor.fleet.load[0].inflight == 2
            finally:
                await app.stop()
                await srv.stop(0)

    run(go)


def test_no_monitor_no_count() -> None:
    # Without a monitor nothing would ever reset the count (the fleet simulator keeps
    # its own, exact one), so the processor leaves it alone.
    settings = Settings(salt_secret=b"s", probe_interval_s=0)
    p = build(Config(sim_fleet(["127.0.0.1:1"]), settings)).processor
    body = msgspec.json.encode({"model": "m", "prompt": "y" * 2000})
    p.on_body(p.on_headers({":path": "/v1/completions", ":method": "POST"}, False), body)
    assert p.fleet.load[0].inflight == 0


def test_queued_prefill_drains_in_real_time_and_clears_when_the_engine_is_idle() -> None:
    fleet = FleetState(sim_fleet(["127.0.0.1:1", "127.0.0.1:2"]))
    monitor = FleetMonitor(fleet, BlockIndex(100), Settings())
    load = fleet.load[0]
    # The time since the monitor was made drains nothing queued: the queue is filled
    # after it. Past the drain's 1 ms step, so this call does take that time.
    start = time.monotonic() + 0.01
    monitor.load.drain(start)
    load.queued_prefill_ms = 400.0  # as picks left it
    monitor.load.drain(start + 0.1)
    assert load.queued_prefill_ms == pytest.approx(300.0)  # 100 ms of it done
    monitor.apply(0, EngineStats(engine="vllm", running=3, waiting=2, kv_usage=0.5))
    assert load.queued_prefill_ms == pytest.approx(300.0)  # the engine still has a queue
    # Nothing waiting, but requests running: they may still be prefilling (chunked
    # prefill admits them at once), so the estimate stands.
    monitor.apply(0, EngineStats(engine="vllm", running=3, waiting=0, kv_usage=0.5))
    assert load.queued_prefill_ms == pytest.approx(300.0)
    monitor.apply(0, EngineStats(engine="vllm", running=0, waiting=0, kv_usage=0.0))
    assert load.queued_prefill_ms == 0.0  # an idle engine has no prefill left


def test_a_pick_the_engine_cannot_count_yet_survives_an_idle_scrape() -> None:
    """A real vLLM reads 0 running for 0.27 s after a 30K-token prompt is sent (its API
    server tokenizes first): a scrape then must not wipe the prompt's queued prefill, or
    the next short request joins the pod about to prefill it. Once the pick's modelled
    TTFT and the hop's allowance have passed, an idle reading is believed again."""
    settings = Settings(ttft_model="vllm-cpu-tiny")
    fleet = FleetState(sim_fleet(["127.0.0.1:1", "127.0.0.1:2"]))
    now = [100.0]
    load = LoadAccounting(fleet, settings, clock=lambda: now[0])
    monitor = FleetMonitor(fleet, BlockIndex(100), settings, load)
    model = get_model("vllm-cpu-tiny")
    load.sent(0, 25_000)
    queued = fleet.load[0].queued_prefill_ms
    assert queued == pytest.approx(model.prefill_work_ms(25_000))
    now[0] += 0.3
    load.drain()
    idle = EngineStats(engine="vllm", running=0, waiting=0, kv_usage=0.0)
    monitor.apply(0, idle)
    assert fleet.load[0].queued_prefill_ms == pytest.approx(queued - 300.0)
    assert fleet.load[0].inflight == 1
    monitor.apply(1, idle)  # the other pod's reading is its own
    assert fleet.load[1].queued_prefill_ms == 0.0
    # Past the pick's modelled TTFT and the allowance: the idle reading stands.
    now[0] = 100.0 + (model.ttft_ms(25_000) + UNSEEN_MS) / 1000 + 0.001
    monitor.apply(0, idle)
    assert (fleet.load[0].queued_prefill_ms, fleet.load[0].inflight) == (0.0, 0)


def test_an_idle_reading_keeps_only_what_unseen_picks_added() -> None:
    """Prefill left over from picks the engine has counted (a pod faster than its model)
    is dropped by an idle reading even while a later pick is still on its way."""
    settings = Settings(ttft_model="vllm-cpu-tiny")
    fleet = FleetState(sim_fleet(["127.0.0.1:1"]))
    now = [50.0]
    load = LoadAccounting(fleet, settings, clock=lambda: now[0])
    monitor = FleetMonitor(fleet, BlockIndex(100), settings, load)
    fleet.load[0].queued_prefill_ms = 5_000.0  # an old estimate, the engine long past it
    load.sent(0, 1_000)
    monitor.apply(0, EngineStats(engine="vllm", running=0, waiting=0, kv_usage=0.0))
    expected = get_model("vllm-cpu-tiny").prefill_work_ms(1_000)
    assert fleet.load[0].queued_prefill_ms == pytest.approx(expected)


def test_a_long_prompt_queues_more_than_its_tokens_at_the_linear_rate() -> None:
    """Each pick is priced by the TTFT model, attention term included: an 87,500-token
    prompt queues its full prefill, ~2.6x its tokens at the per-token rate, and is not
    taken as done once that linear time has passed (issue 27: short requests were sent
    to a pod still prefilling one)."""
    settings = Settings()
    fleet = FleetState(sim_fleet(["127.0.0.1:1"]))
    monitor = FleetMonitor(fleet, BlockIndex(100), settings)
    model = get_model(settings.ttft_model)
    start = time.monotonic() + 0.01
    monitor.load.drain(start)
    monitor.load.sent(0, 87_500)
    queued = fleet.load[0].queued_prefill_ms
    assert queued == pytest.approx(model.prefill_work_ms(87_500))
    linear_ms = model.a_ms * 87_500
    assert queued > 2.5 * linear_ms
    monitor.load.drain(start + linear_ms / 1000)
    assert fleet.load[0].queued_prefill_ms == pytest.approx(queued - linear_ms)
    # A continuation's new tokens attend to its cached prefix: priced with it.
    monitor.load.sent(0, 1_000, cached=50_000)
    assert fleet.load[0].queued_prefill_ms == pytest.approx(
        queued - linear_ms + model.prefill_work_ms(1_000, 50_000)
    )


def test_queued_prefill_drains_at_the_configured_prefill_rate() -> None:
    """``prefill_tokens_per_s``: pods faster (or slower) than the TTFT model, such as
    simulated pods on a scaled clock, work through the queue that much faster."""
    settings = Settings(prefill_tokens_per_s=2_500_000)
    fleet = FleetState(sim_fleet(["127.0.0.1:1"]))
    monitor = FleetMonitor(fleet, BlockIndex(100), settings)
    speed = 2_500_000 / get_model(settings.ttft_model).prefill_tokens_per_s  # 100x
    load = fleet.load[0]
    start = time.monotonic() + 0.01  # the clock's own time: a fresh machine's is small
    monitor.load.drain(start)
    load.queued_prefill_ms = 400.0
    monitor.load.drain(start + 0.002)
    assert load.queued_prefill_ms == pytest.approx(400.0 - 2 * speed)


def test_many_short_drains_drain_as_much_as_one_long_one() -> None:
    """drain runs before every pick: at 10,000 picks a second each interval is 0.1 ms,
    which must add up rather than be dropped."""
    fleet = FleetState(sim_fleet(["127.0.0.1:1"]))
    monitor = FleetMonitor(fleet, BlockIndex(100), Settings())
    load = fleet.load[0]
    start = time.monotonic() + 0.01
    monitor.load.drain(start)
    load.queued_prefill_ms = 400.0
    for i in range(1, 1001):
        monitor.load.drain(start + i * 0.0001)  # 1,000 intervals of 0.1 ms: 100 ms in all
    # It drains at most once a millisecond: up to the last one's worth may be pending...
    assert 300.0 - 1e-6 <= load.queued_prefill_ms <= 301.0
    monitor.load.drain(start + 0.101)
    # ... and is drained by the next call: 101 ms in all.
    assert load.queued_prefill_ms == pytest.approx(299.0)


def test_the_prefill_rate_setting_is_checked() -> None:
    from ace_extproc.config import ConfigError, parse_settings

    assert parse_settings({"prefill_tokens_per_s": 50_000}).prefill_tokens_per_s == 50_000.0
    assert parse_settings({}).prefill_tokens_per_s == 0.0  # the TTFT model's
    for bad in (-1, float("nan"), float("inf"), "fast", True):
        with pytest.raises(ConfigError, match=r"router\.prefill_tokens_per_s"):
            parse_settings({"prefill_tokens_per_s": bad})


def test_the_local_stack_drains_at_its_simulated_pods_clock() -> None:
    """``ace-extproc up`` (and the live benchmark) run the pods on a scaled clock: the
    router's prefill rate follows it, from the TTFT model the pods run; a rate the user
    set is kept."""
    from ace_extproc.latency import get_model
    from ace_extproc.stack import StackError, StackOptions, sim_router_settings

    default = get_model("llama-3.3-70b-fp8-tp4").prefill_tokens_per_s
    assert sim_router_settings(StackOptions(time_scale=0.01)) == {
        "prefill_tokens_per_s": pytest.approx(default * 100)
    }
    small = get_model("llama-3.1-8b-fp8").prefill_tokens_per_s
    for args in (["--ttft-model", "llama-3.1-8b-fp8"], ["--ttft-model=llama-3.1-8b-fp8"]):
        router = sim_router_settings(StackOptions(time_scale=0.5, sim_args=args))
        assert router["prefill_tokens_per_s"] == pytest.approx(small * 2)
    kept = StackOptions(time_scale=0.01, router={"prefill_tokens_per_s": 7.0})
    assert sim_router_settings(kept)["prefill_tokens_per_s"] == 7.0
    assert "prefill_tokens_per_s" not in sim_router_settings(StackOptions(time_scale=0))
    with pytest.raises(StackError, match="unknown TTFT model"):
        sim_router_settings(StackOptions(time_scale=0.01, sim_args=["--ttft-model", "nope"]))


def test_drains_closer_than_a_millisecond_apart_leave_the_queue_for_the_next() -> None:
    fleet = FleetState(sim_fleet(["127.0.0.1:1"]))
    monitor = FleetMonitor(fleet, BlockIndex(100), Settings())
    load = fleet.load[0]
    start = time.monotonic() + 0.01
    monitor.load.drain(start)
    load.queued_prefill_ms = 400.0
    monitor.load.drain(start + 0.0005)
    assert load.queued_prefill_ms == 400.0  # half a millisecond: not yet
    monitor.load.drain(start + 0.002)
    assert load.queued_prefill_ms == pytest.approx(398.0)  # all 2 ms


def test_picks_add_their_uncached_prompt_to_the_queue_when_monitored() -> None:
    cfg = Config(sim_fleet(["127.0.0.1:1"]), Settings(salt_secret=b"s"))
    proc = build(cfg).processor  # a monitor, not started: the accounting is on
    proc.fleet.load[0].running = 3  # busy, with nothing waiting, at its last scrape
    body = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}
    )
    headers = {":path": "/v1/chat/completions", ":method": "POST"}
    proc.on_body(proc.on_headers(headers, False), body)
    model = get_model(cfg.settings.ttft_model)
    first = proc.fleet.load[0].queued_prefill_ms
    # ~4 KB of prompt at ~4 bytes a token, nothing cached, priced by the model.
    assert model.prefill_work_ms(990) < first < model.prefill_work_ms(1010)
    proc.on_body(proc.on_headers(headers, False), body)
    # The repeat is mostly warm: it queues only its uncached tail.
    assert 0 < proc.fleet.load[0].queued_prefill_ms - first < model.prefill_work_ms(200, 800)


def test_shadow_s_picks_queue_nothing() -> None:
    """In shadow the request goes where Envoy's default route sends it, not to the pod
    ace-extproc would pick: that pod's queue is not charged (its scrapes tell its load)."""
    cfg = Config(sim_fleet(["127.0.0.1:1"]), Settings(salt_secret=b"s", mode=Mode.SHADOW))
    proc = build(cfg).processor
    body = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}
    )
    headers = {":path": "/v1/chat/completions", ":method": "POST"}
    outcome = proc.on_body(proc.on_headers(headers, False), body)
    assert outcome.would_pick is not None  # it decided ...
    assert proc.fleet.load[0].queued_prefill_ms == 0.0  # ... and charged no one


def test_requests_waiting_on_a_pod_the_estimate_calls_free_are_counted() -> None:
    """A pod slower than its TTFT model: the estimate drains before the engine is done,
    and a scrape then finds requests waiting there. Each such scrape is counted (an
    operator's sign to recalibrate); waiting behind prefill the estimate still holds,
    or an idle engine, is not."""
    settings = Settings(ttft_model="vllm-cpu-tiny")
    fleet = FleetState(sim_fleet(["127.0.0.1:1", "127.0.0.1:2"]))
    now = [10.0]
    load = LoadAccounting(fleet, settings, clock=lambda: now[0])
    monitor = FleetMonitor(fleet, BlockIndex(100), settings, load)
    load.sent(0, 25_000)
    busy = EngineStats(engine="vllm", running=1, waiting=2, kv_usage=0.5)
    monitor.apply(0, busy)  # waiting behind what the estimate holds: priced
    assert fleet.load[0].underpriced == 0
    now[0] += 60.0  # far past the model's prefill: the estimate has drained
    monitor.apply(0, busy)
    monitor.apply(0, busy)
    monitor.apply(1, EngineStats(engine="vllm", running=0, waiting=0, kv_usage=0.0))
    assert (fleet.load[0].underpriced, fleet.load[1].underpriced) == (2, 0)
    telemetry = Telemetry(settings, fleet, BlockIndex(100), monitor, process_metrics=False)
    text = generate_latest(telemetry.registry).decode()
    pod = fleet.pods[0]
    series = f'ace_pod_underpriced_waits_total{{destination="{pod.destination}",pod="{pod.id}"}}'
    assert f"{series} 2.0" in text
