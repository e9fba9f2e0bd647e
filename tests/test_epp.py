"""The endpoint-picker protocol's parts, one stream or one server at a time: the subset
hint (metadata or header), the endpoint served, gRPC health that waits for discovery,
and TLS on the ext_proc port. Through the real Envoy: test_e2e_gie.py."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ace_extproc import epp, mutate, server
from ace_extproc.app import App, build
from ace_extproc.config import (
    Config,
    ConfigError,
    EndpointPicker,
    Mode,
    Settings,
    parse_fleet,
    parse_settings,
    sim_fleet,
)
from ace_extproc.probes import Probes
from tests.test_server import CHAT

ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _app(upstream_mode: str = "endpoint", **kw: Any) -> App:
    picker = EndpointPicker(secure_serving=False) if upstream_mode == "endpoint" else None
    settings = Settings(
        salt_secret=b"s",
        probe_interval_s=0,
        upstream_mode=upstream_mode,
        endpoint_picker=picker,
        **kw,
    )
    return build(Config(sim_fleet(ADDRESSES), settings))


def _headers(subset: list[str] | None = None, header: str | None = None) -> pb.ProcessingRequest:
    hs = [(":path", "/v1/chat/completions"), (":method", "POST")]
    hs.append(("content-type", "application/json"))
    if header is not None:
        hs.append((epp.SUBSET_KEY, header))
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])
        )
    )
    msg.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    msg.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    if subset is not None:
        hint = msg.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE]
        hint.fields[epp.SUBSET_KEY].list_value.SetInParent()
        for entry in subset:
            hint.fields[epp.SUBSET_KEY].list_value.values.add().string_value = entry
    return msg


def _route(app: App, first: pb.ProcessingRequest) -> tuple[server._Stream, list[Any]]:
    stream = server._Stream(app.processor, app.observer)
    out = list(stream.on_message(first))
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True))
    out += stream.on_message(body)
    return stream, out


def _picked(out: list[Any]) -> str:
    [headers] = [r for r in out if r.HasField("request_headers")]
    lb = headers.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return str(lb["x-gateway-destination-endpoint"].string_value)


def test_the_subset_in_metadata_confines_the_pick() -> None:
    app = _app()
    for allowed in ADDRESSES:
        _, out = _route(app, _headers([allowed]))
        # One endpoint, no fallbacks (endpoint_picker.fallbacks is off): within the subset.
        assert _picked(out) == allowed


def test_an_empty_subset_or_one_naming_no_pod_is_a_503() -> None:
    app = _app()
    for subset in ([], ["192.168.9.9:1"]):
        _, out = _route(app, _headers(subset))
        [answer] = out[:1]
        assert answer.immediate_response.status.code == 503
        assert b"subset" in answer.immediate_response.body


def test_the_subset_header_counts_in_endpoint_mode_only() -> None:
    _, out = _route(_app(), _headers(header=f" {ADDRESSES[2]} , "))
    assert _picked(out) == ADDRESSES[2]
    # Cluster mode names clusters, not endpoints: a client's header cannot narrow it.
    _, out = _route(_app("cluster"), _headers(header="192.168.9.9:1"))
    assert not any(r.HasField("immediate_response") for r in out)


def test_endpoints_compare_in_their_canonical_spelling() -> None:
    assert epp.canonical_endpoint(" [fd00:0::7]:80 ") == "[fd00::7]:80"
    assert epp.canonical_endpoint("10.0.0.1:08000") == "10.0.0.1:8000"
    assert epp.canonical_endpoint("garbage") == "garbage"


def test_the_endpoint_served_is_what_the_ledger_and_passive_health_count() -> None:
    app = _app()
    stream, out = _route(app, _headers())
    pinned = _picked(out)
    fallback = next(a for a in ADDRESSES if a != pinned)
    [answer] = stream.on_message(_response_headers(fallback))
    assert answer.HasField("response_headers")
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"x":1}', end_of_stream=True))
    [echo] = stream.on_message(chunk)
    streamed = echo.response_body.response.body_mutation.streamed_response
    assert streamed.body == b'{"x":1}' and streamed.end_of_stream
    by_pod = app.observer.ledger.by_pod
    served_key = next(p.key for p in app.fleet.pods if p.endpoint == fallback)
    assert list(by_pod) == [served_key] and by_pod[served_key].responses == 1
    # Envoy went past the pick: a strike against the pinned pod.
    pinned_slot = next(s for s, p in enumerate(app.fleet.pods) if p.endpoint == pinned)
    assert app.observer.outliers._records[pinned_slot].in_a_row_gateway == 1


def _response_headers(served: str | None) -> pb.ProcessingRequest:
    resp = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200")])
        )
    )
    if served is not None:
        lb = resp.metadata_context.filter_metadata[epp.SERVED_NAMESPACE]
        lb.fields[epp.SERVED_KEY].string_value = served
    return resp


def _set_headers(answer: pb.ProcessingResponse) -> dict[str, str]:
    mutation = answer.response_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


@pytest.mark.parametrize("mode", ["prod", "shadow"])
def test_the_response_headers_carry_what_ace_extproc_did(mode: str) -> None:
    """The report ace-extproc's own Envoy adds from metadata, added by ace-extproc where
    the gateway sends the response's headers: the trace, the pod pinned (prod only),
    the pod the gateway says served, and no served-by where it says none."""
    app = _app(mode=Mode(mode))
    for served_by_fallback in (True, False):
        stream, out = _route(app, _headers())
        pod = next(p for p in app.fleet.pods if p.endpoint != ADDRESSES[0])
        served = pod.endpoint if served_by_fallback else None
        [answer] = stream.on_message(_response_headers(served))
        report = _set_headers(answer)
        # The same trace as the metadata ace-extproc's own Envoy writes it from.
        [decided] = [r for r in out if r.HasField("request_headers")]
        ace = decided.dynamic_metadata.fields["ace"].struct_value.fields
        assert report.pop(mutate.TRACE_HEADER) == ace["trace"].string_value
        assert ace["trace"].string_value.startswith(f"mode={mode},action=")
        if mode == "prod":
            pinned = next(p.key for p in app.fleet.pods if p.endpoint == _picked(out))
            assert report.pop(mutate.PINNED_HEADER) == pinned
        assert report == ({mutate.SERVED_BY_HEADER: pod.key} if served else {})
    # A response to a request this stream did not decide carries no report.
    stream = server._Stream(app.processor, app.observer)
    [answer] = stream.on_message(_response_headers(None))
    assert answer.HasField("response_headers") and _set_headers(answer) == {}


def test_a_bug_in_a_full_duplex_response_still_passes_the_chunk_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _app()
    stream, _ = _route(app, _headers())

    def explode(*_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(server._Stream, "_respond", explode)
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data", end_of_stream=False))
    [echo] = stream.on_message(chunk)
    assert echo.response_body.response.body_mutation.streamed_response.body == b"data"


# ------------------------------------------------------------------ serving


async def _health(target: str, service: str, creds: grpc.ChannelCredentials | None = None) -> int:
    options = (("grpc.ssl_target_name_override", "localhost"),)
    if creds is None:
        channel = grpc.aio.insecure_channel(target)
    else:
        channel = grpc.aio.secure_channel(target, creds, options=options)
    async with channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(resp.status)


def picker_settings(port: int, picker: EndpointPicker) -> Settings:
    """A picker serving on ``port``, with no monitor and no admin API."""
    return Settings(
        listen=f"127.0.0.1:{port}",
        probe_interval_s=0,
        upstream_mode="endpoint",
        endpoint_picker=picker,
        admin_listen="off",
    )


def test_readiness_waits_for_discovery_s_first_sync(port: int) -> None:
    doc = {
        "destinations": [
            {
                "id": "a",
                "base_url": "http://pool.invalid:8000",
                # Never resolves: discovery never syncs on its own.
                "discovery": {"type": "dns", "hostname": "pool.invalid", "port": 8000},
            }
        ]
    }
    settings = picker_settings(port, EndpointPicker(secure_serving=False))
    app = build(Config(parse_fleet(doc), settings))
    target = f"127.0.0.1:{port}"

    async def main() -> tuple[list[int], list[int]]:
        srv, _ = await server.start(app)
        try:
            names = ["liveness", "readiness", "", server.EXT_PROC_SERVICE]
            before = [await _health(target, n) for n in names]
            probes = Probes()
            waiting = asyncio.create_task(server.probes_ready_when_synced(app, probes))
            await asyncio.sleep(0.05)
            assert not probes.ready()  # the kubelet's /readyz waits too
            [discovery] = app.discoveries
            discovery.sync([])  # the first answer, even an empty one
            await asyncio.wait_for(waiting, 5)
            assert probes.ready()
            for _ in range(100):
                if await _health(target, "readiness") == SERVING:
                    break
                await asyncio.sleep(0.02)
            after = [await _health(target, n) for n in names]
            return before, after
        finally:
            await srv.stop(0)
            await app.stop()

    before, after = asyncio.run(main())
    assert before == [SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING]
    assert after == [SERVING] * 4


def _tls_server(port: int, picker: EndpointPicker) -> tuple[App, str]:
    settings = picker_settings(port, picker)
    return build(Config(sim_fleet(ADDRESSES), settings)), f"127.0.0.1:{port}"


def _serve_and_check(app: App, target: str, root: bytes | None) -> tuple[int, int | str]:
    """(the health status over TLS trusting ``root`` (None: the server's own
    certificate, as fetched), what a plaintext client gets)."""

    async def main() -> tuple[int, int | str]:
        srv, _ = await server.start(app)
        try:
            host, port = target.split(":")
            trusted = root
            if trusted is None:
                pem = await asyncio.to_thread(ssl.get_server_certificate, (host, int(port)))
                trusted = pem.encode()
            tls = await _health(target, "", grpc.ssl_channel_credentials(trusted))
            try:
                plain: int | str = await _health(target, "")
            except grpc.aio.AioRpcError as exc:
                plain = exc.code().name
            return tls, plain
        finally:
            await srv.stop(0)
            await app.stop()

    return asyncio.run(main())


def test_the_picker_serves_tls_with_a_self_signed_certificate_by_default(port: int) -> None:
    app, target = _tls_server(port, EndpointPicker())
    assert _serve_and_check(app, target, None) == (SERVING, "UNAVAILABLE")


def test_the_picker_serves_tls_with_a_secret_s_certificate(port: int, tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.cert_chain_pems[0].write_to_path(str(crt))
    cert.private_key_pem.write_to_path(str(key))
    app, target = _tls_server(port, EndpointPicker(cert_file=str(crt), key_file=str(key)))
    assert _serve_and_check(app, target, ca.cert_pem.bytes()) == (SERVING, "UNAVAILABLE")


def test_the_picker_s_settings_are_checked() -> None:
    # The picker names pods as ip:port: endpoint mode, whatever upstream_mode says.
    assert parse_settings({"endpoint_picker": {}}).upstream_mode == "endpoint"
    with pytest.raises(ConfigError, match="cert_file and key_file go together"):
        parse_settings({"upstream_mode": "endpoint", "endpoint_picker": {"cert_file": "x"}})
    settings = parse_settings({"upstream_mode": "endpoint", "endpoint_picker": {}})
    assert settings.endpoint_picker is not None and settings.endpoint_picker.secure_serving
    from ace_extproc import peer

    assert peer.token(settings) is None  # the gateway's Envoy sends no token


def test_the_native_api_is_refused_in_full_duplex_mode() -> None:
    msg = _headers()
    msg.request_headers.headers.headers[0].raw_value = b"/v1/execute"
    app = _app()
    stream = server._Stream(app.processor, app.observer)
    [answer] = stream.on_message(msg)
    assert answer.immediate_response.status.code == 501
