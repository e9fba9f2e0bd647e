"""Envoy's gRPC access-log service (ALS): each request's outcome, batched, for ``observe.py``.

Envoy's ``envoy.access_loggers.http_grpc`` logger on the HTTP connection manager
(``envoy_config._access_log_service``) sends one ``HTTPAccessLogEntry`` per finished
request on one long-lived stream per Envoy worker, many entries a message (flushed
every ``buffer_flush_interval`` or ``buffer_size_bytes``). That replaces a second
ext_proc stream per request (the observe-only filter, still used where response
bodies must be read: ``usage_capture``), at a fraction of its cost.

From each entry: the routing filter's decision (the ``ace`` dynamic metadata: mode,
action, the pod pinned and the pod picked, the saved-token estimate), the host that
answered last (``upstream_remote_address``), the status, Envoy's response flags, the
router's attempt count, and how long Envoy held the request between its last byte in
and its first byte to a pod (what routing added to its latency, by Envoy's clock).
These become an ``Observation`` for ``Observer.record``, the same passive health and
ledger as before.

The stream is authenticated as the ext_proc port is (``peer.py``: Envoy's token in
its gRPC metadata). An entry that cannot be read is skipped and counted, never
raised: a bad entry must not end the stream that carries the good ones. Envoy wants no
answer (the service is lossy by design): entries sent while ace-extproc was away are
lost, which passive health tolerates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.config.core.v3.address_pb2 import Address
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage, StreamAccessLogsResponse
from google.protobuf.message import DecodeError

from ace_extproc import peer
from ace_extproc.config import Settings
from ace_extproc.observe import Observation, Observer

log = logging.getLogger("ace_extproc.access_log")

SERVICE = "envoy.service.accesslog.v3.AccessLogService"
METHOD = "StreamAccessLogs"
METADATA_NAMESPACE = "ace"  # where mutate.metadata puts the routing decision
_LOG_EVERY_S = 60.0  # a flood of bad entries is one story


def _receive(data: bytes) -> StreamAccessLogsMessage | None:
    """The server's deserializer: a message that cannot be parsed is None, counted and
    skipped by the stream, rather than an error that would end it."""
    try:
        return StreamAccessLogsMessage.FromString(data)
    except DecodeError:
        return None


def _address(address: Address) -> str:
    """``ip:port`` (``[v6]:port``) as ``Pod.address`` spells it; "" for a pipe or none."""
    sock = address.socket_address
    host = sock.address
    if not host:
        return ""
    return f"[{host}]:{sock.port_value}" if ":" in host else f"{host}:{sock.port_value}"


def _flags(entry: HTTPAccessLogEntry) -> int:
    """Envoy's response flags as its bitmask (``response.flags``, ``observe.POD_FAULTS``):
    the proto's fields are numbered in the bits' order, field n for bit n-1."""
    mask = 0
    for field, _ in entry.common_properties.response_flags.ListFields():
        mask |= 1 << (field.number - 1)
    return mask


def observation(entry: HTTPAccessLogEntry) -> Observation | None:
    """What one entry says, or None where it reports no answer to count (the client
    left before any, or an intermediate entry of a request still under way).
    Raises on values that make no sense (a non-finite estimate): the caller skips."""
    common = entry.common_properties
    status = entry.response.response_code.value
    if not status or common.intermediate_log_entry:
        return None
    obs = Observation(status=status, attempts=common.upstream_request_attempt_count)
    if common.HasField("upstream_remote_address"):
        obs.upstream = _address(common.upstream_remote_address)
    if common.HasField("response_flags"):
        obs.flags = _flags(entry)
    if common.HasField("time_to_first_upstream_tx_byte") and common.HasField(
        "time_to_last_rx_byte"
    ):
        held = common.time_to_first_upstream_tx_byte.ToNanoseconds()
        obs.hold_ns = max(0, held - common.time_to_last_rx_byte.ToNanoseconds())
    meta = common.metadata.filter_metadata
    if METADATA_NAMESPACE in meta:
        obs.read_decision(meta[METADATA_NAMESPACE].fields)
    return obs


@dataclass(slots=True)
class Counts:
    """What the service has taken in since start."""

    streams: int = 0  # accepted
    refused: int = 0  # streams without Envoy's token
    messages: int = 0
    entries: int = 0  # recorded
    unanswered: int = 0  # entries of requests that got no answer: nothing to record
    skipped: int = 0  # unreadable messages and entries, and TCP entries


class AccessLogService:
    """``StreamAccessLogs``: every entry of every message to ``observer.record``."""

    def __init__(self, observer: Observer, settings: Settings) -> None:
        self.observer = observer
        self.token = peer.token(settings)
        self.counts = Counts()
        self._logged_at: dict[str, float] = {}

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[StreamAccessLogsMessage | None],
        context: grpc.aio.ServicerContext,
    ) -> StreamAccessLogsResponse:
        if self.token is not None and not peer.presented(
            context.invocation_metadata() or (), self.token
        ):
            self.counts.refused += 1
            self._warn(
                "refused",
                "access log: refused a stream from %s without Envoy's token (%s)",
                context.peer(),
                peer.METADATA_KEY,
            )
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not Envoy's stream")
        self.counts.streams += 1
        async for message in request_iterator:
            self.on_message(message)
        return StreamAccessLogsResponse()

    def on_message(self, message: StreamAccessLogsMessage | None) -> None:
        """One batch of entries: each recorded, or skipped and counted."""
        counts = self.counts
        if message is None:
            counts.skipped += 1
            self._warn("message", "access log: skipped a message that does not parse")
            return
        counts.messages += 1
        if message.HasField("tcp_logs"):  # not ours: only the HTTP logger is rendered
            counts.skipped += len(message.tcp_logs.log_entry)
            return
        record = self.observer.record
        for entry in message.http_logs.log_entry:
            try:
                obs = observation(entry)
                if obs is None:
                    counts.unanswered += 1
                    continue
                record(obs)
            except Exception:  # one bad entry costs itself, never the stream
                counts.skipped += 1
                self._warn("entry", "access log: skipped an entry", exc_info=True)
                continue
            counts.entries += 1

    def _warn(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._logged_at.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged_at[kind] = now
            log.warning(message, *args, exc_info=exc_info)


def add_to_server(
    server: grpc.aio.Server, observer: Observer, settings: Settings
) -> AccessLogService:
    """Serve the access-log service on ``server`` (the ext_proc server: same port,
    same TLS, same token), reporting to ``observer``."""
    service = AccessLogService(observer, settings)
    handler = grpc.stream_unary_rpc_method_handler(
        service.StreamAccessLogs,
        request_deserializer=_receive,
        response_serializer=StreamAccessLogsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
    )
    return service
