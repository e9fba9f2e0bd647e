"""KV cache events on ZMQ, in vLLM's wire format (``vllm/distributed/kv_events.py``).

What a subscriber sees is what a vLLM pod started with ``--kv-events-config`` sends:

* a PUB socket sends multipart ``[topic, seq (8 bytes, big-endian), payload]``, ``seq``
  counting batches from 0;
* ``payload`` is msgpack of ``KVEventBatch``: the array ``[ts, [events], dp_rank]``,
  each event a map tagged ``{"type": "BlockStored", ...}`` whose fields, their order and
  the omitted defaults are vLLM's (the structs below mirror vLLM's, so msgspec encodes
  them to the same bytes; ``tests/engines/test_sim_kv_events_parity.py`` checks it);
* an optional ROUTER socket answers ``[b"", start seq]`` with every buffered batch from
  that seq on, then the end marker ``[b"", b"", seq -1, b""]``.

One batch per engine step (the sim's prefill batch), published at the step's end as
vLLM's scheduler does, or ``delay_ms`` later (to model engines whose events lag).
Sending never blocks the event loop: a PUB socket drops rather than waits (no
subscriber, or one past the high-water mark).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # replay's end marker, as vLLM's
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


# -- the wire structs: vLLM's field names, order and defaults ---------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name: encoded as a map whose first key is ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- configuration ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same keys, same defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # accepted; the sim has no queue to bound
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        if config.publisher not in (None, "zmq", "null"):
            raise ValueError(f"publisher {config.publisher!r}: the sim has 'zmq' and 'null'")
        if config.buffer_steps < 1 or config.hwm < 0:
            raise ValueError("buffer_steps must be positive and hwm not negative")
        return config


# -- endpoints --------------------------------------------------------------------------


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcards and ipc/inproc; connect (to a subscriber) otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def advertised_host(http_host: str) -> str:
    """The address subscribers should dial: the pod's own when it binds one, else this
    node's outward IP (vLLM's ``get_ip``: the source address of a route; nothing is sent)."""
    if http_host not in _WILDCARD_HOSTS:
        return http_host
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("8.8.8.8", 80))
        return str(s.getsockname()[0])
    return "127.0.0.1"


def _tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _split_tcp(endpoint: str) -> tuple[str, str]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), port


def bind(sock: zmq.Socket[Any], endpoint: str, host: str) -> str:
    """Bind ``sock`` and return the endpoint a subscriber dials (no wildcard in it).

    ``tcp://*:0`` binds ``host`` on a free port (vLLM binds the node's IP so); other
    wildcards bind as given and report ``host`` in place of the wildcard.
    """
    if endpoint == "tcp://*:0":
        endpoint = _tcp(host, 0)
    tcp = endpoint.startswith("tcp://")
    if tcp and (":" in _split_tcp(endpoint)[0] or ":" in host):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind KV events endpoint {endpoint}: {exc}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if not tcp:
        return bound
    bound_host, port = _split_tcp(bound)
    return _tcp(host if bound_host in _WILDCARD_HOSTS else bound_host, port)


# -- the publisher ----------------------------------------------------------------------


class KVEventPublisher:
    """Collects one step's events and publishes them as one batch.

    The engine calls :meth:`stored`, :meth:`removed` and :meth:`cleared` as the cache
    changes and :meth:`flush` at the end of each step.  Use within one event loop.
    """

    def __init__(self, config: KVEventsConfig, *, host: str, delay_ms: float = 0.0) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must not be negative")
        self.config = config
        self.delay_s = delay_ms / 1000
        self.host = advertised_host(host)
        self.endpoint: str | None = None  # where subscribers dial, once started
        self.replay_endpoint: str | None = None
        self._topic = config.topic.encode("utf-8")
        self._encode = msgspec.msgpack.Encoder().encode
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._due: deque[tuple[float, KVEventBatch]] = deque()  # delayed batches, in order
        self._timer: asyncio.TimerHandle | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's seq)."""
        return self._seq

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self.config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if is_bind_endpoint(self.config.endpoint):
                self.endpoint = bind(self._pub, self.config.endpoint, self.host)
            else:  # vLLM connects to a concrete endpoint (an XSUB/SUB that binds)
                self._pub.connect(self.config.endpoint)
                self.endpoint = self.config.endpoint
            if self.config.replay_endpoint is not None:
                self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = bind(self._replay, self.config.replay_endpoint, self.host)
                self._replay_task = asyncio.create_task(self._serve_replay())
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Close the sockets; batches still delayed are dropped."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._replay, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._replay = self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def source(self) -> dict[str, Any]:
        """This publisher's entry in ``GET /kv_event_sources`` (vLLM's KVEventsConfig,
        with the endpoints subscribers dial)."""
        out = dataclasses.asdict(self.config)
        out.update(publisher="zmq", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)
        return out

    # -- events -----------------------------------------------------------------------
    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        extra_keys: list[tuple[Any, ...] | None],
        lora: tuple[int, str] | None = None,
    ) -> None:
        # group_idx and the spec kind are what vLLM 0.32 stamps on a full-attention
        # model's events (one KV cache group); ``lora``: the adapter's (id, name).
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=token_ids,
                block_size=block_size,
                lora_id=None if lora is None else lora[0],
                medium=MEDIUM_GPU,
                lora_name=None if lora is None else lora[1],
                extra_keys=extra_keys or None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )

    def removed(self, hashes: Sequence[int]) -> None:
        # vLLM sends one event per evicted block.
        append = self._events.append
        for h in hashes:
            append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def flush(self) -> None:
        """End of a step: publish its events as one batch (none if there were none)."""
        if not self._events:
            return
        batch = KVEventBatch(ts=time.time(), events=self._events, data_parallel_rank=0)
        self._events = []
        if self.delay_s <= 0 and not self._due:
            self._send(batch)
            return
        loop = asyncio.get_running_loop()
        self._due.append((loop.time() + self.delay_s, batch))
        if self._timer is None:
            self._timer = loop.call_at(self._due[0][0], self._send_due)

    def _send_due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = self._due
        while due and due[0][0] <= now:
            self._send(due.popleft()[1])
        if due:
            self._timer = loop.call_at(due[0][0], self._send_due)

    def _send(self, batch: KVEventBatch) -> None:
        seq, payload = self._seq, self._encode(batch)
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._pub is None:
            return  # not started or stopped: counted and buffered, not sent
        # Past the high-water mark the message is dropped, as from vLLM's PUB.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    # -- replay -----------------------------------------------------------------------
    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV events replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            await self._replay_from(sock, client, int.from_bytes(start, "big"))

    async def _replay_from(self, sock: zmq.asyncio.Socket, client: bytes, start: int) -> None:
        for seq, payload in list(self._buffer):
            if seq >= start:
                await sock.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        await sock.send_multipart((client, b"", b"", END_SEQ, b""))
