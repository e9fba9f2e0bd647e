"""The ext_proc gRPC server: one small state machine per Envoy stream.

Buffered mode (two exchanges): request headers -> continue (or a decided bypass that
also tells Envoy to skip the body); buffered body -> route and rewrite.
Full-duplex streamed mode (one round trip): hold the headers, collect body chunks,
then answer the headers with the route and stream the body back.
Which one a stream uses is read from the ``protocol_config`` Envoy sends first, so
the server follows whichever mode the Envoy config chose.
Response headers are never asked for by the rendered Envoy: it adds ace-extproc's
report to them from dynamic metadata. A gateway that sends responses on the routing
stream (Envoy Gateway's extension policy: headers; the Gateway API Inference
Extension's picker protocol: headers, and bodies full-duplex streamed) gets the
report added to the headers, the bodies back unchanged, chunk by chunk; both are
observed on the way (``epp.py``: the endpoint the gateway says served the request).
Streams of the observe-only filter (``observability_mode``: responses, never
answered) feed an ``Observation`` to ``observe.Observer`` when they end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from msgspec.structs import replace

from ace_extproc import access_log, epp, execute, mutate, native, peer, self_signed
from ace_extproc import config as config_mod
from ace_extproc import telemetry as tm
from ace_extproc.admin import serve_admin
from ace_extproc.app import App, build
from ace_extproc.config import Config, ConfigError, EndpointPicker, ExtProcTLS, Mode
from ace_extproc.envoy_config import EXT_PROC_SERVICE
from ace_extproc.logs import configure_logging
from ace_extproc.observe import Observation, Observer
from ace_extproc.outcome import Outcome
from ace_extproc.probes import Probes
from ace_extproc.processor import Processor, RequestContext
from ace_extproc.procs import die_with_parent
from ace_extproc.routing.replicas import redacted_url
from ace_extproc.stalls import LoopWatchdog

log = logging.getLogger("ace_extproc")

_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_UNASKED = {
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
    "response_trailers": ProcessingResponse(response_trailers=TrailersResponse()),
}


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, processor: Processor, observer: Observer) -> None:
        """``observer``: where the observe-only filter's streams report."""
        self.processor = processor
        self.observer = observer
        self.token = peer.token(processor.settings)
        self._refused_logged_at = -60.0

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        if self.token is not None and not peer.presented(
            context.invocation_metadata() or (), self.token
        ):
            self._refused(context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not Envoy's stream")
        stream = _Stream(self.processor, self.observer)
        try:
            async for message in request_iterator:
                for response in stream.on_message(message):
                    yield response
                if stream.deferred is not None:  # a turn waiting for its previous response
                    for response in await stream.resume():
                        yield response
                if stream.observed_all:
                    # Close it ourselves: Envoy would hold an observe stream open for
                    # its deferred_close_timeout (5 s) after the request ended.
                    break
        finally:
            stream.close()

    def _refused(self, who: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged_at >= 60:  # once a minute: a flood is one story
            self._refused_logged_at = now
            log.warning(
                "ext_proc: refused a stream from %s without Envoy's token (%s); is this "
                "Envoy rendered from the same salt secret?",
                who,
                peer.METADATA_KEY,
            )


class _Stream:
    """State of one request's stream."""

    __slots__ = (
        "after_deferred",
        "buffered",
        "chunks",
        "ctx",
        "deferred",
        "duplex",
        "ended",
        "has_body",
        "observed",
        "observed_all",
        "observer",
        "outcome",
        "passing",
        "processor",
        "response_duplex",
        "status",
        "watch",
    )

    def __init__(self, processor: Processor, observer: Observer) -> None:
        self.processor = processor
        self.observer = observer
        self.ctx: RequestContext | None = None
        self.duplex = False
        self.chunks: list[bytes] = []  # full-duplex: the body so far, while deciding
        self.buffered = 0  # their total size
        self.passing = False  # full-duplex: headers answered; body chunks go back as they came
        self.ended = False  # the request's last message (headers or body) has been seen
        self.has_body = True  # the headers did not end the request
        self.observed: Observation | None = None
        self.observed_all = False  # an observe stream whose response has been seen
        self.outcome: Outcome | None = None  # the decision, for the native API's envelope
        self.status = 0  # the response's status (native API)
        self.response_duplex = False  # response bodies come full-duplex: echo each chunk
        self.watch: Observation | None = None  # a routed request's response, if sent to us
        # The body whose decision waits (Processor.noted), and what is answered after it.
        self.deferred: bytes | None = None
        self.after_deferred: list[ProcessingResponse] = []

    def on_message(self, msg: ProcessingRequest) -> Iterable[ProcessingResponse]:
        """One message of the stream: the answers it gets."""
        kind = msg.WhichOneof("request")
        if msg.observability_mode:  # the observe-only filter: Envoy wants no answer
            self._observe(msg, kind)
            return ()
        try:
            if kind == "request_headers":
                return self._on_headers(msg)
            if kind == "request_body":
                return self._on_body(msg)
            if kind == "request_trailers":
                return self._on_trailers()
            if self.ctx is not None and self.ctx.execute and self.outcome is not None:
                if kind == "response_headers":
                    return self._on_response_headers(msg)
                if kind == "response_body":
                    return self._on_response_body(msg)
            if kind in _RESPONSE_PHASES:
                return self._respond(msg, kind)
        except Exception as exc:  # a bug here must cost a decision, never the request
            log.exception("ext_proc: failed on %s; passing the request through", kind)
            return self._failed(msg, kind, exc)
        # Phases this server does not ask for: answer so Envoy never waits on us.
        unasked = _UNASKED.get(kind or "")
        return [unasked] if unasked is not None else []

    def _on_headers(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self.duplex = msg.protocol_config.request_body_mode == _DUPLEX
            self.response_duplex = msg.protocol_config.response_body_mode == _DUPLEX
        http = msg.request_headers
        self.ended = http.end_of_stream
        self.has_body = not http.end_of_stream
        headers = request_headers(msg)
        endpoint_mode = self.processor.settings.upstream_mode == "endpoint"
        subset = epp.subset(msg, headers, header=endpoint_mode)
        self.ctx = ctx = self.processor.on_headers(headers, http.end_of_stream, subset)
        if ctx.execute and not (ctx.outcome and ctx.outcome.reject_status):
            if self.duplex:  # Envoy allows no mode override there: no envelope back
                log.info("/v1/execute needs Envoy's buffered body mode; refused")
                return [mutate.immediate(execute_unavailable(ctx.mode))]
            return [mutate.EXECUTE_HEADERS]
        if self.duplex:
            if ctx.outcome is not None:  # decided now: the body need not wait for it
                return self._pass(ctx.outcome, b"", False)
            if not http.end_of_stream:
                return []  # answered once the body is complete
            return self._decide(b"")
        if ctx.outcome is not None:
            return [mutate.headers_decided(ctx.outcome, ctx.client_upstream)]
        return [mutate.HEADERS_CONTINUE]

    def _on_body(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        http = msg.request_body
        self.ended = http.end_of_stream
        if not self.duplex:
            return self._decide(http.body)
        if self.passing:
            return [mutate.streamed_chunk(http.body, http.end_of_stream)]
        self.chunks.append(http.body)
        self.buffered += len(http.body)
        if self.buffered > self.processor.settings.max_body_bytes and self.ctx is not None:
            # Held no further: refused where it cannot be salted, else let through as is.
            body, self.chunks = b"".join(self.chunks), []
            return self._pass(self.processor.too_large(self.ctx), body, http.end_of_stream)
        if not http.end_of_stream:
            return []
        return self._decide(b"".join(self.chunks))

    def _on_trailers(self) -> list[ProcessingResponse]:
        # Trailers end a full-duplex body that did not say end_of_stream itself.
        self.ended = True
        out = self._decide(b"".join(self.chunks)) if self.duplex and not self.passing else []
        self.chunks = []
        trailers = ProcessingResponse(request_trailers=TrailersResponse())
        if self.deferred is not None:  # after the decision, whenever it comes
            self.after_deferred.append(trailers)
        else:
            out.append(trailers)
        return out

    def _pass(self, outcome: Outcome, body: bytes, ended: bool) -> list[ProcessingResponse]:
        """Full-duplex: the headers answered with a decision reached before the body's
        end (``ended`` False), or at it; what came of the body so far goes back now,
        the rest as it arrives."""
        if outcome.reject_status:
            return [mutate.immediate(outcome)]
        self.passing = True
        client_upstream = self.ctx.client_upstream if self.ctx is not None else False
        return mutate.duplex_decided(outcome, client_upstream, body, ended, self.has_body)

    def _decide(self, body: bytes) -> list[ProcessingResponse]:
        ctx = self.ctx
        if ctx is None:  # a body before any headers: nothing to decide on
            return [mutate.BODY_CONTINUE]
        outcome = self.outcome = self.processor.on_body(ctx, body)
        if ctx.awaiting is not None:  # Process awaits it, then calls resume
            self.deferred = body
            return []
        if self.duplex:
            self.chunks = []
            return self._pass(outcome, body, True)
        return [mutate.body_decided(outcome, ctx.client_upstream)]

    async def resume(self) -> list[ProcessingResponse]:
        """The deferred body decided, once its previous response is noted or the
        wait is over (routing/homes.py)."""
        body, self.deferred = self.deferred, None
        after, self.after_deferred = self.after_deferred, []
        assert body is not None and self.ctx is not None
        await self.processor.noted(self.ctx)
        try:
            out = self._decide(body)
        except Exception as exc:  # as on_message: a bug costs the decision only
            log.exception("ext_proc: failed deciding a deferred body; passing it through")
            self.chunks = [body]
            out = self._failed(ProcessingRequest(), "request_body", exc)
        return out + after

    def _on_response_headers(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        for h in msg.response_headers.headers.headers:
            if h.key == ":status":
                self.status = int(h.raw_value or b"0")
                break
        if msg.response_headers.end_of_stream:  # no body will come to wrap
            self.outcome = None
        return [mutate.RESPONSE_HEADERS_CONTINUE]

    def _on_response_body(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        outcome = self.outcome
        assert outcome is not None
        self.outcome = None
        entry = execute.trace(
            outcome.mode.value,
            outcome.action,
            outcome.prefix_key,
            outcome.saved_tokens,
            outcome.speedup,
        )
        return [mutate.response_replaced(execute.wrap(self.status, msg.response_body.body, entry))]

    def _respond(self, msg: ProcessingRequest, kind: str) -> list[ProcessingResponse]:
        """A routed request's response, sent by a gateway configured to (Envoy Gateway's
        extension policy, the endpoint-picker protocol's processing modes): the headers
        get ace-extproc's report, the body passes unchanged, both observed on the way."""
        if kind == "response_headers":
            self.watch = self._watching(msg)
            served_by = self.observer.pod_at(self.watch.upstream)
            if msg.response_headers.end_of_stream:
                self._settle()
            return [mutate.reported(self._decided(), served_by)]
        if kind == "response_body":
            body = msg.response_body
            watch = self.watch
            if watch is not None and (self.processor.settings.usage_capture or watch.store_tenant):
                self.observer.on_body(watch, body.body)
            if body.end_of_stream:
                self._settle()
            if self.response_duplex:
                return [mutate.response_chunk(body.body, body.end_of_stream)]
            return [_UNASKED[kind]]
        self._settle()  # trailers end the response
        return [_UNASKED[kind]]

    def _decided(self) -> Outcome | None:
        """This stream's decision: at the body, or at the headers alone."""
        return self.outcome or (self.ctx.outcome if self.ctx is not None else None)

    def _watching(self, msg: ProcessingRequest) -> Observation:
        """The observation of a response to a request this stream decided."""
        obs = Observation()
        outcome = self._decided()
        if outcome is not None:
            obs.mode, obs.action = outcome.mode, outcome.action
            obs.pinned = outcome.pod.key if outcome.pod is not None else ""
            obs.would_pick = outcome.would_pick.key if outcome.would_pick is not None else ""
            obs.saved_tokens = outcome.saved_tokens
            obs.estimated_prompt_tokens = outcome.prompt_tokens
            obs.store_tenant = outcome.store_tenant
            obs.lora_pick = outcome.lora_pick
        obs.upstream = epp.served(msg)
        for h in msg.response_headers.headers.headers:
            if h.key == ":status":
                obs.status = int(h.raw_value or b"0")
                break
        return obs

    def _settle(self) -> None:
        """The watched response ended (or the stream did): passive health, the ledger,
        and the engine's usage where usage capture is on."""
        watch, self.watch = self.watch, None
        if watch is None:
            return
        try:
            self.observer.record(watch)
            self.observer.finish(watch)
        except Exception:
            log.exception("observe: failed to record a response")

    def _observe(self, msg: ProcessingRequest, kind: str | None) -> None:
        try:
            if kind == "response_headers":
                observed = self.observed = Observation()
                observed.on_headers(msg)
                # Without usage capture Envoy sends no body (but a stored Responses
                # answer's, for its id): the headers are all there is.
                wanted = self.processor.settings.usage_capture or observed.store_tenant
                if msg.response_headers.end_of_stream or not wanted:
                    self.close()
            elif kind == "response_body" and self.observed is not None:
                self.observer.on_body(self.observed, msg.response_body.body)
                if msg.response_body.end_of_stream:
                    self.close()
            else:
                return
        except Exception:  # observing must never cost more than the observation
            log.exception("observe: failed on %s", kind)
            self.observed = None

    def close(self) -> None:
        """The response was seen to its end, or the stream ended: record it."""
        self._settle()
        self.observed_all = True
        observed, self.observed = self.observed, None
        if observed is not None:
            try:
                self.observer.finish(observed)
            except Exception:
                log.exception("observe: failed to record a response")

    def _failed(
        self, msg: ProcessingRequest, kind: str | None, error: Exception
    ) -> list[ProcessingResponse]:
        """The answer after a bug: the message's own phase answered, and the request
        passed on unrouted, or refused where it could not then be salted."""
        if kind not in _REQUEST_PHASES:  # a response phase: let it through as it is
            self.outcome = None
            self.watch = None
            if kind == "response_body" and self.response_duplex:
                body = msg.response_body
                return [mutate.response_chunk(body.body, body.end_of_stream)]
            unasked = _UNASKED.get(kind or "")
            return [unasked] if unasked is not None else []
        outcome = self.processor.internal_error(self.ctx)
        if not self.duplex:
            if kind == "request_headers":
                return [mutate.headers_decided(outcome, False)]
            return [mutate.body_decided(outcome, False)]
        if self.passing:  # headers answered, body under way: only ending the stream can say
            raise error
        body, self.chunks = b"".join(self.chunks), []
        ended = kind == "request_trailers" or self.ended
        out = self._pass(outcome, body, ended)
        if kind == "request_trailers":
            out.append(ProcessingResponse(request_trailers=TrailersResponse()))
        return out


_REQUEST_PHASES = frozenset({"request_headers", "request_body", "request_trailers"})
_RESPONSE_PHASES = frozenset(_UNASKED)


def request_headers(msg: ProcessingRequest) -> dict[str, str]:
    """Envoy's request headers as a dict: each key to its ``raw_value`` (where Envoy
    1.40 puts values) decoded as latin-1, the last of a repeated key kept."""
    return {h.key: h.raw_value.decode("latin-1") for h in msg.request_headers.headers.headers}


def execute_unavailable(mode: Mode) -> Outcome:
    body = execute.error_body(
        "/v1/execute needs Envoy's buffered body processing mode", 501, "not_implemented"
    )
    return Outcome(mode, "reject_execute_unavailable", reject_status=501, reject_body=body)


# ------------------------------------------------------------------ serving


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        # Envoy sends whole buffered bodies in one message; 4 MiB is too small.
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1),  # worker processes may share one port
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _add_processor(servicer: ExternalProcessor, server: grpc.aio.Server) -> None:
    """The generated ``add_ExternalProcessorServicer_to_server``, under the service name
    the rendered Envoy calls (``envoy_config.EXT_PROC_SERVICE``)."""
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.Process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": handler}),)
    )


async def start(app: App) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Serve ``app``'s processor and start what it runs in the background (the caller
    stops it: ``app.stop()``). The admin API (``admin_listen``, unless ``off``) runs
    until the server has stopped."""
    s = app.config.settings
    server = grpc.aio.server(options=grpc_options(s.grpc_max_message_bytes))
    _add_processor(ExternalProcessor(app.processor, app.observer), server)
    access_log.add_to_server(server, app.observer, s)  # what became of each request
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if s.listen and _add_port(server, s.listen, s.ext_proc_tls, s.endpoint_picker) == 0:
        raise OSError(f"cannot listen on {s.listen}")
    if s.uds:
        server.add_insecure_port(f"unix:{s.uds}")
    await server.start()
    await app.start()
    await serve_admin(app, follow=server)  # stops after server
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    if app.discovered:
        await _set_ready(health_servicer)
    else:
        for name in READY_SERVICES:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        _in_background(_ready_when_synced(app, health_servicer), "ace-ready")
    return server, health_servicer


# gRPC health (grpc.health.v1), as the endpoint-picker protocol names its services:
# "liveness" answers SERVING while the process serves; "readiness", the ext_proc
# service and "" (the whole server) only once every discovery has synced once.
LIVENESS = "liveness"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
_background: set[asyncio.Task[None]] = set()


async def _set_ready(health_servicer: health.aio.HealthServicer) -> None:
    for name in READY_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def _in_background(coro: Coroutine[Any, Any, None], name: str) -> None:
    task = asyncio.create_task(coro, name=name)
    _background.add(task)  # held until done: the loop keeps only a weak reference
    task.add_done_callback(_background.discard)


async def _ready_when_synced(app: App, health_servicer: health.aio.HealthServicer) -> None:
    await app.until_discovered()
    log.info("discovery synced: ready")
    await _set_ready(health_servicer)


async def probes_ready_when_synced(app: App, probes: Probes) -> None:
    """The kubelet's ``/readyz`` too waits for discovery's first sync."""
    await app.until_discovered()
    probes.serving = True


def _add_port(
    server: grpc.aio.Server,
    address: str,
    tls: ExtProcTLS | None,
    picker: EndpointPicker | None = None,
) -> int:
    """The TCP listener: with ``router.ext_proc_tls``, mTLS (only clients whose
    certificate the CA signed get a stream); as a gateway's endpoint picker, TLS
    (``secure_serving``) with its certificate, or a self-signed one."""
    if picker is not None and picker.secure_serving:
        secure: int = server.add_secure_port(address, _picker_credentials(picker))
        return secure
    if tls is None:
        port: int = server.add_insecure_port(address)
        return port
    if not tls.cert_file:
        raise ConfigError("router.ext_proc_tls: ace-extproc needs cert_file and key_file")
    try:
        ca, cert, key = (Path(p).read_bytes() for p in (tls.ca_file, tls.cert_file, tls.key_file))
    except OSError as exc:
        raise ConfigError(f"router.ext_proc_tls: {exc.filename}: {exc.strerror}") from None
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )
    port = server.add_secure_port(address, credentials)
    return port


def _picker_credentials(picker: EndpointPicker) -> grpc.ServerCredentials:
    if picker.cert_file:
        try:
            cert, key = (Path(p).read_bytes() for p in (picker.cert_file, picker.key_file))
        except OSError as exc:
            raise ConfigError(f"router.endpoint_picker: {exc.filename}: {exc.strerror}") from None
    else:
        cert, key = self_signed.make()
    return grpc.ssl_server_credentials([(key, cert)])


def tune_gc() -> None:
    """Move everything alive at start-up out of the collector's way, so a collection
    scans only per-request garbage: shorter pauses, a lower p99."""
    gc.collect()
    gc.freeze()


async def serve(config: Config) -> None:
    app = build(config)
    server, health_servicer = await start(app)
    s = config.settings
    if s.salt_secret_generated:
        log.warning(
            "no cache salt secret (ACE_SALT_SECRET or router.salt_secret): this process "
            "salts tenants with a random one of its own, so the engines' caches split "
            "between replicas and start cold after a restart; set one shared secret"
        )
    # Its own port and thread: a scrape never waits on, or holds up, this loop. The
    # kubelet's probes ask there too: the ext_proc port need not be open to them.
    # One heartbeat on the loop: the watchdog logs and counts its stalls, the kubelet's
    # liveness probe fails when it stops.
    watchdog = LoopWatchdog()
    app.telemetry.registry.register(watchdog)
    heartbeat = asyncio.create_task(watchdog.beat(), name="ace-heartbeat")
    watchdog.start()
    probes = Probes(heartbeat=watchdog)
    _in_background(probes_ready_when_synced(app, probes), "ace-probes-ready")
    try:
        metrics = tm.serve_metrics(s.metrics_listen, app.telemetry, probes)
    except OSError as exc:  # the data path matters more than its metrics
        log.warning("metrics: cannot listen on %s (%s); running without", s.metrics_listen, exc)
        metrics = None
    tune_gc()
    where = " and ".join(x for x in (s.listen, s.uds and f"unix:{s.uds}") if x)
    if metrics is not None:
        where += f"; metrics on {metrics.url}"
    if s.share_url:
        where += f"; sharing placements on {s.share_channel} at {redacted_url(s.share_url)}"
    # One write: worker processes share stdout, and a pipe keeps a short write whole.
    sys.stdout.write(
        f"ace-extproc serving ext_proc on {where} (mode={s.mode.value}, {native.describe()})\n"
    )
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Graceful: report NOT_SERVING, stop taking streams, let those in flight finish.
    probes.serving = False
    await health_servicer.enter_graceful_shutdown()
    await server.stop(s.shutdown_grace_s)
    await app.stop()
    heartbeat.cancel()
    watchdog.stop()
    if metrics is not None:
        metrics.stop()
    log.info("ace-extproc stopped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fleet",
        "--config",
        dest="fleet",
        help="fleet.yaml (default: the built-in 4 simulated pods)",
    )
    parser.add_argument("--listen", help="host:port for ext_proc gRPC (default 127.0.0.1:50051)")
    parser.add_argument("--uds", help="also listen on this Unix domain socket path")
    parser.add_argument("--mode", choices=[m.value for m in Mode], help="default mode")
    parser.add_argument(
        "--admin-listen",
        help='the admin API (ace-extproc ctl): host:port, unix:/path or "off" '
        "(default 127.0.0.1:9091)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the TCP port (SO_REUSEPORT); one Python process "
        "saturates about one core",
    )
    parser.add_argument(
        "--metrics-listen",
        help='Prometheus /metrics: host:port (0: any free port) or "off" (default 127.0.0.1:9090)',
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format", choices=config_mod.LOG_FORMATS, help="default: router.log_format (json)"
    )


def load_config(args: argparse.Namespace) -> Config:
    cfg = config_mod.load(args.fleet)
    overrides: dict[str, object] = {}
    if args.listen:
        overrides["listen"] = args.listen
    if args.uds:
        overrides["uds"] = args.uds
    if args.mode:
        overrides["mode"] = Mode(args.mode)
    if args.admin_listen:
        config_mod.check_admin_listen(args.admin_listen, "--admin-listen")
        overrides["admin_listen"] = args.admin_listen
    if args.metrics_listen:
        if args.metrics_listen != "off":
            config_mod.check_listen(args.metrics_listen, "--metrics-listen", allow_off=True)
        overrides["metrics_listen"] = args.metrics_listen
    if args.log_format:
        overrides["log_format"] = args.log_format
    if overrides:
        cfg = Config(cfg.fleet, replace(cfg.settings, **overrides))
    config_mod.check_discovery_mode(cfg.fleet, cfg.settings.upstream_mode)
    config_mod.check_api_keys(cfg.fleet)
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level.upper(), json=cfg.settings.log_format == "json")
    if args.workers > 1:
        if cfg.settings.uds:
            print("error: --workers needs TCP; a Unix socket cannot be shared", file=sys.stderr)
            return 2
        if cfg.settings.admin_listen != "off":
            # Each worker has its own fleet state: one answering for all would mislead.
            print("note: the admin API is off with --workers > 1", file=sys.stderr)
            cfg = Config(cfg.fleet, replace(cfg.settings, admin_listen="off"))
        return _run_workers(cfg, args.workers)
    _serve_forever(cfg)
    return 0


def _serve_forever(cfg: Config) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - optional speed-up
        asyncio.run(serve(cfg))
    else:
        uvloop.run(serve(cfg))


def _worker(cfg: Config) -> None:  # pragma: no cover - runs in the child
    die_with_parent()  # a killed supervisor must not leave workers holding the port
    _serve_forever(cfg)


def _run_workers(cfg: Config, workers: int) -> int:
    """Fork ``workers`` servers on one port; the kernel spreads Envoy's connections.

    The configuration (and so the salt secret, even a generated one) is loaded once,
    before any gRPC object exists, so every worker salts tenants alike. Each worker
    keeps its own prefix index; new prefixes still land alike (rendezvous), and
    Envoy's connection to a worker is long-lived, so a worker sees a stable share.
    With ``router.share_url`` each worker shares its placements as a replica would
    (its sharing starts in the worker, after the fork: an id and a connection each).
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    # One metrics port each (port + worker number): each worker has its own tallies.
    configs = [
        Config(cfg.fleet, replace(cfg.settings, metrics_listen=tm.worker_listen(m, i)))
        if (m := cfg.settings.metrics_listen) != "off"
        else cfg
        for i in range(workers)
    ]
    procs = [ctx.Process(target=_worker, args=(c,), daemon=True) for c in configs]
    for proc in procs:
        proc.start()

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for proc in procs:
        proc.join()
    return max((p.exitcode or 0) for p in procs)
