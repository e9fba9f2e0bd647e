"""Each pod's KV event stream, read off the request path into the precise index.

One task per pod that publishes events (its destination has a ``tokenizer`` and the
pod a ``kv_events`` endpoint, or its engine's ``GET /kv_event_sources`` names one):

* subscribe (ZMQ SUB) and apply each batch to ``PreciseIndex`` on the event loop the
  request path shares; a request never waits on a socket, it reads what is there;
* sequence numbers: the next one is expected. A gap asks the engine's replay socket
  (vLLM's ``replay_endpoint``) for what was missed; without one, or if the replay
  does not cover it, the pod's view is untrusted for ``rebuild_s`` (the time its
  cache takes to turn over) and the pod is routed by the approximate index. A
  sequence that starts again from 0 is a restarted engine: its cache is empty;
* the connection: a pod whose stream is down is not trusted; on reconnect, a replay
  (where there is one) or the next sequence number says whether anything was lost;
* frames that do not decode are counted and skipped (``kv_wire``).

A pod's state is one of ``precise`` (trusted), ``connecting``, ``uncertain`` (a gap
or a disconnection not yet recovered), ``mismatch`` (its events' block size is not
its engine's) or ``off`` (no stream: approximate by design). The metrics export it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio

from ace_extproc.routing.fleet import ADDED, REMOVED, RETIRED, FleetState
from ace_extproc.routing.kv_wire import (
    END_SEQ,
    Batch,
    WireError,
    decode_frames,
    decode_replay,
    replay_request,
)
from ace_extproc.routing.precise import PreciseIndex

log = logging.getLogger("ace_extproc.kv_events")

PRECISE, CONNECTING, UNCERTAIN, MISMATCH, OFF = (
    "precise",
    "connecting",
    "uncertain",
    "mismatch",
    "off",
)
STATES = (PRECISE, CONNECTING, UNCERTAIN, MISMATCH, OFF)

# A sequence number this far behind the last is a new publisher, not a straggler.
_RESTART_BACKSTEP = 1000

_CONNECTED = zmq.EVENT_CONNECTED
_DISCONNECTED = zmq.EVENT_DISCONNECTED


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where one pod publishes: its PUB socket, and its replay ROUTER socket if any."""

    publisher: str
    replay: str | None = None
    topic: str = ""


@dataclass(slots=True)
class StreamStats:
    """One pod's stream, as the metrics export it."""

    state: str = CONNECTING
    batches: int = 0
    bad_frames: int = 0  # frames that were not a batch
    skipped_events: int = 0  # events in good batches that were not understood
    gaps: int = 0  # sequence gaps seen
    replays: int = 0  # replays asked for
    replayed: int = 0  # replays that covered their gap
    restarts: int = 0  # sequences that began again (a new engine process)
    disconnects: int = 0
    lag_s: float = 0.0  # the last batch's age on arrival (the engine's clock to ours)
    last_seq: int = -1


class PodStream:
    """One pod's subscription."""

    def __init__(
        self,
        slot: int,
        name: str,
        index: PreciseIndex,
        endpoints: Endpoints | None,
        discover_url: str | None,
        *,
        rebuild_s: float,
        retry_s: float = 2.0,
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
        session: Callable[[], aiohttp.ClientSession] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slot, self.name, self.index = slot, name, index
        self.endpoints, self.discover_url = endpoints, discover_url
        self.rebuild_s, self.retry_s, self.replay_timeout_s = rebuild_s, retry_s, replay_timeout_s
        self.stats = StreamStats()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._session = session
        self._clock = clock
        self._connected = False
        self._off = False  # the engine said it publishes no events
        self._uncertain_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._complaint = ""
        index.add_pod(slot)

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events {self.name}"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.index.set_live(self.slot, False)

    # -- state ---------------------------------------------------------------------
    def refresh(self) -> str:
        """The pod's state now; trusts the pod again once an uncertain spell is over."""
        view = self.index.pods.get(self.slot)
        if view is not None and view.mismatched:
            state = MISMATCH
        elif not self._connected and self._off:
            state = OFF
        elif not self._connected:
            state = (
                CONNECTING if self.stats.last_seq < 0 and not self.stats.disconnects else UNCERTAIN
            )
        elif self._clock() < self._uncertain_until:
            state = UNCERTAIN
        else:
            state = PRECISE
        self.index.set_live(self.slot, state == PRECISE)
        if state != self.stats.state:
            log.info("pod %s: KV events %s -> %s", self.name, self.stats.state, state)
            self.stats.state = state
        return state

    def _untrust(self, why: str) -> None:
        self._uncertain_until = self._clock() + self.rebuild_s
        log.warning(
            "pod %s: KV events %s: routed approximately for %.0f s", self.name, why, self.rebuild_s
        )
        self.refresh()

    def _complain(self, what: str) -> None:
        if what != self._complaint:
            self._complaint = what
            log.warning("pod %s: KV events: %s", self.name, what)

    # -- the loop ------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                endpoints = self.endpoints or await self._discover()
                if endpoints is None:
                    await asyncio.sleep(self.retry_s)
                    continue
                await self._subscribe(endpoints)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let one pod's stream end the others'
                self._complain(f"{type(exc).__name__}: {exc}")
                self._connected = False
                self.refresh()
                await asyncio.sleep(self.retry_s)

    async def _discover(self) -> Endpoints | None:
        """The engine's own answer: ``GET /kv_event_sources`` (vLLM: per DP rank)."""
        if self.discover_url is None or self._session is None:
            return None
        try:
            async with self._session().get(
                self.discover_url, timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                doc = await r.json(content_type=None) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self._complain(f"{self.discover_url}: {type(exc).__name__}")
            return None
        found = sources_from(doc, urlsplit(self.discover_url).hostname or "127.0.0.1")
        # An engine that answers without a publisher publishes no events: approximate.
        self._off = found is None and isinstance(doc, dict)
        if found is None:
            self._complain(f"{self.discover_url}: no ZMQ publisher in {str(doc)[:120]!r}")
        return found

    async def _subscribe(self, endpoints: Endpoints) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, endpoints.topic.encode())
        monitor = sock.get_monitor_socket(_CONNECTED | _DISCONNECTED)
        sock.connect(endpoints.publisher)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(1000))
                if monitor in ready:
                    await self._on_monitor(await monitor.recv_multipart(), endpoints)
                if sock in ready:
                    await self._on_frames(await sock.recv_multipart(), endpoints)
                self.refresh()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            self._connected = False

    async def _on_monitor(self, frames: list[bytes], endpoints: Endpoints) -> None:
        event = struct.unpack("=hi", frames[0][:6])[0]
        if event == _CONNECTED:
            self._connected = True
            self._complaint = ""
            if self.stats.last_seq >= 0:  # back after a drop: was anything missed?
                await self._recover(endpoints, self.stats.last_seq + 1)
            elif endpoints.replay is not None:  # first contact: what it holds already
                await self._recover(endpoints, 0)
        elif event == _DISCONNECTED and self._connected:
            self._connected = False
            self.stats.disconnects += 1
            self._complain(f"{endpoints.publisher} disconnected")

    async def _on_frames(self, frames: list[bytes], endpoints: Endpoints) -> None:
        try:
            seq, batch = decode_frames(frames)
        except WireError as exc:
            self.stats.bad_frames += 1
            self._complain(f"bad frame: {exc}")
            return
        last = self.stats.last_seq
        if last >= 0 and seq <= last:
            # Behind: a duplicate, or one queued while a replay applied it; far behind,
            # or 0 again: a new engine process, whose cache is empty.
            if seq == 0 or seq + _RESTART_BACKSTEP < last:
                self.stats.restarts += 1
                log.info("pod %s: KV event sequence restarted (%d after %d)", self.name, seq, last)
                self.index.clear(self.slot)
                self._apply(seq, batch)
            return
        if last >= 0 and seq > last + 1:
            self.stats.gaps += 1
            # The SUB socket queues what arrives meanwhile: order is kept.
            await self._recover(endpoints, last + 1, (seq, batch))
            return
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: Batch) -> None:
        self.index.apply(self.slot, batch.events)
        stats = self.stats
        stats.batches += 1
        stats.skipped_events += batch.skipped
        stats.last_seq = seq
        stats.lag_s = max(0.0, time.time() - batch.ts) if batch.ts else 0.0

    async def _recover(
        self, endpoints: Endpoints, start: int, pending: tuple[int, Batch] | None = None
    ) -> None:
        """Ask the replay socket for the batches from ``start``, then apply ``pending``
        (the batch that showed the gap). Trusted again if the replay covered what was
        missed; else untrusted for ``rebuild_s``. ``start`` 0 is the first contact:
        what the engine did before can only be learned, not missed."""
        if endpoints.replay is None:
            if pending is not None:
                self._untrust("a gap, and no replay endpoint")
                self._apply(*pending)
            return  # a reconnect: the next sequence number tells whether any was lost
        self.stats.replays += 1
        first, ended = await self._replay(endpoints.replay, start)
        if pending is not None:
            covered = ended and self.stats.last_seq >= pending[0] - 1
        else:
            covered = ended and (first is None or first <= start)
        if covered:
            self.stats.replayed += 1
        elif start > 0:
            self._untrust(f"the replay from {start} did not cover the gap")
        if pending is not None and pending[0] > self.stats.last_seq:
            self._apply(*pending)
        self.refresh()

    async def _replay(self, endpoint: str, start: int) -> tuple[int | None, bool]:
        """Apply the replayed batches; ``(the first seq replayed, whether the end
        marker came)``."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        first: int | None = None
        try:
            sock.connect(endpoint)
            await sock.send_multipart(replay_request(start))
            deadline = self._clock() + self.replay_timeout_s
            while (left := deadline - self._clock()) > 0:
                if not await sock.poll(int(left * 1000)):
                    break
                try:
                    seq, batch = decode_replay(await sock.recv_multipart())
                except WireError:
                    self.stats.bad_frames += 1
                    continue
                if seq == END_SEQ or batch is None:
                    return first, True
                first = seq if first is None else first
                if seq > self.stats.last_seq:
                    self._apply(seq, batch)
        except zmq.ZMQError as exc:
            self._complain(f"replay {endpoint}: {exc}")
        finally:
            sock.close(linger=0)
        return first, False


def sources_from(doc: Any, host: str) -> Endpoints | None:
    """The first ZMQ publisher in a ``/kv_event_sources`` answer (vLLM: ``{rank:
    config}``; a bare config also accepted), its wildcard host made the pod's."""
    configs = (
        [doc]
        if isinstance(doc, dict) and "endpoint" in doc
        else (list(doc.values()) if isinstance(doc, dict) else [])
    )
    for config in configs:
        if not isinstance(config, dict) or config.get("publisher", "zmq") != "zmq":
            continue
        endpoint = config.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            continue
        replay = config.get("replay_endpoint")
        topic = config.get("topic") or ""
        return Endpoints(
            _concrete(endpoint, host),
            _concrete(replay, host) if isinstance(replay, str) and replay else None,
            topic if isinstance(topic, str) else "",
        )
    return None


def _concrete(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` (where the engine binds) as a subscriber reaches it."""
    scheme, _, rest = endpoint.partition("://")
    bound, _, port = rest.rpartition(":")
    if bound in ("*", "0.0.0.0", "::", "[::]", ""):
        bound = f"[{host}]" if ":" in host else host
    return f"{scheme}://{bound}:{port}"


class KvEvents:
    """Every event-publishing pod's stream, following the fleet as pods come and go:
    the pods of destinations with a tokenizer that loaded."""

    def __init__(
        self,
        fleet: FleetState,
        index: PreciseIndex,
        destinations: frozenset[str],
        *,
        rebuild_s: float,
        ssl_context: Any = None,
    ) -> None:
        self.fleet, self.index, self.destinations = fleet, index, destinations
        self.rebuild_s = rebuild_s
        self.streams: dict[int, PodStream] = {}
        self._ssl = ssl_context
        self._http: aiohttp.ClientSession | None = None
        self._running = False
        fleet.on_change.append(self._membership)
        for slot in range(len(fleet.pods)):
            self._add(slot)

    def _add(self, slot: int) -> None:
        pod = self.fleet.pods[slot]
        if pod.destination not in self.destinations or slot in self.streams:
            return
        endpoints = (
            Endpoints(pod.kv_events, pod.kv_events_replay or None) if pod.kv_events else None
        )
        stream = PodStream(
            slot,
            pod.key,
            self.index,
            endpoints,
            None if endpoints else f"{pod.base_url}/kv_event_sources",
            rebuild_s=self.rebuild_s,
            session=self._session,
        )
        self.streams[slot] = stream
        if self._running:
            stream.start()

    def _membership(self, slot: int, change: str) -> None:
        if change == ADDED:
            self._add(slot)
        elif change in (REMOVED, RETIRED):
            stream = self.streams.pop(slot, None)
            if stream is not None and self._running:
                asyncio.get_running_loop().create_task(stream.stop())
            self.index.drop_pod(slot)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl))
        return self._http

    async def start(self) -> None:
        self._running = True
        for stream in self.streams.values():
            stream.start()

    async def stop(self) -> None:
        self._running = False
        for stream in list(self.streams.values()):
            await stream.stop()
        if self._http is not None:
            await self._http.close()

    def states(self) -> dict[str, str]:
        """Each followed pod's state, by ``destination/pod``."""
        return {stream.name: stream.stats.state for stream in self.streams.values()}
