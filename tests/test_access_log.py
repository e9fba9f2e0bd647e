"""Envoy's gRPC access log into ace-extproc (access_log.py): entries read as the observe
filter read responses, passive health and the ledger from them, retried-away pins,
client faults and Envoy's own refusals counting nothing, unreadable entries skipped
without ending the stream, and Envoy's token required, over real gRPC."""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left

import grpc
import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry, TCPAccessLogEntry
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage, StreamAccessLogsResponse

from ace_extproc import access_log, server
from ace_extproc.access_log import AccessLogService, observation
from ace_extproc.app import build
from ace_extproc.config import Config, PassiveHealth, Settings, sim_fleet
from ace_extproc.observe import POD_FAULTS, Observer
from ace_extproc.routing import FleetState
from ace_extproc.routing.outlier import OutlierDetector
from ace_extproc.telemetry import BOUNDS_NS
from tests.conftest import peer_metadata, put_fields

ENVOY = peer_metadata(b"s")  # the token Envoy rendered from the same secret sends


def entry(
    status: int,
    upstream: str = "",
    *,
    attempts: int = 1,
    flags: tuple[str, ...] = (),
    **ace: str | float,
) -> HTTPAccessLogEntry:
    """What Envoy's http_grpc logger sends for one request: ``flags`` are the names of
    ``ResponseFlags`` fields, ``ace`` the routing filter's dynamic metadata."""
    e = HTTPAccessLogEntry()
    if status:
        e.response.response_code.value = status
    common = e.common_properties
    if upstream:
        host, _, port = upstream.rpartition(":")
        common.upstream_remote_address.socket_address.address = host.strip("[]")
        common.upstream_remote_address.socket_address.port_value = int(port)
    common.upstream_request_attempt_count = attempts
    for name in flags:
        setattr(common.response_flags, name, True)
    put_fields(common.metadata.filter_metadata["ace"].fields, ace)
    return e


def batch(*entries: HTTPAccessLogEntry) -> StreamAccessLogsMessage:
    msg = StreamAccessLogsMessage()
    msg.http_logs.log_entry.extend(entries)
    return msg


def service(pods: int = 3) -> AccessLogService:
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(pods)]))
    health = PassiveHealth(
        consecutive_5xx=2, consecutive_gateway_failure=2, max_ejection_percent=100
    )
    outliers = OutlierDetector(fleet, health, schedule=lambda _s, _f: None)
    return AccessLogService(Observer(fleet, outliers), Settings(salt_secret=b"s"))


def test_an_entry_says_what_the_observe_filter_read_from_a_response() -> None:
    obs = observation(
        entry(
            503,
            "[fd00::7]:8000",
            attempts=3,
            flags=("upstream_connection_failure", "upstream_retry_limit_exceeded"),
            mode="prod",
            action="hit",
            served_by="sim/pod-0",
            pod="sim/pod-0",
            saved_tokens=384.0,
        )
    )
    assert obs is not None
    assert (obs.status, obs.upstream, obs.attempts) == (503, "[fd00::7]:8000", 3)
    assert (obs.mode, obs.action, obs.pinned, obs.would_pick) == ("prod", "hit", *["sim/pod-0"] * 2)
    assert obs.saved_tokens == 384
    # Envoy's bitmask (the response.flags attribute): UF is 0x20, URX 0x8000.
    assert obs.flags == 0x20 | 0x8000 and obs.flags & POD_FAULTS
    bare = observation(entry(200, "10.0.0.1:8000"))
    assert bare is not None and (bare.upstream, bare.mode, bare.flags) == ("10.0.0.1:8000", "", 0)


def test_envoys_hold_is_its_last_byte_in_to_its_first_byte_to_a_pod() -> None:
    e = entry(200, "10.0.0.1:8000", mode="prod")
    e.common_properties.time_to_last_rx_byte.FromNanoseconds(1_500_000)
    e.common_properties.time_to_first_upstream_tx_byte.FromNanoseconds(3_750_000)
    obs = observation(e)
    assert obs is not None and obs.hold_ns == 2_250_000
    unsent = entry(503, flags=("no_healthy_upstream",), mode="prod")  # no pod reached
    unsent.common_properties.time_to_last_rx_byte.FromNanoseconds(1_000)
    obs = observation(unsent)
    assert obs is not None and obs.hold_ns is None
    als = service()
    als.on_message(batch(e, e, unsent))
    prod = als.observer.ledger.holds["prod"]
    assert (sum(prod.counts), prod.sum_ns) == (2, 4_500_000)
    assert prod.counts[bisect_left(BOUNDS_NS, 2_250_000)] == 2


def test_the_flags_are_envoys_bits() -> None:
    bits = {
        "upstream_request_timeout": 0x4,  # UT
        "upstream_remote_reset": 0x10,  # UR
        "upstream_connection_failure": 0x20,  # UF
        "upstream_connection_termination": 0x40,  # UC
        "upstream_overflow": 0x80,  # UO
        "no_route_found": 0x100,  # NR
        "no_cluster_found": 0x1000000,  # NC
    }
    for name, bit in bits.items():
        obs = observation(entry(503, flags=(name,)))
        assert obs is not None and obs.flags == bit, name
    assert sum(b for n, b in bits.items() if n.startswith("upstream_") and b < 0x80) == POD_FAULTS


def test_a_failing_pod_is_taken_out_and_successes_reset_the_count() -> None:
    als = service()
    fleet = als.observer.fleet
    pod0, pod2 = fleet.pods[0], fleet.pods[2]
    als.on_message(batch(entry(500, pod2.address, mode="shadow")))
    als.on_message(batch(entry(200, pod2.address, mode="shadow")))
    als.on_message(batch(entry(503, pod2.address, mode="shadow", flags=("upstream_overflow",))))
    als.on_message(batch(entry(500, pod2.address, mode="shadow")))
    assert fleet.available & 0b100  # never two of its own failures in a row
    # Envoy could not reach pod 0, twice, in one batch: out.
    unreachable = entry(503, pod0.address, flags=("upstream_connection_failure",), mode="prod")
    als.on_message(batch(unreachable, unreachable))
    assert not fleet.available & 1
    assert als.counts.entries == 6 and als.counts.skipped == 0


def test_a_pin_retried_away_from_fails_only_where_envoy_tried_it() -> None:
    als = service()
    fleet = als.observer.fleet
    pod0, pod1 = fleet.pods[0], fleet.pods[1]
    # One attempt, answered elsewhere: Envoy never tried the pin (a host it did not know).
    for _ in range(3):
        als.on_message(batch(entry(200, pod1.address, mode="prod", served_by=pod0.key)))
    assert fleet.available & 1
    # Two attempts: the pin failed, then pod 1 answered.
    retried = entry(200, pod1.address, attempts=2, mode="prod", served_by=pod0.key)
    als.on_message(batch(retried, retried))
    assert not fleet.available & 1 and fleet.available & 0b10


def test_client_faults_and_envoys_refusals_count_nothing() -> None:
    als = service()
    fleet = als.observer.fleet
    pod = fleet.pods[1]
    for action in ("bypass_bad_json", "bypass_invalid_body", "reject_not_object"):
        for _ in range(3):
            als.on_message(batch(entry(500, pod.address, mode="prod", action=action)))
    for flag in ("upstream_overflow", "no_route_found", "no_cluster_found"):
        als.on_message(batch(*[entry(503, pod.address, mode="prod", flags=(flag,))] * 3))
    assert fleet.available & 0b10
    als.on_message(batch(*[entry(500, pod.address, mode="prod", action="miss")] * 2))
    assert not fleet.available & 0b10


def test_the_ledger_counts_responses_failures_and_estimates_by_mode_and_pod() -> None:
    als = service()
    pods = als.observer.fleet.pods
    als.on_message(
        batch(
            entry(200, pods[0].address, mode="prod", saved_tokens=500.0, served_by=pods[0].key),
            entry(200, pods[0].address, mode="prod", saved_tokens=250.0, served_by=pods[0].key),
            entry(503, flags=("no_cluster_found",), attempts=0, mode="prod"),  # Envoy's own
            entry(200, pods[1].address, mode="shadow", saved_tokens=100.0, pod=pods[2].key),
            entry(200, pods[2].address),  # ace-extproc was not asked (fail-open)
        )
    )
    ledger = als.observer.ledger
    prod, shadow, none = (ledger.by_mode[m] for m in ("prod", "shadow", "none"))
    assert (prod.responses, prod.failed, prod.estimated_saved_tokens) == (3, 1, 750)
    assert (shadow.responses, shadow.failed, shadow.estimated_saved_tokens) == (1, 0, 100)
    assert none.responses == 1
    assert ledger.by_pod[pods[0].key].responses == 2
    assert ledger.by_pod[pods[1].key].responses == 1  # who answered, not whom it would pick
    assert prod.with_usage == 0  # usage is the observe filter's to add (usage capture)


def test_unreadable_entries_are_skipped_and_counted_never_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    als = service()
    pod = als.observer.fleet.pods[0]
    good = entry(200, pod.address, mode="prod")
    intermediate = entry(200, pod.address, mode="prod")
    intermediate.common_properties.intermediate_log_entry = True
    als.on_message(
        batch(
            entry(200, pod.address, mode="prod", saved_tokens=math.nan),  # no int for it
            entry(0, pod.address, mode="prod"),  # the client left before any answer
            intermediate,
            good,
        )
    )
    assert access_log._receive(b"\xff\xff\xff") is None  # does not parse
    als.on_message(None)
    tcp = StreamAccessLogsMessage()
    tcp.tcp_logs.log_entry.append(TCPAccessLogEntry())
    als.on_message(tcp)
    c = als.counts
    assert (c.entries, c.unanswered, c.skipped, c.messages) == (1, 2, 3, 2)
    assert als.observer.ledger.by_mode["prod"].responses == 1

    def broken(_obs: object) -> None:
        raise RuntimeError("a bug in the observer")

    monkeypatch.setattr(als.observer, "record", broken)
    als.on_message(batch(good))  # logged and counted: the stream goes on
    assert als.counts.skipped == 4


# ------------------------------------------------------------------ over gRPC


async def _stream(
    target: str,
    messages: list[bytes],
    metadata: tuple[tuple[str, str], ...] | None,
) -> grpc.StatusCode:
    """Send ``messages`` (wire bytes, so a broken one can go too) on one stream."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_unary(
            f"/{access_log.SERVICE}/{access_log.METHOD}",
            request_serializer=lambda b: b,
            response_deserializer=StreamAccessLogsResponse.FromString,
        )(metadata=metadata)
        try:
            for m in messages:
                await call.write(m)
            await call.done_writing()
            await asyncio.wait_for(call, 5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        except asyncio.InvalidStateError:  # refused before the writes ended
            pass
        code: grpc.StatusCode = await call.code()
        return code


def test_the_server_takes_entries_only_from_envoy(port: int) -> None:
    """The access-log service shares the ext_proc port and its token: a stream without
    Envoy's is refused and counts nothing; Envoy's is recorded, a message that does not
    parse skipped on the way."""
    fleet = sim_fleet([f"127.0.0.1:{9001 + i}" for i in range(3)])
    health = PassiveHealth(consecutive_gateway_failure=2, max_ejection_percent=100)
    settings = Settings(
        listen=f"127.0.0.1:{port}",
        salt_secret=b"s",
        probe_interval_s=0.0,
        admin_listen="off",
        passive_health=health,
    )
    app = build(Config(fleet, settings))
    pod = app.fleet.pods[1]
    failed = entry(503, pod.address, flags=("upstream_connection_failure",), mode="prod")
    wire = batch(failed, failed).SerializeToString()
    target = f"127.0.0.1:{port}"

    async def main() -> tuple[list[grpc.StatusCode], int, grpc.StatusCode]:
        srv, _health = await server.start(app)
        try:
            forged = [await _stream(target, [], None), await _stream(target, [wire] * 5, None)]
            available = app.fleet.available
            envoy = await _stream(target, [b"\xff\xff\xff", wire], ENVOY)
            return forged, available, envoy
        finally:
            await srv.stop(0)
            await app.stop()

    forged, available_after_forged, envoy = asyncio.run(main())
    assert forged[0] == grpc.StatusCode.UNAUTHENTICATED
    # Refused too; gRPC says INTERNAL where the refusal overtook a write.
    assert forged[1] in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
    assert available_after_forged & 0b10  # nothing forged counted
    assert envoy == grpc.StatusCode.OK
    assert not app.fleet.available & 0b10  # Envoy's two failures took pod 1 out
    assert app.observer.ledger.by_mode["prod"].responses == 2
