"""ace-extproc as the Gateway API Inference Extension's endpoint picker, behind the real
Envoy configured as GIE configures it (its processing modes: request and response
headers SEND, both bodies FULL_DUPLEX_STREAMED, both trailers SEND; its cluster shapes:
ORIGINAL_DST on ``x-gateway-destination-endpoint``, or ``override_host``), in both
failure modes (FailOpen: ``failure_mode_allow: true``; FailClose: false).

What the client gets must be byte for byte what the engine (the simulated pod) sent,
streamed or not. Before, ace-extproc answered each streamed response chunk with an
empty body response: Envoy logged "Spurious response message", a non-streamed
request got 500 and a streamed one an empty body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from ace_extproc import mutate
from ace_extproc.app import App
from ace_extproc.config import Config, parse_fleet, parse_settings
from ace_extproc.server import start
from ace_extproc.sim.app import POD_HEADER, SimConfig, SimServer
from ace_extproc.stack import envoy_binary
from tests import bootstrap_parts as parts
from tests.conftest import Sent, envoy_validate, free_ports, make_app

pytestmark = pytest.mark.envoy

GIE = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
PODS = 3
_EXT_PROC = parts.T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"


def gie_envoy(
    listen: int,
    admin: int,
    ext_proc: int,
    pods: list[int],
    shape: str,
    fail_open: bool,
    subset: list[str] | None = None,
) -> dict[str, Any]:
    """An Envoy bootstrap shaped as GIE's own (its EPP's processing mode, metadata
    namespaces and pool cluster), ``shape`` "original_dst" or "override_host".
    ``subset``: a set_metadata filter before ext_proc puts it in the request's
    ``envoy.lb.subset_hint`` metadata, as a gateway that subsets does."""
    ext_proc_filter = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": fail_open,
            "allow_mode_override": True,
            "message_timeout": "1000s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
            },
        },
    }
    pool: dict[str, Any]
    if shape == "original_dst":
        pool = {
            "name": "pool",
            "connect_timeout": "5s",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": GIE},
        }
    else:
        pool = parts.static_cluster("pool", pods)
        sources = [{"header": GIE}, {"metadata": {"key": "envoy.lb", "path": [{"key": GIE}]}}]
        pool["load_balancing_policy"] = parts.override_host(sources, "round_robin")
    # TLS, the certificate not checked: GIE's Istio and gateway setups with the picker's
    # self-signed certificate.
    epp = parts.grpc_cluster("epp", ext_proc, tls=True)
    filters = [*([_subset_filter(subset)] if subset is not None else []), ext_proc_filter]
    return parts.bootstrap(listen, admin, filters, "pool", [pool, epp])


def _subset_filter(subset: list[str]) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": parts.T + "envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {SUBSET: subset},
                }
            ],
        },
    }


@dataclass
class Gie:
    url: str
    loop: asyncio.AbstractEventLoop
    sent: Sent
    pods: dict[str, str]  # pod id -> ip:port
    app: App
    server: grpc.aio.Server

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def post(self, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], bytes]:
        async def go() -> tuple[int, dict[str, str], bytes]:
            data = json.dumps(body).encode()
            hdrs = {"content-type": "application/json", **headers}
            async with (
                aiohttp.ClientSession() as http,
                http.post(self.url + "/v1/chat/completions", data=data, headers=hdrs) as resp,
            ):
                got = {k.lower(): v for k, v in resp.headers.items()}
                return resp.status, got, await resp.read()

        result: tuple[int, dict[str, str], bytes] = self.run(go())
        return result


POD_ID = web.AppKey("pod_id", str)  # each simulated pod's id, for a middleware's records
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def _pods(
    ports: list[int], sent: Sent, *middlewares: Middleware
) -> AsyncIterator[list[SimServer]]:
    sims = []
    for i, port in enumerate(ports):
        sim = SimServer(SimConfig(pod_id=f"pod-{i}", time_scale=0, tpot_ms=0), port=port)
        sim.app[POD_ID] = f"pod-{i}"
        sim.app.middlewares.extend([sent.middleware(f"pod-{i}"), *middlewares])
        sims.append(sim)
    async with contextlib.AsyncExitStack() as stack:
        for sim in sims:
            await stack.enter_async_context(sim)
        yield sims


def pod_config(ports: list[int], router: dict[str, Any]) -> Config:
    """ace-extproc in prod over pods ``pod-i`` at ``ports``, its ``router`` settings."""
    pods = [{"id": f"pod-{i}", "base_url": f"http://127.0.0.1:{p}"} for i, p in enumerate(ports)]
    fleet = parse_fleet(
        {"destinations": [{"id": "llama", "base_url": pods[0]["base_url"], "pods": pods}]}
    )
    settings = {"mode": "prod", "admin_listen": "off", "metrics_listen": "off", **router}
    return Config(fleet, parse_settings(settings))


def _config(ports: list[int], ext_proc: int, router: dict[str, Any] | None = None) -> Config:
    return pod_config(
        ports,
        {
            "upstream_mode": "endpoint",
            # TLS with a self-signed certificate, no peer token; one endpoint named
            # (an ORIGINAL_DST cluster cannot read a list).
            "endpoint_picker": {},
            "salt_secret": "gie-secret",
            "listen": f"127.0.0.1:{ext_proc}",
            **(router or {}),
        },
    )


@contextlib.contextmanager
def gie(
    tmp_path: Path,
    sent: Sent,
    shape: str,
    fail_open: bool,
    router: dict[str, Any] | None = None,
    subset: list[int] | None = None,
) -> Iterator[Gie]:
    """Pods and ace-extproc in this process (one event loop), Envoy as GIE sets it up;
    ``subset``: the indexes of the pods the gateway's subset hint allows."""
    *pod_ports, listen, admin, ext_proc = free_ports(PODS + 3)
    allowed = None if subset is None else [f"127.0.0.1:{pod_ports[i]}" for i in subset]
    doc = gie_envoy(listen, admin, ext_proc, pod_ports, shape, fail_open, allowed)
    config = _config(pod_ports, ext_proc, router)
    name = f"envoy-{shape}-{fail_open}"
    with running(tmp_path / name, (listen, admin), doc, config, sent, _pods(pod_ports, sent)) as g:
        yield g


@contextlib.contextmanager
def running(
    where: Path,
    ports: tuple[int, int],
    doc: dict[str, Any],
    config: Config,
    sent: Sent,
    pods_cm: contextlib.AbstractAsyncContextManager[list[SimServer]],
) -> Iterator[Gie]:
    """The pods, ace-extproc (``config``) and the real Envoy on the bootstrap ``doc``
    (validated first; its listener and admin ``ports``), all until the block ends;
    ``sent`` records what the pods wrote."""
    listen, admin = ports
    bootstrap = where.with_suffix(".yaml")
    bootstrap.write_text(yaml.safe_dump(doc))
    envoy_validate(bootstrap)
    loop = asyncio.new_event_loop()
    app = make_app(config)
    loop.run_until_complete(pods_cm.__aenter__())
    server, _ = loop.run_until_complete(start(app))
    log = where.with_suffix(".log").open("w")
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(bootstrap), "--concurrency", "1", "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{listen}"
    try:
        loop.run_until_complete(_ready(f"http://127.0.0.1:{admin}/ready"))
        pods = {p.id: p.endpoint for p in config.fleet.pods}
        yield Gie(url, loop, sent, pods, app, server)
    finally:
        envoy.terminate()
        envoy.wait(10)
        log.close()
        loop.run_until_complete(server.stop(0))
        loop.run_until_complete(app.stop())
        loop.run_until_complete(pods_cm.__aexit__(None, None, None))
        loop.close()


async def _ready(url: str) -> None:
    for _ in range(200):
        try:
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("envoy never became ready")


def chat(topic: str, stream: bool, max_tokens: int = 40) -> dict[str, Any]:
    system = f"You are the {topic} assistant. " * 60
    return {
        "model": "sim-llama",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": topic}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


SHAPES = [
    pytest.param("original_dst", False, id="original_dst-FailClose"),
    pytest.param("original_dst", True, id="original_dst-FailOpen"),
    pytest.param("override_host", False, id="override_host-FailClose"),
    pytest.param("override_host", True, id="override_host-FailOpen"),
]


@pytest.mark.parametrize(("shape", "fail_open"), SHAPES)
def test_responses_reach_the_client_byte_identical(
    tmp_path: Path, sent: Sent, shape: str, fail_open: bool
) -> None:
    with gie(tmp_path, sent, shape, fail_open) as g:
        for stream in (False, True):
            for turn in range(2):
                status, headers, body = g.post(chat(f"bytes-{stream}", stream))
                assert status == 200, body
                pod = headers[POD_HEADER]
                # The engine's answer, exactly: every chunk passed on unchanged.
                assert body == sent.by_pod[pod][-1]
                if stream:
                    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") > 10
                else:
                    assert json.loads(body)["choices"][0]["message"]["content"]
                # Routed: the same prefix goes to the same pod each turn.
                if turn == 0:
                    first = pod
                assert pod == first
                # ace-extproc's report on the response: the pod it picked, its decision.
                assert headers[mutate.PINNED_HEADER].endswith(f"/{pod}")
                action = "hit" if turn else "miss"
                assert headers[mutate.TRACE_HEADER].startswith(f"mode=prod,action={action},")
        # Usage read on the way: the ledger counted each response for its pod.
        ledger = g.app.observer.ledger
        assert sum(t.responses for t in ledger.by_pod.values()) == 4


@pytest.mark.parametrize(("shape", "fail_open"), SHAPES[2:])
def test_a_large_request_body_and_a_long_stream_pass_whole(
    tmp_path: Path, sent: Sent, shape: str, fail_open: bool
) -> None:
    with gie(tmp_path, sent, shape, fail_open) as g:
        big = chat("large", True, max_tokens=400)
        big["messages"][1]["content"] = "z" * 300_000  # several 62 KB chunks each way
        status, headers, body = g.post(big)
        assert status == 200
        assert body == sent.by_pod[headers[POD_HEADER]][-1] and len(body) > 20_000


@pytest.mark.parametrize(("shape", "fail_open"), [SHAPES[0], SHAPES[2]])
def test_a_subset_hint_confines_the_pick_and_an_empty_one_is_refused(
    tmp_path: Path, sent: Sent, shape: str, fail_open: bool
) -> None:
    with gie(tmp_path, sent, shape, fail_open) as g:
        for i in range(6):
            allowed = g.pods[f"pod-{i % PODS}"]
            status, headers, _ = g.post(chat(f"subset-{i}", False), **{SUBSET: allowed})
            assert status == 200
            assert g.pods[headers[POD_HEADER]] == allowed
        status, _, body = g.post(chat("subset-none", False), **{SUBSET: "10.9.9.9:1"})
        assert status == 503
        assert "subset" in json.loads(body)["error"]["message"]


def test_the_gateway_s_subset_hint_in_metadata_is_honoured(tmp_path: Path, sent: Sent) -> None:
    with gie(tmp_path, sent, "original_dst", False, subset=[1]) as g:
        landed = {g.post(chat(f"hint-{i}", False))[1][POD_HEADER] for i in range(6)}
        assert landed == {"pod-1"}


def test_usage_is_read_on_the_way_where_usage_capture_is_on(tmp_path: Path, sent: Sent) -> None:
    with gie(tmp_path, sent, "override_host", False, router={"usage_capture": True}) as g:
        for stream in (False, True, False, True):
            status, headers, body = g.post(chat("usage", stream))
            assert status == 200 and body == sent.by_pod[headers[POD_HEADER]][-1]
        [totals] = g.app.observer.ledger.by_pod.values()
        # Every response's usage, the stream's usage chunk included (asked for by the
        # router), and the later turns' reuse as the engine counted it.
        assert totals.responses == totals.with_usage == 4
        assert totals.cached_tokens > 0


@pytest.mark.parametrize(("shape", "fail_open"), [SHAPES[1], SHAPES[2], SHAPES[3]])
def test_with_the_picker_down_requests_fail_in_either_failure_mode(
    tmp_path: Path, sent: Sent, shape: str, fail_open: bool
) -> None:
    """Envoy 1.40 fails a request whose ext_proc stream cannot be opened in
    FULL_DUPLEX_STREAMED mode even with failure_mode_allow (FailOpen): 500, as with
    FailClose. What FailOpen keeps going is the buffered modes' (test_e2e.py)."""
    with gie(tmp_path, sent, shape, fail_open) as g:
        assert g.post(chat("down", False))[0] == 200
        g.run(g.server.stop(0))
        status, _, body = g.post(chat("down", False))
        assert status == 500, body
