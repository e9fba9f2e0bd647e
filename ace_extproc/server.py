"""The ext_proc gRPC server: one small state machine per Envoy stream.

Buffered mode (two exchanges): request headers -> continue (or a decided bypass that
also tells Envoy to skip the body); buffered body -> route and rewrite.
Full-duplex streamed mode (one round trip): hold the headers, collect body chunks,
then answer the headers with the route and stream the body back.
Which one a stream uses is read from the ``protocol_config`` Envoy sends first, so
the server follows whichever mode the Envoy config chose.
Response headers are never sent here: Envoy adds them from dynamic metadata.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterable

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

from ace_extproc import config as config_mod
from ace_extproc import mutate
from ace_extproc.config import Config, ConfigError, Mode
from ace_extproc.processor import Outcome, Processor, RequestContext
from ace_extproc.procs import die_with_parent
from ace_extproc.routing.discovery import for_destination
from ace_extproc.routing.monitor import FleetMonitor

log = logging.getLogger("ace_extproc")

_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_UNASKED = {
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
    "response_trailers": ProcessingResponse(response_trailers=TrailersResponse()),
}


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: object
    ) -> AsyncIterator[ProcessingResponse]:
        stream = _Stream(self.processor)
        async for message in request_iterator:
            for response in stream.on_message(message):
                yield response


class _Stream:
    """State of one request's stream."""

    __slots__ = ("chunks", "ctx", "duplex", "processor")

    def __init__(self, processor: Processor) -> None:
        self.processor = processor
        self.ctx: RequestContext | None = None
        self.duplex = False
        self.chunks: list[bytes] = []

    def on_message(self, msg: ProcessingRequest) -> Iterable[ProcessingResponse]:
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._on_headers(msg)
            if kind == "request_body":
                return self._on_body(msg)
            if kind == "request_trailers":
                return self._on_trailers()
        except Exception:  # a bug here must cost a decision, never the request
            log.exception("ext_proc: failed on %s; passing the request through", kind)
            return self._pass_through(kind)
        # Phases this server does not ask for: answer so Envoy never waits on us.
        unasked = _UNASKED.get(kind or "")
        return [unasked] if unasked is not None else []

    def _on_headers(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self.duplex = msg.protocol_config.request_body_mode == _DUPLEX
        http = msg.request_headers
        headers = {h.key: h.raw_value.decode("latin-1") for h in http.headers.headers}
        self.ctx = ctx = self.processor.on_headers(headers, http.end_of_stream)
        if self.duplex:
            if not http.end_of_stream:
                return []  # answered once the body is complete
            return self._decide(b"")
        if ctx.outcome is not None:
            return [mutate.headers_decided(ctx.outcome, ctx.client_upstream)]
        return [mutate.HEADERS_CONTINUE]

    def _on_body(self, msg: ProcessingRequest) -> list[ProcessingResponse]:
        http = msg.request_body
        if not self.duplex:
            return self._decide(http.body)
        self.chunks.append(http.body)
        if not http.end_of_stream:
            return []
        return self._decide(b"".join(self.chunks))

    def _on_trailers(self) -> list[ProcessingResponse]:
        # Trailers end a full-duplex body that did not say end_of_stream itself.
        out = self._decide(b"".join(self.chunks)) if self.duplex and self.chunks else []
        self.chunks = []
        out.append(ProcessingResponse(request_trailers=TrailersResponse()))
        return out

    def _decide(self, body: bytes) -> list[ProcessingResponse]:
        ctx = self.ctx
        if ctx is None:  # a body before any headers: nothing to decide on
            return [mutate.BODY_CONTINUE]
        outcome = self.processor.on_body(ctx, body)
        if self.duplex:
            self.chunks = []
            return mutate.duplex_decided(outcome, ctx.client_upstream, body)
        return [mutate.body_decided(outcome, ctx.client_upstream)]

    def _pass_through(self, kind: str | None) -> list[ProcessingResponse]:
        outcome = Outcome(self.ctx.mode if self.ctx else Mode.OFF, "bypass_internal_error")
        if self.duplex:
            if kind == "request_headers":
                return []
            body = b"".join(self.chunks)
            self.chunks = []
            return mutate.duplex_decided(outcome, False, body)
        if kind == "request_headers":
            return [mutate.headers_decided(outcome, False)]
        return [mutate.body_decided(outcome, False)]


# ------------------------------------------------------------------ serving


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        # Envoy sends whole buffered bodies in one message; 4 MiB is too small.
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1),  # worker processes may share one port
        ("grpc.http2.max_pings_without_data", 0),
    ]


async def start(
    config: Config, processor: Processor | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Serve ``processor`` (a new one when None) and, unless ``probe_interval_s <= 0``,
    watch its pods: the monitor is ``processor.monitor``, for the caller to stop.
    Destinations with ``discovery:`` get a discovery loop each
    (``processor.discoveries``), stopped by ``stop_discovery(processor)``."""
    s = config.settings
    processor = processor or Processor(config)
    server = grpc.aio.server(options=grpc_options(s.grpc_max_message_bytes))
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(processor), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if s.listen and server.add_insecure_port(s.listen) == 0:
        raise OSError(f"cannot listen on {s.listen}")
    if s.uds:
        server.add_insecure_port(f"unix:{s.uds}")
    await server.start()
    if s.probe_interval_s > 0 and processor.monitor is None:
        processor.monitor = FleetMonitor(processor.fleet, processor.index, s)
        await processor.monitor.start()
    if not processor.discoveries:
        # After the monitor, which follows the pods discovery adds and removes.
        processor.discoveries = [
            for_destination(processor.fleet, processor.index, d)
            for d in config.fleet.destinations
            if d.discovery is not None
        ]
        for discovery in processor.discoveries:
            await discovery.start()
    for name in ("", _SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer


async def stop_discovery(processor: Processor) -> None:
    """Stop the processor's discovery loops; the pods they found stay as they are."""
    running, processor.discoveries = processor.discoveries, []
    for discovery in running:
        await discovery.stop()


def tune_gc() -> None:
    """Move everything alive at start-up out of the collector's way, so a collection
    scans only per-request garbage: shorter pauses, a lower p99."""
    gc.collect()
    gc.freeze()


async def serve(config: Config) -> None:
    processor = Processor(config)
    server, health_servicer = await start(config, processor)
    tune_gc()
    s = config.settings
    where = " and ".join(x for x in (s.listen, s.uds and f"unix:{s.uds}") if x)
    # One write: worker processes share stdout, and a pipe keeps a short write whole.
    sys.stdout.write(f"ace-extproc serving ext_proc on {where} (mode={s.mode.value})\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Graceful: report NOT_SERVING, stop taking streams, let those in flight finish.
    await health_servicer.enter_graceful_shutdown()
    await stop_discovery(processor)
    if processor.monitor is not None:
        await processor.monitor.stop()
    await server.stop(s.shutdown_grace_s)
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
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the TCP port (SO_REUSEPORT); one Python process "
        "saturates about one core",
    )
    parser.add_argument("--log-level", default="INFO")


def load_config(args: argparse.Namespace) -> Config:
    cfg = config_mod.load(args.fleet)
    overrides: dict[str, object] = {}
    if args.listen:
        overrides["listen"] = args.listen
    if args.uds:
        overrides["uds"] = args.uds
    if args.mode:
        overrides["mode"] = Mode(args.mode)
    if overrides:
        from dataclasses import replace

        cfg = Config(cfg.fleet, replace(cfg.settings, **overrides))  # type: ignore[arg-type]
    return cfg


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1:
        if cfg.settings.uds:
            print("error: --workers needs TCP; a Unix socket cannot be shared", file=sys.stderr)
            return 2
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
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(cfg,), daemon=True) for _ in range(workers)]
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
