"""Router replicas that share what they placed, so N of them route as one.

Each replica learns only from the requests it routes: which blocks each pod holds,
where each session went, the prefill it queued on each pod. Behind Envoy, N replicas
each see 1/N of the traffic, so each prices pods against a third of their queue and
follows prefixes it never saw placed (measured in the fleet simulation: with three
replicas TTFT p99 rises 1.5-3.6 times; ``bench/RESULTS.md``). With ``router.share_url``
set, every replica publishes each placement on a Redis pub/sub channel and applies
the others' to its own index, session map and load view, as if it had routed them.

The same channel carries where each stored Responses-API response lives (its
tenant, id and pod: ``routing/homes.py``), so a later turn naming it goes to the pod
that holds it whichever replica gets the turn. Unlike a placement, a lost one of these
is not corrected by later traffic: the turn it would have pinned is routed by its
prefix, and the engine answers 404 if it lands elsewhere.

Nothing on the request path touches the network: a pick appends one tuple to an
outbox (``note``); a task publishes the outbox in batches every ``flush_s``, another
applies what arrives between requests, on the same event loop. Pub/sub delivers at
most once, and that is enough: a lost batch leaves an index a little staler, which
the next placements and the pods' own scrapes correct. Redis down costs sharing,
never a request: the outbox is bounded, and both tasks reconnect with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit, urlunsplit

import msgspec

from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.homes import ResponseHomes
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.load import LoadAccounting

log = logging.getLogger("ace_extproc.replicas")

VERSION = 1  # a placement batch's first element; a batch of stored responses' is HOMES
HOMES = 2
DEFAULT_CHANNEL = "ace-extproc:placements"
FLUSH_S = 0.002  # a batch waits this long for company: one message per ~burst
MAX_OUTBOX = 50_000  # placements held while Redis is away; beyond, the newest are dropped
_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


class Placement(NamedTuple):
    """A request one replica sent to a pod: what the others should learn from it."""

    pod: str  # Pod.key: slots differ between replicas whose discovery saw pods in turn
    blocks: Sequence[int]  # the prompt's chained block hashes, as recorded in the index
    tenant: str
    session: str | None  # x-session-id / x-user-id
    queued_tokens: int  # its uncached prompt tokens: prefill now queued on the pod


class StoredHome(NamedTuple):
    """A stored Responses-API response and the pod that holds it (``routing/homes.py``)."""

    tenant: str
    response_id: str
    pod: str  # Pod.key


# Typed, so a wrong shape fails the decode instead of the code that reads it.
_Row = tuple[str, bytes, str, str | None, int]


class _Placements(msgspec.Struct, array_like=True, tag=VERSION):
    replica: str
    block_bytes: int
    rows: list[_Row]


class _Homes(msgspec.Struct, array_like=True, tag=HOMES):
    replica: str
    rows: list[tuple[str, str, str]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Placements | _Homes)


def encode(replica: str, block_bytes: int, placements: Sequence[Placement]) -> bytes:
    """One message: ``[version, replica, block_bytes, [[pod, blocks, tenant, session,
    tokens], ...]]`` in msgpack, each prompt's hashes packed as little-endian uint64."""
    rows = [(p.pod, _pack(p.blocks), p.tenant, p.session, p.queued_tokens) for p in placements]
    return _ENCODER.encode(_Placements(replica, block_bytes, rows))


def encode_homes(replica: str, homes: Sequence[StoredHome]) -> bytes:
    """One message: ``[2, replica, [[tenant, response id, pod], ...]]`` in msgpack. A
    replica older than these reads it as a malformed placement batch and ignores it."""
    return _ENCODER.encode(_Homes(replica, [(h.tenant, h.response_id, h.pod) for h in homes]))


class HomesBatch(NamedTuple):
    replica: str
    homes: list[StoredHome]


def decode_any(data: bytes) -> tuple[str, int, list[Placement]] | HomesBatch:
    """``(replica, block_bytes, placements)`` of a placement batch, or a ``HomesBatch``;
    ``ValueError`` for anything malformed."""
    try:
        message = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a placement batch: {exc}") from None
    if isinstance(message, _Homes):
        return HomesBatch(message.replica, [StoredHome(*row) for row in message.rows])
    placements = []
    for pod, packed, tenant, session, tokens in message.rows:
        if len(packed) % 8:
            raise ValueError("block hashes not a whole number of uint64")
        placements.append(Placement(pod, _unpack(packed), tenant, session, max(tokens, 0)))
    return message.replica, message.block_bytes, placements


def decode(data: bytes) -> tuple[str, int, list[Placement]]:
    """``(replica, block_bytes, placements)`` (none for a batch of stored homes);
    ``ValueError`` for anything malformed."""
    message = decode_any(data)
    if isinstance(message, HomesBatch):
        return message.replica, 0, []
    return message


def _pack(blocks: Sequence[int]) -> bytes:
    packed = array("Q", blocks)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes) -> array[int]:
    """An ``array("Q")``, not a list: the index's C record reads it in place (no int
    made for each hash); as a sequence it gives ints like the list would."""
    packed = array("Q")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


def redacted_url(url: str) -> str:
    """``url`` with its password, if it has one, as ``****``: for logs and ``ctl config``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:****@{host}"))


class PlacementSink(Protocol):
    """Where ``Processor`` reports each placement it makes (``ReplicaSync``, or the
    fleet simulation's stand-in for Redis)."""

    def note(
        self, pod: str, blocks: Sequence[int], tenant: str, session: str | None, tokens: int
    ) -> None: ...


class HomeSink(Protocol):
    """Where ``Observer`` reports each stored response it sees (``ReplicaSync``)."""

    def note_home(self, tenant: str, response_id: str, pod: str) -> None: ...


class Learner:
    """Applies other replicas' placements to this replica's routing state."""

    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        remember: Callable[[tuple[str, str], int, int], None] | None,
        load: LoadAccounting | None = None,
        homes: ResponseHomes | None = None,
    ) -> None:
        """``remember``: the picker's session map (``Pipeline.remember``), if it has one.
        ``load``: the accounting each placement adds to (None where the load view is
        kept some other way: the simulation's). ``homes``: where the others' stored
        responses are noted."""
        self.fleet = fleet
        self.index = index
        self.remember = remember
        self.load = load
        self.homes = homes
        self.applied = 0  # placements learned, for tests and the log
        self.skipped = 0  # for pods this replica does not route to (not, or no longer)
        self.homes_learned = 0  # stored responses learned

    def apply_homes(self, homes: Sequence[StoredHome]) -> None:
        """Where the others' stored responses are: noted as if this replica had seen
        them (a pod not known here is noted too: a lookup says it is not in the fleet)."""
        if self.homes is None:
            return
        for h in homes:
            self.homes.remember(h.tenant, h.response_id, h.pod)
        self.homes_learned += len(homes)

    def apply(self, placements: Sequence[Placement]) -> None:
        fleet, index, remember = self.fleet, self.index, self.remember
        for p in placements:
            slot = fleet.slot_of(p.pod)
            if slot is None or not fleet.is_member(slot):
                self.skipped += 1
                continue
            index.record(slot, p.blocks)
            if remember is not None and p.session is not None:
                remember((p.tenant, p.session), slot, len(p.blocks))
            self.applied += 1
            if self.load is not None:
                # Priced as if nothing were cached: a placement carries its uncached
                # tokens only (the attention over a warm prefix is left out).
                self.load.sent(slot, p.queued_tokens)


class ReplicaSync:
    """Publishes this replica's placements and applies the others', through Redis."""

    def __init__(
        self,
        learner: Learner,
        url: str,
        block_bytes: int,
        channel: str = DEFAULT_CHANNEL,
        flush_s: float = FLUSH_S,
        password: str = "",
    ) -> None:
        """``password``: Redis's, when not in ``url`` (router.share_password_env)."""
        self.learner = learner
        self.url = url
        self._password = password or None
        self.channel = channel
        self.block_bytes = block_bytes
        self.flush_s = flush_s
        self.replica = os.urandom(8).hex()  # tells this replica's own messages apart
        self._outbox: list[Placement] = []
        self._homes: list[StoredHome] = []  # stored responses to tell the others of
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: list[Any] = []
        self.published = 0  # placements sent
        self.dropped = 0  # placements not sent: the outbox was full (Redis away)
        self.homes_published = 0  # stored responses' homes sent
        self.homes_dropped = 0
        self.subscribed = asyncio.Event()  # set while the subscription is live
        self._complaints: set[str] = set()  # logged once per outage

    def stats(self) -> dict[str, int]:
        """For the metrics (``ace_share_*``): read from the metrics thread, plain ints."""
        return {
            "published": self.published,
            "dropped": self.dropped,
            "learned": self.learner.applied,
            "skipped": self.learner.skipped,
            "subscribed": int(self.subscribed.is_set()),
            "homes_published": self.homes_published,
            "homes_dropped": self.homes_dropped,
            "homes_learned": self.learner.homes_learned,
        }

    # ------------------------------------------------------------ request path

    def note(
        self, pod: str, blocks: Sequence[int], tenant: str, session: str | None, tokens: int
    ) -> None:
        """A placement this replica made: queued for the others (no I/O here)."""
        if len(self._outbox) >= MAX_OUTBOX:
            self.dropped += 1
            return
        self._outbox.append(Placement(pod, blocks, tenant, session, tokens))
        if not self._wake.is_set():
            self._wake.set()

    def note_home(self, tenant: str, response_id: str, pod: str) -> None:
        """A stored response this replica saw answered: queued for the others."""
        if len(self._homes) >= MAX_OUTBOX:
            self.homes_dropped += 1
            return
        self._homes.append(StoredHome(tenant, response_id, pod))
        if not self._wake.is_set():
            self._wake.set()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._tasks:
            return
        import redis.asyncio as redis  # only replicas that share need the client

        # Separate connections: a subscribed connection can do nothing else.
        options: dict[str, Any] = {"socket_connect_timeout": 1.0}
        if self._password is not None:
            options["password"] = self._password
        publisher = redis.Redis.from_url(self.url, socket_timeout=1.0, **options)
        # A subscription waits for messages with no deadline; pinging an idle one finds a
        # connection that died silently (a failover, a dropped NAT entry) and reconnects.
        subscriber = redis.Redis.from_url(self.url, health_check_interval=5, **options)
        self._clients = [publisher, subscriber]
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._publish(publisher), name="ace-share-publish"),
            loop.create_task(self._subscribe(subscriber), name="ace-share-subscribe"),
        ]

    async def stop(self) -> None:
        """Stop both tasks; placements still in the outbox are published first, briefly."""
        tasks, self._tasks = self._tasks, []
        if not tasks:
            return
        if self._outbox or self._homes:
            # Shutting down: what cannot be sent now is only sharing lost.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(self._clients[0]), timeout=1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in self._clients:
            await client.aclose()
        self._clients = []
        self.subscribed.clear()

    # ------------------------------------------------------------ the two tasks

    async def _publish(self, client: Any) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)  # let a burst's placements share a message
            self._wake.clear()
            try:
                await self._send(client)
            except Exception as exc:  # any client error: back off, go on
                self._complain("publish", exc)
                failures += 1
                await asyncio.sleep(_BACKOFF_S[min(failures, len(_BACKOFF_S)) - 1])
                if self._outbox or self._homes:
                    self._wake.set()
                continue
            failures = 0
            self._resolved("publish")

    async def _send(self, client: Any) -> None:
        homes, self._homes = self._homes, []
        if homes:
            try:
                await client.publish(self.channel, encode_homes(self.replica, homes))
            except BaseException:
                self._homes[:0] = homes[: max(0, MAX_OUTBOX - len(self._homes))]
                raise
            self.homes_published += len(homes)
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        try:
            await client.publish(self.channel, encode(self.replica, self.block_bytes, batch))
        except BaseException:
            # Kept for the next try, ahead of what came since (bounded all the same).
            self._outbox[:0] = batch[: max(0, MAX_OUTBOX - len(self._outbox))]
            raise
        self.published += len(batch)

    async def _subscribe(self, client: Any) -> None:
        failures = 0
        while True:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                self._resolved("subscribe")
                failures = 0
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._receive(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnect whatever went wrong
                self.subscribed.clear()
                self._complain("subscribe", exc)
                failures += 1
                await asyncio.sleep(_BACKOFF_S[min(failures, len(_BACKOFF_S)) - 1])
            finally:
                await _close_quietly(pubsub)

    def _receive(self, data: object) -> None:
        if not isinstance(data, bytes):
            return
        try:
            message = decode_any(data)
        except ValueError as exc:
            self._complain("message", exc)
            return
        if message[0] == self.replica:
            return  # our own, echoed back
        if isinstance(message, HomesBatch):  # no hashes to disagree on
            self.learner.apply_homes(message.homes)
            return
        replica, block_bytes, placements = message
        if block_bytes != self.block_bytes:
            # Its hashes cover other spans of the prompt: they would never match ours.
            self._complain(
                "block_bytes",
                f"replica {replica} hashes {block_bytes}-byte blocks, this one "
                f"{self.block_bytes}: its placements are ignored (set router.block_bytes alike)",
            )
            return
        self.learner.apply(placements)

    def _complain(self, what: str, problem: object) -> None:
        if what not in self._complaints:
            self._complaints.add(what)
            log.warning("replica sharing (%s, %s): %s", what, self.channel, problem)

    def _resolved(self, what: str) -> None:
        if what in self._complaints:
            self._complaints.discard(what)
            log.info("replica sharing (%s, %s): working again", what, self.channel)


async def _close_quietly(pubsub: Any) -> None:
    with contextlib.suppress(Exception):  # the connection is being dropped anyway
        await pubsub.aclose()
