"""The pods' load and health, kept fresh off the request path.

Two loops on the server's event loop share one keep-alive ``aiohttp`` session:

* **scrape**: every ``scrape_interval_s``, each pod's ``/metrics`` (vLLM or SGLang
  names, ``metrics_text``) corrects the load accounting (``load.py``: running,
  waiting, kv_usage, and ``inflight`` reset to running + waiting; each pick adds one,
  and its uncached prompt to the queued prefill, until the next scrape, and a scrape
  finding the engine idle clears the queue; with ``--enable-lora``, the adapters in
  use, ``vllm:lora_requests_info``: ``lora.py``). The
  first scrape that carries the KV size (``vllm:cache_config_info`` block_size x
  num_gpu_blocks, or ``sglang:max_total_num_tokens``) bounds that pod's index.
  A counter going backwards (or a new process start time) is an engine restart:
  its cache is empty, so its index is dropped.
  A pod whose scrapes are slow is read less often: its API server renders the
  exposition synchronously, on the event loop that also streams its tokens (3.6-4.6 ms
  of CPU for a real vLLM's 56 KB, ``python -m bench.scrape_cost``), and a slow answer
  is that loop busy. After a scrape that took T seconds, the pod is not read again
  for T / ``scrape_max_engine_share``, at most ``SCRAPE_BACKOFF`` intervals, so one
  replica's reads take at most that share of the pod's server.
* **probe**: every ``probe_interval_s``, ``GET /health`` within ``probe_timeout_s``.
  ``unhealthy_after`` consecutive failures take a pod out of ``fleet.available``;
  ``healthy_after`` consecutive successes bring it back. Its index is kept if its
  scrapes can tell a restart (the next one compares counters with the last before
  it went down), else emptied: a pod that was down may well have restarted.

Failures counted: a failed probe, and a scrape that cannot reach the pod (or gets a
5xx). Successes counted: a good probe. A good scrape is no health signal: vLLM's API
process still serves ``/metrics`` when its engine is dead and ``/health`` says 500. A
``/metrics`` that answers 4xx or text without the engine's series only loses load
figures, and so does one that is only slow (timed out on a live connection): a busy
engine's API server answers late, and scrapes run ten times as often as probes, so two
late ones between probes took a busy pod out (on the real CPU vLLM pods under load,
requests at moments found no pod available). ``/health`` timing out is the probe's to
count. Passive health, from the responses themselves, is ``outlier.py``'s.

Each pod's scrape or probe runs as its own task, and a pod whose previous one is
still running is skipped that round, so one slow pod never delays the others. The
round's requests are spread evenly over its interval rather than sent at once: a burst
of a request per pod held the event loop, which the request path shares, for tens of
milliseconds at 64 pods. And the two loops together send at most
``monitor_max_requests_per_s``: past that (at the default 200, fleets over 18 pods)
both intervals stretch alike, since each request costs the loop about 0.3 ms of CPU here
(``python -m bench.monitor_cost``); between scrapes the load figures are the replica's
own accounting (``inflight``, the queued prefill), as they are anyway.
Pods of ``openai`` destinations (a hosted API: no ``/metrics``, no ``/health``) are
not watched. The request path only reads ``fleet.load`` and ``fleet.available``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import ConnectionTimeoutError

from ace_extproc.config import Pod, Settings
from ace_extproc.routing import metrics_text
from ace_extproc.routing.fleet import ADDED, REMOVED, FleetState
from ace_extproc.routing.homes import ResponseHomes
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.load import LoadAccounting
from ace_extproc.routing.metrics_text import EngineStats
from ace_extproc.routing.precise import PreciseIndex

log = logging.getLogger("ace_extproc.monitor")

# Plain text: prometheus-client would gzip a 100 KB exposition for every scrape,
# costing the engine and this event loop more than the bytes saved in a cluster.
_METRICS_HEADERS = {"Accept": "text/plain", "Accept-Encoding": "identity"}
# Far above a real exposition (~100-300 KB); parsing runs on the serving loop.
MAX_METRICS_BYTES = 16 * 1024 * 1024
# A slow pod's scrapes are at most this many scrape intervals apart: between them the
# load figures are the replica's own accounting, which only counts picks, not the
# requests the engine finished.
SCRAPE_BACKOFF = 10


@dataclass(slots=True)
class _PodState:
    failures: int = 0  # consecutive
    successes: int = 0  # consecutive, counted while down
    down: bool = False
    last: EngineStats | None = None  # the previous good scrape: restart detection
    complaint: str = ""  # the last scrape problem logged, so each is logged once
    scrape_s: float | None = None  # how long the last scrape took to answer (or time out)
    scrapes_answered: int = 0  # answered or timed out: those that spaced the next
    scrape_gap_s: float = 0.0  # from the start of the last scrape to the next one
    next_scrape: float = 0.0  # loop time before which the pod is not read again
    # Where its figures are read: only the router's series, or the whole text where
    # the server does not answer that (metrics_text.SCRAPE_PATH).
    metrics_path: str = metrics_text.SCRAPE_PATH


class FleetMonitor:
    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        settings: Settings,
        load: LoadAccounting | None = None,
        precise: PreciseIndex | None = None,
        homes: ResponseHomes | None = None,
    ) -> None:
        """``load``: the accounting each scrape corrects (the process's one; a test's
        own where None). ``precise``: the event-driven index, told each engine's block
        size and KV size, and its restarts. ``homes``: the stored responses' pods, told
        of restarts too (what a restarted engine stored is gone)."""
        self.fleet = fleet
        self.index = index
        self.precise = precise
        self.homes = homes
        self.settings = settings
        self.load = load if load is not None else LoadAccounting(fleet, settings)
        self._destinations = {d.id: d for d in fleet.fleet.destinations}
        # A destination's own key (api_key_env) goes with its probes and scrapes too: an
        # engine run with an API key may guard /health and /metrics as well as /v1;
        # one that does not ignores the header.
        self._probe_headers = {
            d.id: {"Authorization": f"Bearer {d.api_key}"}
            for d in fleet.fleet.destinations
            if d.api_key
        }
        self._scrape_headers = {
            dest: {**_METRICS_HEADERS, **auth} for dest, auth in self._probe_headers.items()
        }
        self.watched: list[int] = [
            slot
            for slot, pod in enumerate(fleet.pods)
            if fleet.is_member(slot) and self._is_watched(slot)
        ]
        self._state = [_PodState() for _ in fleet.pods]
        fleet.on_change.append(self._membership)  # discovery adds and removes pods
        self._session: aiohttp.ClientSession | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._busy: dict[tuple[str, int], asyncio.Task[None]] = {}  # (kind, slot) in flight
        self._crashed: set[tuple[str, int]] = set()  # logged once: a bug would repeat
        self.scrapes = 0  # good scrapes, for tests and debugging
        self.restarts = 0  # engine restarts seen

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._session is not None:
            return  # already running
        s = self.settings
        # One bound for probes and scrapes alike; never none, or a hung pod would
        # hold its task (and skip its rounds) forever.
        timeout = s.probe_timeout_s if s.probe_timeout_s > 0 else max(s.probe_interval_s, 0.1)
        # https pods: their certificates checked as Envoy checks them (the same CAs).
        trust = ssl.create_default_context(cafile=s.upstream_ca_file or None)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=4, keepalive_timeout=30, ssl=trust
            ),
            timeout=aiohttp.ClientTimeout(total=timeout),
            raise_for_status=False,
        )
        if s.scrape_interval_s > 0:
            self._loops.append(self._every(s.scrape_interval_s, "scrape", self._scrape))
        if s.probe_interval_s > 0:
            self._loops.append(self._every(s.probe_interval_s, "probe", self._probe))

    def stretch(self) -> float:
        """How much longer than configured the intervals are, for the fleet watched
        now: 1 while the pods' scrapes and probes fit ``monitor_max_requests_per_s``."""
        s = self.settings
        budget = s.monitor_max_requests_per_s
        per_pod = sum(1 / i for i in (s.scrape_interval_s, s.probe_interval_s) if i > 0)
        wanted = len(self.watched) * per_pod
        return wanted / budget if budget > 0 and wanted > budget else 1.0

    async def stop(self) -> None:
        """Cancel the loops and whatever scrape or probe is in flight; close the
        session. Safe to call twice, or without ``start``."""
        tasks = [*self._loops, *self._busy.values()]
        self._loops.clear()
        self._busy.clear()
        for task in tasks:
            task.cancel()
        session, self._session = self._session, None
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if session is not None:
                await session.close()

    def _is_watched(self, slot: int) -> bool:
        dest = self._destinations.get(self.fleet.pods[slot].destination)
        return dest is not None and not dest.hosted

    def _membership(self, slot: int, change: str) -> None:
        """Follow the fleet: watch a pod that joined (from a clean state, as a pod
        coming back is a new process), stop watching one that left. A new list each
        time, so a loop going through the old one is never disturbed."""
        if change == ADDED:
            self._state.extend(_PodState() for _ in range(len(self.fleet.pods) - len(self._state)))
            self._state[slot] = _PodState()
            if self._is_watched(slot) and slot not in self.watched:
                self.watched = [*self.watched, slot]
        elif change == REMOVED:
            self.watched = [w for w in self.watched if w != slot]

    # ----------------------------------------------------------------- loops

    def _every(
        self, interval: float, kind: str, work: Callable[[int], Coroutine[Any, Any, None]]
    ) -> asyncio.Task[None]:
        async def loop() -> None:
            clock = asyncio.get_running_loop()
            due = clock.time()
            while True:
                watched = self.watched  # a new list on every change: this one stays
                period = interval * self.stretch()
                # One pod at a time, evenly over the period.
                step = period / len(watched) if watched else period
                for slot in watched or (-1,):  # none watched: wait a period all the same
                    key = (kind, slot)
                    if (
                        slot >= 0
                        and key not in self._busy
                        and self.fleet.is_member(slot)
                        and (kind != "scrape" or self._state[slot].next_scrape <= clock.time())
                    ):
                        task = asyncio.create_task(work(slot), name=f"ace-{kind}-{slot}")
                        self._busy[key] = task
                        task.add_done_callback(functools.partial(self._done, key))
                    # Fixed rate; after an overrun (a paused loop), restart the beat
                    # rather than firing a burst to catch up.
                    due = max(due + step, clock.time())
                    await asyncio.sleep(due - clock.time())

        return asyncio.create_task(loop(), name=f"ace-{kind}-loop")

    def _done(self, key: tuple[str, int], task: asyncio.Task[None]) -> None:
        if self._busy.get(key) is task:
            del self._busy[key]
        if not task.cancelled() and (exc := task.exception()) is not None:
            level = logging.DEBUG if key in self._crashed else logging.ERROR
            self._crashed.add(key)
            log.log(level, "monitor: %s of pod slot %d failed", *key, exc_info=exc)

    def _server_name(self, pod: Pod) -> str | None:
        """What an https pod given by IP is asked for by and checked against: its
        destination's name, as Envoy does (None: the URL's own host)."""
        dest = self._destinations.get(pod.destination)
        name = dest.server_name(pod) if pod.tls and dest is not None else None
        return None if name == pod.host else name

    async def _probe(self, slot: int) -> None:
        session = self._session
        if session is None:
            return
        pod = self.fleet.pods[slot]
        try:
            async with session.get(
                pod.base_url + "/health",
                headers=self._probe_headers.get(pod.destination),
                server_hostname=self._server_name(pod),
            ) as resp:
                await resp.read()  # drained, so the connection is kept
                ok = resp.status == 200
                why = f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, f"/health: {_describe(exc)}"
        if self.fleet.pods[slot] is not pod:
            return  # the pod left and another (or a new process) took the slot meanwhile
        if ok:
            self._succeeded(slot)
        else:
            self._failed(slot, why)

    async def _scrape(self, slot: int) -> None:
        session = self._session
        if session is None:
            return
        pod = self.fleet.pods[slot]
        clock = asyncio.get_running_loop()
        started = clock.time()
        try:
            path = self._state[slot].metrics_path
            url = pod.base_url + path
            name = self._server_name(pod)
            headers = self._scrape_headers.get(pod.destination, _METRICS_HEADERS)
            async with session.get(url, headers=headers, server_hostname=name) as resp:
                status = resp.status
                size = resp.content_length or 0
                body = await resp.read() if size <= MAX_METRICS_BYTES else b""
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, ConnectionTimeoutError):
                # Connected but slow, not gone: no figures this round (above), and the
                # longest wait before the next.
                if self.fleet.pods[slot] is pod:
                    self.answered(slot, started, clock.time() - started, math.inf)
                return
            if self.fleet.pods[slot] is pod:
                self._failed(slot, f"/metrics: {_describe(exc)}")
            return
        if self.fleet.pods[slot] is not pod:
            return  # as in _probe: the figures are another process's
        took = clock.time() - started
        self.answered(slot, started, took, took)
        if status >= 500:
            self._failed(slot, f"/metrics answered {status}")
            return
        stats = metrics_text.parse(body) if status == 200 and size <= MAX_METRICS_BYTES else None
        if path != metrics_text.METRICS_PATH and (
            status == 404 or (stats is not None and stats.engine is None)
        ):
            # No series by name here: the whole text from the next read on.
            self._state[slot].metrics_path = metrics_text.METRICS_PATH
            return
        if status != 200:
            self._complain(slot, f"/metrics answered {status}; no load figures")
            return
        if stats is None:
            self._complain(slot, f"/metrics is {size} bytes; not read")
            return
        self.apply(slot, stats)

    def answered(self, slot: int, started: float, took: float, cost: float) -> None:
        """Space the pod's next scrape by what this one cost its server (``cost``
        seconds of its time; infinite: it did not answer in time). Public, as ``apply``,
        so that it can be fed directly."""
        st = self._state[slot]
        s = self.settings
        st.scrape_s = took
        st.scrapes_answered += 1
        interval = s.scrape_interval_s * self.stretch()
        share = s.scrape_max_engine_share
        wanted = cost / share if share > 0 else 0.0
        st.scrape_gap_s = min(max(interval, wanted), SCRAPE_BACKOFF * interval)
        # Within an interval: the loop's own beat (a gate at started + interval would
        # fall just after the next round's visit and skip it).
        st.next_scrape = started + st.scrape_gap_s if wanted > interval else 0.0

    # ------------------------------------------------------------- bookkeeping

    def apply(self, slot: int, stats: EngineStats) -> None:
        """Take one scrape's figures for a pod (public so it can be fed directly)."""
        st = self._state[slot]
        if not stats.usable:
            self._complain(slot, f"/metrics: {stats.reason or 'no load figures'}")
            return
        if stats.reason:
            self._complain(slot, f"/metrics: partly unreadable: {stats.reason}")
        else:
            st.complaint = ""  # a later problem is news again
        self.scrapes += 1
        load = self.fleet.load[slot]
        running = stats.running if stats.running is not None else load.running
        waiting = stats.waiting if stats.waiting is not None else load.waiting
        self.load.observed(
            slot,
            running,
            waiting,
            stats.kv_usage,
            stats.lora,
            stats.model_name,
            stats.ttft_counters,
        )
        if st.last is not None:  # down or not: a restart while down empties it too
            why = metrics_text.restarted(st.last, stats)
            if why is not None:
                self.restarts += 1
                log.info("pod %s restarted (%s): its index is emptied", self._name(slot), why)
                self._forget(slot)
        st.last = stats
        if self.homes is not None:
            self.homes.checked(slot)
        if self.precise is not None and slot in self.precise.pods and stats.block_size:
            self.precise.set_engine_cache(slot, stats.block_size, stats.capacity_tokens)
        tokens = stats.capacity_tokens
        if tokens is not None and tokens != self.fleet.capacity_tokens[slot]:
            self.fleet.capacity_tokens[slot] = tokens
            s = self.settings
            blocks = max(1, int(tokens * s.bytes_per_token / s.block_bytes))
            self.index.set_capacity(slot, blocks)
            log.info(
                "pod %s: KV cache %d tokens, %d index blocks", self._name(slot), tokens, blocks
            )

    def _failed(self, slot: int, why: str) -> None:
        st = self._state[slot]
        st.successes = 0
        st.failures += 1
        if not st.down and st.failures >= self.settings.unhealthy_after:
            st.down = True
            self.fleet.set_available(slot, False)
            log.warning(
                "pod %s marked down after %d failures (last: %s)",
                self._name(slot),
                st.failures,
                why,
            )

    def _succeeded(self, slot: int) -> None:
        st = self._state[slot]
        st.failures = 0
        if not st.down:
            return
        st.successes += 1
        if st.successes >= self.settings.healthy_after:
            st.down = False
            st.successes = 0
            self.fleet.set_available(slot, True)
            if st.last is not None:  # its next scrape tells whether it restarted
                if self.homes is not None:
                    self.homes.back(slot)
                log.info("pod %s is back", self._name(slot))
                return
            # No counters to tell by, and down long enough to be marked so: assume a
            # restart, an empty cache.
            self._forget(slot)
            log.info("pod %s is back; its index was emptied", self._name(slot))

    def _forget(self, slot: int) -> None:
        self.index.drop_pod(slot)
        self.index.add_pod(slot)
        if self.precise is not None:
            self.precise.clear(slot)
        if self.homes is not None:
            self.homes.restarted(slot)

    def _complain(self, slot: int, what: str) -> None:
        st = self._state[slot]
        if st.complaint != what:
            st.complaint = what
            log.warning("pod %s: %s", self._name(slot), what)

    def is_down(self, slot: int) -> bool:
        return self._state[slot].down

    def scrape_timing(self, slot: int) -> tuple[float, float, int] | None:
        """The pod's last scrape: (seconds it took, seconds from its start to the
        next, scrapes so far); None before the first answer."""
        st = self._state[slot]
        if st.scrape_s is None:
            return None
        return st.scrape_s, st.scrape_gap_s, st.scrapes_answered

    def stats(self, slot: int) -> EngineStats | None:
        """The pod's last good scrape (None before the first, or since it came back)."""
        return self._state[slot].last

    def _name(self, slot: int) -> str:
        return self.fleet.pods[slot].key


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
