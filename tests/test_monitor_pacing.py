"""The monitor's requests are spread over their interval and bounded in rate, so that
watching a large fleet never holds the event loop the request path shares."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from ace_extproc.config import ConfigError, Destination, Fleet, Pod, Settings, parse_settings
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.monitor import FleetMonitor
from tests.conftest import serving

METRICS = (
    b'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'
)


def _fleet(pods: int, port: int) -> FleetState:
    """``pods`` pods, all answered by one server (each its own id, the same address)."""
    members = tuple(Pod("d", f"p{i}", "127.0.0.1", port) for i in range(pods))
    return FleetState(Fleet((Destination("d", "vllm", f"http://127.0.0.1:{port}", members),)))


def test_the_intervals_stretch_once_the_fleet_outgrows_the_budget() -> None:
    settings = Settings(scrape_interval_s=0.1, probe_interval_s=1.0, monitor_max_requests_per_s=110)
    small = FleetMonitor(_fleet(10, 1), BlockIndex(10), settings)  # 10 x (10 + 1) = 110/s
    assert small.stretch() == 1.0
    large = FleetMonitor(_fleet(40, 1), BlockIndex(10), settings)  # 440/s wanted
    assert large.stretch() == pytest.approx(4.0)
    unbounded = Settings(scrape_interval_s=0.1, probe_interval_s=1.0, monitor_max_requests_per_s=0)
    assert FleetMonitor(_fleet(40, 1), BlockIndex(10), unbounded).stretch() == 1.0
    no_probes = Settings(scrape_interval_s=0.1, probe_interval_s=0, monitor_max_requests_per_s=200)
    assert FleetMonitor(_fleet(40, 1), BlockIndex(10), no_probes).stretch() == pytest.approx(2.0)


def test_requests_are_spread_over_the_interval_and_kept_to_the_budget() -> None:
    """40 pods, scrapes every 100 ms and probes every second want 440 requests a
    second; with a budget of 100 they get about 100, one every ~10 ms, never a burst
    of one per pod (which is what every round used to be)."""
    seen: list[float] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        return web.Response(body=METRICS, content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        return web.Response()

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        async with serving(app) as port:
            settings = Settings(
                scrape_interval_s=0.1, probe_interval_s=1.0, monitor_max_requests_per_s=100
            )
            monitor = FleetMonitor(_fleet(40, port), BlockIndex(10), settings)
            await monitor.start()
            try:
                await asyncio.sleep(2.0)
            finally:
                await monitor.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
    window = [t for t in seen if t >= seen[0] + 0.5]  # past the first moments
    # Spread: within any 20 ms, a few requests at most (a round of 40 at once before).
    most = max(sum(1 for u in window if t <= u < t + 0.02) for t in window)
    assert most <= 4, most
    rate = len(window) / (window[-1] - window[0])
    assert 70 <= rate <= 125, rate


def test_the_budget_setting_is_checked() -> None:
    assert parse_settings({"monitor_max_requests_per_s": 50}).monitor_max_requests_per_s == 50.0
    assert parse_settings({}).monitor_max_requests_per_s == 200.0
    for bad in (-1, float("inf"), "fast"):
        with pytest.raises(ConfigError, match=r"router\.monitor_max_requests_per_s"):
            parse_settings({"monitor_max_requests_per_s": bad})


def test_a_destination_s_key_goes_with_its_probes_and_scrapes() -> None:
    """An engine that guards /health and /metrics with its API key: with api_key_env the
    monitor is let in (the pod stays up and is scraped); without, it is not."""
    from ace_extproc.config import parse_fleet

    async def guarded(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer pod-key":
            return web.Response(status=401)
        body = METRICS if request.path == "/metrics" else b""
        return web.Response(body=body, content_type="text/plain")

    async def watch(keyed: bool) -> tuple[int, bool]:
        app = web.Application()
        app.router.add_get("/health", guarded)
        app.router.add_get("/metrics", guarded)
        async with serving(app) as port:
            dest = {"id": "d", "base_url": f"http://127.0.0.1:{port}"}
            if keyed:
                dest["api_key_env"] = "POD_KEY"
            fleet = FleetState(parse_fleet({"destinations": [dest]}, env={"POD_KEY": "pod-key"}))
            settings = Settings(scrape_interval_s=0.05, probe_interval_s=0.05, unhealthy_after=2)
            monitor = FleetMonitor(fleet, BlockIndex(10), settings)
            await monitor.start()
            try:
                await asyncio.sleep(0.6)
            finally:
                await monitor.stop()
            return monitor.scrapes, fleet.is_available(0)

    scrapes, up = asyncio.run(watch(keyed=True))
    assert scrapes > 0 and up
    scrapes, up = asyncio.run(watch(keyed=False))
    assert scrapes == 0 and not up


def _two_pods(fast_port: int, slow_port: int) -> FleetState:
    members = (
        Pod("d", "fast", "127.0.0.1", fast_port),
        Pod("d", "slow", "127.0.0.1", slow_port),
    )
    base = f"http://127.0.0.1:{fast_port}"
    return FleetState(Fleet((Destination("d", "vllm", base, members),)))


async def _scrapes_in(settings: Settings, slow_s: float, seconds: float) -> tuple[int, int, Any]:
    """Scrapes of a pod answering at once and of one answering after ``slow_s``, in
    ``seconds``; and the slow pod's ``scrape_timing``."""
    counts = {"fast": 0, "slow": 0}

    def answer(name: str, delay: float) -> Any:
        async def metrics(request: web.Request) -> web.Response:
            counts[name] += 1
            await asyncio.sleep(delay)
            return web.Response(body=METRICS, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics/", metrics)  # where the monitor asks, as on vLLM
        return app

    async with serving(answer("fast", 0)) as fast, serving(answer("slow", slow_s)) as slow:
        monitor = FleetMonitor(_two_pods(fast, slow), BlockIndex(10), settings)
        await monitor.start()
        try:
            await asyncio.sleep(seconds)
        finally:
            await monitor.stop()
        return counts["fast"], counts["slow"], monitor.scrape_timing(1)


def test_a_pod_whose_scrapes_are_slow_is_read_less_often() -> None:
    """A scrape that takes 60 ms at a share of 0.25 puts the next 240 ms later (the
    pod's server rendering for at most a quarter of the time); the pod that answers
    at once is still read every interval. With the share off, the slow pod is read as
    often as its answers allow (each 60 ms one in flight skips a round)."""
    base = {"scrape_interval_s": 0.05, "probe_interval_s": 0.0, "monitor_max_requests_per_s": 0}
    bounded = Settings(**base, scrape_max_engine_share=0.25)  # type: ignore[arg-type]
    fast, slow, timing = asyncio.run(_scrapes_in(bounded, 0.06, 2.0))
    assert fast >= 25, fast  # ~40: every 50 ms
    assert 3 <= slow <= 10, slow  # ~7: every 250-300 ms (whole rounds)
    took, gap, _ = timing
    assert took >= 0.06 and gap == pytest.approx(min(took / 0.25, 0.5))
    unbounded = Settings(**base, scrape_max_engine_share=0.0)  # type: ignore[arg-type]
    _, every_other_round, timing = asyncio.run(_scrapes_in(unbounded, 0.06, 2.0))
    assert every_other_round >= 2 * slow, (every_other_round, slow)  # ~20
    assert timing[1] == pytest.approx(0.05)


def test_a_slow_pod_is_still_read_every_ten_intervals() -> None:
    """However slow the answers, or timed out, the gap stays within ten intervals:
    between scrapes the router's figures only count its own picks."""
    settings = Settings(
        scrape_interval_s=0.05,
        probe_interval_s=0.0,
        probe_timeout_s=0.1,
        monitor_max_requests_per_s=0,
        scrape_max_engine_share=0.001,  # 60 ms would want a minute
    )
    _, slow, timing = asyncio.run(_scrapes_in(settings, 0.06, 2.0))
    assert 3 <= slow <= 5, slow  # every 0.5 s
    assert timing[1] == pytest.approx(0.5)
    _, slow, timing = asyncio.run(_scrapes_in(settings, 0.3, 2.0))  # times out at 0.1 s
    assert 3 <= slow <= 5, slow
    assert timing[:2] == (pytest.approx(0.1, abs=0.05), pytest.approx(0.5))
    assert slow - 1 <= timing[2] <= slow  # the last one may have been cut short


def test_the_share_setting_is_checked() -> None:
    assert parse_settings({}).scrape_max_engine_share == 0.05
    assert parse_settings({"scrape_max_engine_share": 0}).scrape_max_engine_share == 0.0
    for bad in (-0.1, 1.5, "a little"):
        with pytest.raises(ConfigError, match=r"router\.scrape_max_engine_share"):
            parse_settings({"scrape_max_engine_share": bad})
