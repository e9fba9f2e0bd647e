"""Soak: 100,000 fuzzed requests (tests/fuzzing.py) through the real Envoy and
ace-extproc in front of four simulated pods, with tenants configured (so Envoy
fails closed and every body must be salted). It must end with no 5xx of the
gateway's own making, ace-extproc alive and never restarted, no bug logged, and its
memory flat. Minutes: marked slow (``pytest -m slow tests/test_soak.py``)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from yarl import URL

from tests.conftest import memory_mib
from tests.fuzzing import KEYS, Fuzzer
from tests.test_e2e import options, running

pytestmark = [pytest.mark.slow, pytest.mark.envoy]

REQUESTS = int(os.environ.get("ACE_SOAK_REQUESTS", "100000"))
CONCURRENCY = 24


def test_soak_fuzzed_requests_through_envoy() -> None:
    router = {"tenants": {"api_keys": KEYS, "header": "x-tenant-id"}}
    with running(options(router=router)) as client:
        sidecar = client.stack.procs["ace-extproc"]
        fuzzer = Fuzzer(seed=100_000)
        statuses: dict[int, int] = {}
        gateway_5xx: list[str] = []
        rss: list[float] = []

        async def soak() -> None:
            connector = aiohttp.TCPConnector(limit=CONCURRENCY)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                queue: asyncio.Queue[int] = asyncio.Queue()
                for i in range(REQUESTS):
                    queue.put_nowait(i)

                async def worker() -> None:
                    while not queue.empty():
                        i = queue.get_nowait()
                        r = fuzzer.request()
                        url = URL(client.stack.url + r.path, encoded=True)
                        async with http.request(
                            r.method, url, data=r.body or None, headers=r.headers
                        ) as resp:
                            await resp.read()
                            statuses[resp.status] = statuses.get(resp.status, 0) + 1
                            # An engine's own 5xx carries its pod header; the gateway's not.
                            if resp.status >= 500 and "x-sim-pod" not in resp.headers:
                                why = resp.headers.get("x-ace-trace-prefix-kv-cache", "")
                                gateway_5xx.append(f"{resp.status} {r.method} {r.path} {why}")
                        if i % 10_000 == 0:
                            rss.append(memory_mib(sidecar.pid))

                await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

        client.run(soak())
        rss.append(memory_mib(sidecar.pid))
        log = (client.stack.workdir / "ace-extproc.log").read_text(errors="replace")
        print(f"statuses {sorted(statuses.items())}; sidecar RSS MiB {[round(x) for x in rss]}")
        assert sum(statuses.values()) == REQUESTS
        assert not gateway_5xx, gateway_5xx[:20]
        assert sidecar.returncode is None and client.stack.procs["ace-extproc"] is sidecar
        assert "Traceback" not in log and "failed on" not in log
        # Flat: the second half adds little to the first (no leak), and it stays small.
        half = rss[len(rss) // 2]
        assert rss[-1] - half < 40, rss
        assert rss[-1] < 400, rss
