"""The ext_proc server over real gRPC, driven as Envoy drives it."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import msgspec
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ace_extproc import server
from ace_extproc.app import build
from ace_extproc.config import Config, Settings, sim_fleet
from ace_extproc.processor import Processor
from tests.conftest import alive, children, peer_metadata

ENVOY = peer_metadata(b"s")  # what Envoy rendered from the same secret sends


def config(listen: str, **kw) -> Config:
    fleet = sim_fleet([f"127.0.0.1:{9001 + i}" for i in range(3)])
    # No pods answer here: a monitor would mark them all down (bypass_no_pod).
    kw.setdefault("probe_interval_s", 0.0)
    return Config(fleet, Settings(listen=listen, salt_secret=b"s", **kw))


def headers_msg(path="/v1/chat/completions", method="POST", eos=False, duplex=False):
    hs = [(":path", path), (":method", method), ("content-type", "application/json")]
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
            end_of_stream=eos,
        )
    )
    mode = ProcessingMode.FULL_DUPLEX_STREAMED if duplex else ProcessingMode.BUFFERED
    msg.protocol_config.request_body_mode = mode
    return msg


def body_msg(data: bytes, eos=True):
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


CHAT = msgspec.json.encode(
    {
        "model": "m",
        "messages": [{"role": "system", "content": "s" * 3000}, {"role": "user", "content": "q"}],
    }
)


async def exchange(target: str, messages, expect: int):
    """Send ``messages`` on one stream, one at a time like Envoy; collect ``expect`` answers."""
    big = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    async with grpc.aio.insecure_channel(target, options=big) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=ENVOY)
        out = []
        for m in messages:
            await call.write(m)
        while len(out) < expect:
            out.append(await asyncio.wait_for(call.read(), 5))
        await call.done_writing()
        return out


def with_server(cfg: Config, coro_fn):
    app = build(cfg)

    async def main():
        srv, _health = await server.start(app)
        try:
            return await coro_fn()
        finally:
            await srv.stop(0)
            await app.stop()

    return asyncio.run(main())


def header_map(mutation):
    return {h.header.key: h.header.raw_value for h in mutation.set_headers}


def test_buffered_two_exchanges_route_and_rewrite(port):
    target = f"127.0.0.1:{port}"
    out = with_server(config(target), lambda: exchange(target, [headers_msg(), body_msg(CHAT)], 2))
    assert out[0].WhichOneof("response") == "request_headers"
    assert not out[0].request_headers.response.HasField("header_mutation")
    common = out[1].request_body.response
    sets = header_map(common.header_mutation)
    assert sets["x-ace-upstream"].startswith(b"ace_pod.sim.pod-")
    assert int(sets["content-length"]) == len(common.body_mutation.body)
    assert common.clear_route_cache
    assert msgspec.json.decode(common.body_mutation.body)["cache_salt"]
    ace = out[1].dynamic_metadata.fields["ace"].struct_value.fields
    assert ace["trace"].string_value.startswith("mode=prod,action=miss,prefix_key=")
    assert ace["served_by"].string_value == "sim/" + sets["x-ace-upstream"].decode().split(".")[-1]


def test_bypass_on_headers_skips_the_body(port):
    target = f"127.0.0.1:{port}"
    msgs = [headers_msg(path="/v1/models", method="GET", eos=True)]
    (out,) = with_server(config(target), lambda: exchange(target, msgs, 1))
    assert out.WhichOneof("response") == "request_headers"
    assert out.request_headers.HasField("response")
    assert out.mode_override.request_body_mode == ProcessingMode.NONE
    trace = out.dynamic_metadata.fields["ace"].struct_value.fields["trace"].string_value
    assert "action=bypass_unknown_path" in trace


def test_full_duplex_one_round_trip(port):
    target = f"127.0.0.1:{port}"
    half = len(CHAT) // 2
    msgs = [headers_msg(duplex=True), body_msg(CHAT[:half], eos=False), body_msg(CHAT[half:])]

    async def go():
        return await exchange(target, msgs, 2)

    out = with_server(config(target), go)
    assert out[0].WhichOneof("response") == "request_headers"
    common = out[0].request_headers.response
    assert common.clear_route_cache
    sets = header_map(common.header_mutation)
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream
    assert int(sets["content-length"]) == len(streamed.body)
    assert msgspec.json.decode(streamed.body)["messages"][1]["content"] == "q"


def test_full_duplex_streams_big_bodies_back_in_chunks(port):
    target = f"127.0.0.1:{port}"
    big = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]}
    )
    msgs = [headers_msg(duplex=True), body_msg(big)]
    out = with_server(config(target), lambda: exchange(target, msgs, 5))
    chunks = [m.request_body.response.body_mutation.streamed_response for m in out[1:]]
    assert all(len(c.body) <= 64 * 1024 for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False, False, False, True]
    assert (
        len(msgspec.json.decode(b"".join(c.body for c in chunks))["messages"][0]["content"])
        == 200_000
    )


def test_bodies_over_4_mib_are_accepted(port):
    target = f"127.0.0.1:{port}"
    big = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "y" * (6 << 20)}]}
    )
    out = with_server(config(target), lambda: exchange(target, [headers_msg(), body_msg(big)], 2))
    assert len(out[1].request_body.response.body_mutation.body) > 6 << 20


def test_unknown_key_is_an_immediate_401(port):
    import hashlib

    from ace_extproc.config import TenantConfig

    target = f"127.0.0.1:{port}"
    tenants = TenantConfig(key_digests={hashlib.sha256(b"good").digest(): "t"})
    msg = headers_msg()
    msg.request_headers.headers.headers.append(
        HeaderValue(key="authorization", raw_value=b"Bearer bad")
    )
    (out,) = with_server(config(target, tenants=tenants), lambda: exchange(target, [msg], 1))
    assert out.immediate_response.status.code == 401
    assert b"bad" not in out.immediate_response.body


def explode(monkeypatch):
    def on_body(self, ctx, body):
        raise RuntimeError("bug")

    monkeypatch.setattr(Processor, "on_body", on_body)


def test_a_bug_costs_the_decision_not_the_request(port, monkeypatch):
    target = f"127.0.0.1:{port}"
    explode(monkeypatch)
    out = with_server(config(target), lambda: exchange(target, [headers_msg(), body_msg(CHAT)], 2))
    assert out[1].WhichOneof("response") == "request_body"
    common = out[1].request_body.response
    assert not common.HasField("body_mutation") and not common.HasField("header_mutation")
    trace = out[1].dynamic_metadata.fields["ace"].struct_value.fields["trace"].string_value
    assert "action=bypass_internal_error" in trace


def test_health_and_unix_socket(port, tmp_path):
    uds = str(tmp_path / "ace.sock")
    cfg = config(f"127.0.0.1:{port}", uds=uds)

    async def go():
        async with grpc.aio.insecure_channel(f"unix:{uds}") as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="")
            )
        return resp.status, await exchange(f"unix:{uds}", [headers_msg(), body_msg(CHAT)], 2)

    status, out = with_server(cfg, go)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert out[1].request_body.response.clear_route_cache


def test_graceful_stop_finishes_streams_in_flight(port):
    target = f"127.0.0.1:{port}"

    async def main():
        srv, health = await server.start(build(config(target)))
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=ENVOY)
            await call.write(headers_msg())
            await call.read()
            await health.enter_graceful_shutdown()
            stopping = asyncio.create_task(srv.stop(5))
            await asyncio.sleep(0.1)
            await call.write(body_msg(CHAT))  # the stream in flight still gets its answer
            answer = await asyncio.wait_for(call.read(), 5)
            await call.done_writing()
            await stopping
            return answer

    answer = asyncio.run(main())
    assert answer.request_body.response.clear_route_cache


def test_server_settings_reach_grpc_options():
    opts = dict(server.grpc_options(Settings().grpc_max_message_bytes))
    assert opts["grpc.max_receive_message_length"] >= 64 << 20


@contextlib.contextmanager
def workers(port: int, n: int = 2) -> Iterator[subprocess.Popen[str]]:
    """``ace-extproc serve --workers n``, returned once every worker is serving."""
    argv = [sys.executable, "-m", "ace_extproc.cli", "serve", "--workers", str(n),
            "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        seen = ""
        while seen.count("serving ext_proc on") < n:
            line = proc.stdout.readline()
            assert line, seen  # every worker announces itself before EOF
            seen += line
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_processes_share_one_port_and_stop_together(port):
    async def check() -> list[int]:
        out = []
        for _ in range(6):  # fresh channels: SO_REUSEPORT spreads them over workers
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                out.append(r.status)
        return out

    with workers(port) as proc:
        assert asyncio.run(check()) == [health_pb2.HealthCheckResponse.SERVING] * 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_workers_die_with_a_killed_supervisor(port):
    with workers(port) as proc:
        pids = children(proc.pid)
        assert len(pids) >= 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if alive(p)]


def _start_up_output(port: int, env: dict[str, str]) -> str:
    """What ``ace-extproc serve`` prints up to its serving line."""
    argv = [sys.executable, "-m", "ace_extproc.cli", "serve", "--listen", f"127.0.0.1:{port}",
            "--metrics-listen", "off", "--admin-listen", "off"]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k != "ACE_SALT_SECRET"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**base, **env}
    )
    try:
        assert proc.stdout is not None
        seen = ""
        while "serving ext_proc on" not in seen:
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        return seen
    finally:
        proc.kill()
        proc.wait()


def test_a_generated_salt_secret_is_warned_about(port):
    """Without a shared secret each replica salts tenants its own way: say so at start."""
    assert "no cache salt secret" in _start_up_output(port, {})
    assert "no cache salt secret" not in _start_up_output(port, {"ACE_SALT_SECRET": "shared"})


def test_only_a_generated_salt_secret_is_flagged():
    from ace_extproc.config import parse_settings

    generated = parse_settings({}, env={})
    assert generated.salt_secret_generated and len(generated.salt_secret) == 32
    assert parse_settings({}, env={}).salt_secret != generated.salt_secret  # its own
    from_env = parse_settings({}, env={"ACE_SALT_SECRET": "s"})
    assert (from_env.salt_secret, from_env.salt_secret_generated) == (b"s", False)
    from_file = parse_settings({"salt_secret": "f"}, env={})
    assert (from_file.salt_secret, from_file.salt_secret_generated) == (b"f", False)


# ------------------------------------------------------------------ full duplex, bounded


def _keyed(**kw):
    import hashlib

    from ace_extproc.config import TenantConfig

    return TenantConfig(key_digests={hashlib.sha256(b"good").digest(): "t"}, **kw)


def _with_header(msg, key: str, value: bytes):
    msg.request_headers.headers.headers.append(HeaderValue(key=key, raw_value=value))
    return msg


def test_full_duplex_refuses_on_the_headers_without_waiting_for_the_body(port):
    """A 401 needs no body: it goes back on the headers message, while the client is
    still sending (before, the server held the headers until the body had ended)."""
    target = f"127.0.0.1:{port}"
    msg = _with_header(headers_msg(duplex=True), "authorization", b"Bearer bad")
    (out,) = with_server(config(target, tenants=_keyed()), lambda: exchange(target, [msg], 1))
    assert out.immediate_response.status.code == 401


def test_full_duplex_passes_a_bypass_on_as_its_chunks_come(port):
    target = f"127.0.0.1:{port}"
    msgs = [
        headers_msg(path="/v1/embeddings", duplex=True),
        body_msg(b'{"input": "a', eos=False),
        body_msg(b'bc"}', eos=True),
    ]

    async def go():
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=ENVOY)
            await call.write(msgs[0])
            first = await asyncio.wait_for(call.read(), 5)  # before any body was sent
            out = [first]
            for m in msgs[1:]:
                await call.write(m)
                out.append(await asyncio.wait_for(call.read(), 5))
            await call.done_writing()
            return out

    out = with_server(config(target), go)
    trace = out[0].dynamic_metadata.fields["ace"].struct_value.fields["trace"].string_value
    assert "action=bypass_unknown_path" in trace
    chunks = [m.request_body.response.body_mutation.streamed_response for m in out[1:]]
    assert [(c.body, c.end_of_stream) for c in chunks] == [
        (b'{"input": "a', False),
        (b'bc"}', True),
    ]


def _big_duplex_stream(total: int, chunk: int = 64 * 1024):
    yield headers_msg(duplex=True)
    sent = 0
    piece = b"x" * chunk
    while sent < total:
        sent += chunk
        yield body_msg(piece, eos=sent >= total)


def test_full_duplex_stops_holding_a_body_past_the_limit(port):
    """Past max_body_bytes the server holds nothing more: what it held goes back,
    then each chunk as it comes (without tenants), and its memory stays flat."""
    import resource

    target = f"127.0.0.1:{port}"
    limit = 1 << 20
    total = 256 << 20  # 256 MiB through one stream

    async def go():
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=ENVOY)
            got: dict[str, Any] = {"echoed": 0, "answer": None, "last": None}

            async def read() -> None:  # concurrently, as Envoy does: flow control
                async for r in call:
                    if r.HasField("request_headers"):
                        got["answer"] = r
                    else:
                        streamed = r.request_body.response.body_mutation.streamed_response
                        got["echoed"] += len(streamed.body)
                        got["last"] = streamed.end_of_stream

            reader = asyncio.create_task(read())
            for m in _big_duplex_stream(total):
                await call.write(m)
            await call.done_writing()
            await asyncio.wait_for(reader, 60)
            return got["answer"], got["echoed"], got["last"]

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    answer, echoed, last = with_server(config(target, max_body_bytes=limit), go)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    trace = answer.dynamic_metadata.fields["ace"].struct_value.fields["trace"].string_value
    assert "action=bypass_too_large" in trace
    assert (echoed, last) == (total, True)
    # The client's and server's gRPC buffers in one process; the body is 256 MiB.
    assert grown_mib < 96, grown_mib


def test_full_duplex_refuses_a_body_past_the_limit_where_it_must_be_salted(port):
    target = f"127.0.0.1:{port}"
    limit = 1 << 20
    msgs = list(_big_duplex_stream(4 << 20))
    msgs[0] = _with_header(msgs[0], "authorization", b"Bearer good")
    out = with_server(
        config(target, max_body_bytes=limit, tenants=_keyed()),
        lambda: exchange(target, msgs[: 2 + limit // (64 * 1024)], 1),
    )
    assert out[0].immediate_response.status.code == 413


def test_a_bug_in_the_response_phase_is_answered_in_that_phase(port, monkeypatch):
    """The native API asks for the response: a bug there must answer that phase."""
    target = f"127.0.0.1:{port}"
    envelope = msgspec.json.encode(
        {"input": {"messages": [{"role": "user", "content": "hi"}]}, "target": {"model": "m"}}
    )

    def boom(*_args, **_kw):
        raise RuntimeError("bug")

    monkeypatch.setattr(server.execute, "wrap", boom)
    response_headers = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200")])
        )
    )
    response_body = pb.ProcessingRequest(
        response_body=pb.HttpBody(body=b'{"choices": []}', end_of_stream=True)
    )
    msgs = [headers_msg(path="/v1/execute"), body_msg(envelope), response_headers, response_body]
    out = with_server(config(target), lambda: exchange(target, msgs, 4))
    assert [m.WhichOneof("response") for m in out] == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
    ]


def test_a_bug_refuses_the_request_where_it_could_not_then_be_salted(port, monkeypatch):
    target = f"127.0.0.1:{port}"
    cfg = config(target, tenants=_keyed(header="x-tenant"))
    explode(monkeypatch)
    out = with_server(cfg, lambda: exchange(target, [headers_msg(), body_msg(CHAT)], 2))
    assert out[1].immediate_response.status.code == 500
    assert b"gateway failed" in out[1].immediate_response.body


def test_mtls_admits_only_clients_the_ca_signed(port, tmp_path):
    """router.ext_proc_tls: across hosts, only a client with a certificate the CA
    signed gets a stream; one without, or signed by another CA, is refused."""
    import trustme

    from ace_extproc.config import ExtProcTLS

    ca, other = trustme.CA(), trustme.CA()
    server_cert = ca.issue_cert("ace-extproc.test")
    envoy_cert, stranger = ca.issue_cert("envoy.test"), other.issue_cert("envoy.test")
    files = {
        "ca": ca.cert_pem,
        "crt": server_cert.cert_chain_pems[0],
        "key": server_cert.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(tmp_path / name))
    tls = ExtProcTLS(str(tmp_path / "ca"), str(tmp_path / "crt"), str(tmp_path / "key"))
    target = f"127.0.0.1:{port}"
    overrides = (("grpc.ssl_target_name_override", "ace-extproc.test"),)

    async def call(cert: Any) -> Any:
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(),
            private_key=cert.private_key_pem.bytes() if cert else None,
            certificate_chain=cert.cert_chain_pems[0].bytes() if cert else None,
        )
        async with grpc.aio.secure_channel(target, creds, options=overrides) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    async def scenario():
        return [await call(envoy_cert), await call(None), await call(stranger)]

    admitted, no_cert, other_ca = with_server(config(target, ext_proc_tls=tls), scenario)
    assert admitted == health_pb2.HealthCheckResponse.SERVING
    assert no_cert == other_ca == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------- a turn outrunning its previous answer


def responses_msgs(**fields) -> list[pb.ProcessingRequest]:
    body = msgspec.json.encode({"model": "m", "input": "a question " * 40, **fields})
    return [headers_msg(path="/v1/responses"), body_msg(body)]


def stored_answer(served_by: str, response_id: str) -> list[pb.ProcessingRequest]:
    """What the observe filter gets of a stored answer: its headers, then its body."""
    head = pb.ProcessingRequest(observability_mode=True)
    status = head.response_headers.headers.headers.add()
    status.key, status.raw_value = ":status", b"200"
    ace = head.metadata_context.filter_metadata["ace"].fields
    ace["served_by"].string_value, ace["store_tenant"].string_value = served_by, "anon"
    body = pb.ProcessingRequest(observability_mode=True)
    body.response_body.body = msgspec.json.encode({"id": response_id, "object": "response"})
    body.response_body.end_of_stream = True
    return [head, body]


def decision(out: pb.ProcessingResponse) -> dict[str, str]:
    trace = out.dynamic_metadata.fields["ace"].struct_value.fields["trace"].string_value
    return dict(item.split("=", 1) for item in trace.split(","))


def test_a_turn_sent_before_its_previous_answer_is_noted_waits_for_it(port):
    """Envoy's observe filter reads an answer beside the client, so the next turn can
    reach the router first: it waits, bounded, for the id (then pinned where it is
    stored), where an answer of its tenant's is still awaited; and only then."""
    target = f"127.0.0.1:{port}"

    async def main():
        first = await exchange(target, responses_msgs(), 2)
        served_by = first[1].dynamic_metadata.fields["ace"].struct_value.fields["served_by"]
        turn = responses_msgs(input="and then?", previous_response_id="resp_late", store=False)
        waiting = asyncio.create_task(exchange(target, turn, 2))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # held while the first answer is awaited
        async with grpc.aio.insecure_channel(target) as channel:  # open until answered
            call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=ENVOY)
            for message in stored_answer(served_by.string_value, "resp_late"):
                await call.write(message)
            pinned = decision((await waiting)[1])
        # Nothing awaited now (that turn was not stored): an id never seen is routed at once.
        started = time.monotonic()
        other = responses_msgs(input="x", previous_response_id="resp_never", store=False)
        unknown = decision((await exchange(target, other, 2))[1])
        return pinned, unknown, time.monotonic() - started

    pinned, unknown, took = with_server(config(target, responses_wait_ms=5000), main)
    assert (pinned["action"], pinned["previous_response"]) == ("previous_response", "pinned")
    assert unknown["previous_response"] == "unknown" and took < 2


def test_a_turn_waits_no_longer_than_responses_wait_ms(port):
    """An awaited answer whose id never comes (another replica's turn, a lost stream):
    the turn is routed by its prefix after the wait."""
    target = f"127.0.0.1:{port}"

    async def main():
        await exchange(target, responses_msgs(), 2)
        started = time.monotonic()
        turn = responses_msgs(input="and then?", previous_response_id="resp_elsewhere")
        out = await exchange(target, turn, 2)
        return decision(out[1]), time.monotonic() - started

    routed, took = with_server(config(target, responses_wait_ms=300), main)
    assert routed["previous_response"] == "unknown" and routed["action"] != "previous_response"
    assert took >= 0.3
