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

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ace_extproc import mutate
from ace_extproc.envoy_config import GIE_HEADER
from ace_extproc.sim.app import POD_HEADER
from tests import bootstrap_parts as parts
from tests.conftest import Sent, free_ports
from tests.test_chart import one, render
from tests.test_chart_modes import MODES
from tests.test_e2e_gie import (
    POD_ID,
    Gie,
    Handler,
    Middleware,
    _pods,
    chat,
    pod_config,
    running,
)

pytestmark = pytest.mark.envoy

PODS = 3
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
            "@type": parts.T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
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
    cluster = parts.static_cluster("backend", pods)
    cluster["load_balancing_policy"] = parts.override_host(sources, "least_request")
    return cluster


def _bootstrap(
    listen: int, admin: int, ext_proc: int, pods: list[int], fail_open: bool
) -> dict[str, Any]:
    ext, btp = _policies(fail_open)
    clusters = [_route_cluster(btp, pods), parts.grpc_cluster("extproc", ext_proc)]
    return parts.bootstrap(listen, admin, [_ext_proc_filter(ext, "extproc")], "backend", clusters)


@contextlib.contextmanager
def envoy_gateway(
    tmp_path: Path, sent: Sent, fail_open: bool, middleware: Middleware
) -> Iterator[Gie]:
    """Envoy as Envoy Gateway would configure it from the chart's policies, in front of
    ace-extproc as the chart's extension mode runs it (endpoint mode, on a plaintext port
    that asks no token: the NetworkPolicy guards it) and three simulated pods."""
    *pod_ports, listen, admin, ext_proc = free_ports(PODS + 3)
    doc = _bootstrap(listen, admin, ext_proc, pod_ports, fail_open)
    config = pod_config(
        pod_ports,
        {
            "upstream_mode": "endpoint",
            "require_peer_token": False,
            "salt_secret": "eg-secret",
            "listen": f"127.0.0.1:{ext_proc}",
        },
    )
    pods = _pods(pod_ports, sent, middleware)
    with running(tmp_path / f"envoy-eg-{fail_open}", (listen, admin), doc, config, sent, pods) as g:
        yield g


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
                # What ace-extproc did, on the response, as its own Envoy reports it: the
                # pod it pinned, and the decision (a prefix new, then found warm).
                assert headers[mutate.PINNED_HEADER] == f"llama/{pod}"
                action = "hit" if topic in served else "miss"
                assert headers[mutate.TRACE_HEADER].startswith(f"mode=prod,action={action},")
                served.setdefault(topic, set()).add(pod)
        # A prefix stays on its pod (its later requests find it warm); prefixes spread.
        assert all(len(pods) == 1 for pods in served.values()), served
        assert len(set().union(*served.values())) > 1, served
