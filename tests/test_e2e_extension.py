"""The chart's extension mode (Envoy Gateway) pins pods, through the real Envoy.

Envoy Gateway turns the chart's two policies into Envoy configuration: the
EnvoyExtensionPolicy into an ext_proc filter (its processing mode, failOpen,
messageTimeout, writable metadata namespaces), and the BackendTrafficPolicy's
``endpointOverride`` into the route cluster's ``override_host`` load-balancing policy,
least-request as its fallback (envoyproxy/gateway: internal/xds/translator/extproc.go,
and the load-balancer-endpointoverride test data). Nothing here runs Envoy Gateway's
controller: the bootstrap is built from the rendered policies as its translator builds
it, and the real Envoy runs it in front of ace-extproc (endpoint mode, plaintext, as
Envoy Gateway dials a Service) and three simulated pods, in both failure modes."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from ace_extproc.config import Config, parse_fleet, parse_settings
from ace_extproc.envoy_config import GIE_HEADER
from ace_extproc.server import start
from ace_extproc.sim.app import POD_HEADER, SimConfig, SimServer
from ace_extproc.stack import envoy_binary
from tests.conftest import Sent, envoy_validate, free_ports, make_app
from tests.test_chart import one, render
from tests.test_chart_modes import MODES
from tests.test_e2e_gie import Gie, _ready, chat

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
POD_ID = web.AppKey("pod_id", str)

pytestmark = pytest.mark.envoy

PODS = 3
_T = "type.googleapis.com/"
_LB = _T + "envoy.extensions.load_balancing_policies."
_BODY_MODES = {"Buffered": "BUFFERED", "FullDuplexStreamed": "FULL_DUPLEX_STREAMED"}


def _policies(fail_open: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chart's EnvoyExtensionPolicy ext_proc entry and BackendTrafficPolicy spec."""
    values = {**MODES["extension"]}
    values["extension"] = {**values["extension"], "failOpen": fail_open}
    docs = render(values)
    (ext,) = one(docs, "EnvoyExtensionPolicy")["spec"]["extProc"]
    return ext, one(docs, "BackendTrafficPolicy")["spec"]


def _ext_proc_filter(ext: dict[str, Any], port_name: str) -> dict[str, Any]:
    """The EnvoyExtensionPolicy's ext_proc as Envoy Gateway's translator writes it: SKIP
    and NONE by default, SEND for the headers it names, the body modes it names (request
    trailers sent with a full-duplex body), its metadata namespaces as receiving ones."""
    mode = ext["processingMode"]
    body = _BODY_MODES[mode["request"]["body"]]
    processing = {
        "request_header_mode": "SEND",
        "request_body_mode": body,
        "request_trailer_mode": "SEND" if body == "FULL_DUPLEX_STREAMED" else "SKIP",
        "response_header_mode": "SEND" if "response" in mode else "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    timeout_ms = int(ext["messageTimeout"].removesuffix("ms"))
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": port_name}, "timeout": "10s"},
            "failure_mode_allow": ext["failOpen"],
            "allow_mode_override": mode["allowModeOverride"],
            "message_timeout": f"{timeout_ms / 1000}s",
            "processing_mode": processing,
            "metadata_options": {
                "receiving_namespaces": {"untyped": ext["metadata"]["writableNamespaces"]}
            },
        },
    }


def _route_cluster(btp: dict[str, Any], pods: list[int]) -> dict[str, Any]:
    """The backend's cluster with the BackendTrafficPolicy's endpoint override: the
    EndpointSlice's endpoints (static here), override_host on its headers, its load
    balancer type (LeastRequest) as the fallback."""
    lb = btp["loadBalancer"]
    assert lb["type"] == "LeastRequest"
    sources = [{"header": h["header"]} for h in lb["endpointOverride"]["extractFrom"]]
    hosts = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in pods
    ]
    fallback = {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {"@type": _LB + "least_request.v3.LeastRequest"},
    }
    override = {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": _LB + "override_host.v3.OverrideHost",
            "override_host_sources": sources,
            "fallback_policy": {"policies": [{"typed_extension_config": fallback}]},
        },
    }
    return {
        "name": "backend",
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {"cluster_name": "backend", "endpoints": [{"lb_endpoints": hosts}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": override}]},
    }


def _bootstrap(
    listen: int, admin: int, ext_proc: int, pods: list[int], fail_open: bool
) -> dict[str, Any]:
    ext, btp = _policies(fail_open)
    extproc_cluster = {
        "name": "extproc",
        "type": "STATIC",
        "connect_timeout": "5s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "extproc",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": "127.0.0.1",
                                        "port_value": ext_proc,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _T
            + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "eg",
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "llm",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "route": {"cluster": "backend", "timeout": "60s"},
                            }
                        ],
                    }
                ]
            },
            "http_filters": [
                _ext_proc_filter(ext, "extproc"),
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": _T + "envoy.extensions.filters.http.router.v3.Router"
                    },
                },
            ],
        },
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "eg",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [{"filters": [hcm]}],
                }
            ],
            "clusters": [_route_cluster(btp, pods), extproc_cluster],
        },
    }


def _config(ports: list[int], ext_proc: int) -> Config:
    """ace-extproc as the chart's extension mode runs it: endpoint mode, on a plaintext
    port that asks no token (the NetworkPolicy guards it)."""
    pods = [{"id": f"pod-{i}", "base_url": f"http://127.0.0.1:{p}"} for i, p in enumerate(ports)]
    fleet = parse_fleet(
        {"destinations": [{"id": "llama", "base_url": pods[0]["base_url"], "pods": pods}]}
    )
    settings = parse_settings(
        {
            "mode": "prod",
            "upstream_mode": "endpoint",
            "require_peer_token": False,
            "salt_secret": "eg-secret",
            "listen": f"127.0.0.1:{ext_proc}",
            "admin_listen": "off",
            "metrics_listen": "off",
        }
    )
    return Config(fleet, settings)


@contextlib.asynccontextmanager
async def _recorded_pods(
    ports: list[int], sent: Sent, middleware: Middleware
) -> AsyncIterator[list[SimServer]]:
    """The simulated pods, each recording what it was sent as well as what it wrote."""
    sims = []
    for i, port in enumerate(ports):
        sim = SimServer(SimConfig(pod_id=f"pod-{i}", time_scale=0, tpot_ms=0), port=port)
        sim.app[POD_ID] = f"pod-{i}"
        sim.app.middlewares.extend([sent.middleware(f"pod-{i}"), middleware])
        sims.append(sim)
    async with contextlib.AsyncExitStack() as stack:
        for sim in sims:
            await stack.enter_async_context(sim)
        yield sims


@contextlib.contextmanager
def envoy_gateway(
    tmp_path: Path, sent: Sent, fail_open: bool, middleware: Middleware
) -> Iterator[Gie]:
    *pod_ports, listen, admin, ext_proc = free_ports(PODS + 3)
    bootstrap = tmp_path / f"envoy-eg-{fail_open}.yaml"
    bootstrap.write_text(yaml.safe_dump(_bootstrap(listen, admin, ext_proc, pod_ports, fail_open)))
    envoy_validate(bootstrap)
    loop = asyncio.new_event_loop()
    config = _config(pod_ports, ext_proc)
    app = make_app(config)
    pods_cm = _recorded_pods(pod_ports, sent, middleware)
    loop.run_until_complete(pods_cm.__aenter__())
    server, _ = loop.run_until_complete(start(app))
    log = (tmp_path / "envoy.log").open("w")
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(bootstrap), "--concurrency", "1", "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        loop.run_until_complete(_ready(f"http://127.0.0.1:{admin}/ready"))
        pods = {p.id: p.endpoint for p in config.fleet.pods}
        yield Gie(f"http://127.0.0.1:{listen}", loop, sent, pods, app, server)
    finally:
        envoy.terminate()
        envoy.wait(10)
        log.close()
        loop.run_until_complete(server.stop(0))
        loop.run_until_complete(app.stop())
        loop.run_until_complete(pods_cm.__aexit__(None, None, None))
        loop.close()


@pytest.mark.parametrize("fail_open", [False, True], ids=["FailClose", "FailOpen"])
def test_envoy_gateway_honours_the_pod_ace_extproc_picks(
    tmp_path: Path, sent: Sent, fail_open: bool
) -> None:
    named: list[tuple[str, str]] = []  # (the pod that answered, the endpoint it was named)

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            named.append((request.app[POD_ID], request.headers.get(GIE_HEADER, "")))
        return await handler(request)

    with envoy_gateway(tmp_path, sent, fail_open, record) as eg:
        served: dict[str, set[str]] = {}
        for topic in (f"eg-{i}" for i in range(6)):
            for stream in (False, True, False):
                status, headers, body = eg.post(chat(topic, stream))
                assert status == 200, body
                pod = headers[POD_HEADER]
                # The pod that answered is the one ace-extproc named first in the header
                # (the rest are its fallbacks, for Envoy's retries) ...
                answered, endpoints = named[-1]
                assert (answered, endpoints.split(",")[0]) == (pod, eg.pods[pod]), named[-1]
                assert body == sent.by_pod[pod][-1]  # ... and its bytes passed unchanged
                served.setdefault(topic, set()).add(pod)
        # A prefix stays on its pod (its later requests find it warm); prefixes spread.
        assert all(len(pods) == 1 for pods in served.values()), served
        assert len(set().union(*served.values())) > 1, served
