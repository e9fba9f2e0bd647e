"""Discovery by label selector (an InferencePool's), through the pods API of a fake
Kubernetes API server: LIST, then WATCH from its resourceVersion; Ready pods in, not
ready, pending or deleting ones out. And the endpoint picker's readiness, which waits
for that first LIST."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from ace_extproc import envoy_config as ec
from ace_extproc import server
from ace_extproc.app import build
from ace_extproc.config import (
    Config,
    ConfigError,
    Destination,
    EndpointPicker,
    Fleet,
    Settings,
    fleet_to_dict,
    parse_fleet,
)
from ace_extproc.routing.discovery import PodSelectorDiscovery, for_destination
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from tests.conftest import serving
from tests.test_discovery import _run, _until
from tests.test_epp import NOT_SERVING, SERVING, _health, picker_settings

SELECTOR = {"app": "vllm", "pool": "llama"}
PATH = "/api/v1/namespaces/ns/pods"


def _pod(name: str, rv: int, ip: str | None, ready: bool = True, **extra: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": extra.pop("phase", "Running"),
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    meta = {"name": name, "resourceVersion": str(rv), "labels": SELECTOR, **extra}
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "status": status}


class FakePods:
    """The pods API: each LIST answered from ``lists`` once ``listed`` is set; each
    WATCH streams ``watches`` events, waiting for ``step`` before those in ``hold``."""

    def __init__(self) -> None:
        self.lists: list[dict[str, Any]] = []
        self.watches: list[list[dict[str, Any]]] = []
        self.queries: list[dict[str, str]] = []
        self.listed = asyncio.Event()
        self.step = asyncio.Event()
        self.hold: set[int] = set()
        self.closing = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.queries.append(query)
        if "watch" not in query:
            await self.listed.wait()
            return web.json_response(self.lists.pop(0))
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, event in enumerate(self.watches.pop(0) if self.watches else []):
            if i in self.hold:
                await self.step.wait()
                self.step.clear()
            await resp.write(json.dumps(event).encode() + b"\n")
        await self.closing.wait()  # then idle, until the server stops
        return resp


@contextlib.asynccontextmanager
async def _serve(api: FakePods) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get(PATH, api.handle)
    async with serving(app) as port:
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            api.closing.set()


def test_pods_matching_the_selector_are_the_fleet_while_ready() -> None:
    fleet = Fleet((Destination("a", "vllm", "http://pods.ns.svc:8000", ()),))
    fs = FleetState(fleet)
    dest = fleet.destinations[0]
    api = FakePods()
    api.listed.set()
    api.lists = [
        {
            "kind": "PodList",
            "metadata": {"resourceVersion": "10"},
            "items": [
                _pod("llama-0", 5, "10.4.0.1"),
                _pod("llama-1", 6, "10.4.0.2", ready=False),  # starting: not ready yet
                _pod("llama-2", 7, None, phase="Pending"),  # no IP yet
            ],
        }
    ]
    api.watches = [
        [
            {"type": "MODIFIED", "object": _pod("llama-1", 11, "10.4.0.2")},  # ready now
            {"type": "ADDED", "object": _pod("llama-3", 12, "10.4.0.4")},
            # llama-0 deleting (draining) before it is gone; llama-3 not ready any more
            {
                "type": "MODIFIED",
                "object": _pod("llama-0", 13, "10.4.0.1", deletionTimestamp="2026-01-01T00:00:00Z"),
            },
            {"type": "MODIFIED", "object": _pod("llama-3", 14, "10.4.0.4", ready=False)},
            {"type": "DELETED", "object": _pod("llama-0", 15, "10.4.0.1")},
        ]
    ]
    api.hold = {2}

    def hosts() -> set[str]:
        return {fs.pods[s].host for s in range(len(fs.pods)) if fs.candidates(dest) >> s & 1}

    async def main() -> None:
        async with _serve(api) as url:
            d = PodSelectorDiscovery(
                fs, BlockIndex(100), "a", url, "ns", SELECTOR, 8000, interval_s=0.05
            )
            await d.start()
            try:
                await _until(lambda: hosts() == {"10.4.0.1", "10.4.0.2", "10.4.0.4"})
                assert d.synced.is_set()
                api.step.set()
                await _until(lambda: hosts() == {"10.4.0.2"})
                await _until(lambda: d.resource_version == "15")
                assert {fs.pods[s].port for s in d.slots.values()} == {8000}
            finally:
                await d.stop()

    _run(main())
    # The selector, as the API takes it; the watch from the list's version.
    assert api.queries[0] == {"labelSelector": "app=vllm,pool=llama"}
    assert api.queries[1]["resourceVersion"] == "10" and api.queries[1]["watch"] == "1"


def _pods_doc(**discovery: Any) -> dict[str, Any]:
    found = {"type": "kubernetes-pods", "namespace": "ns", "selector": SELECTOR, "port": 8000}
    return {"destinations": [{"id": "llama", "discovery": {**found, **discovery}}]}


def test_the_selector_discovery_configuration() -> None:
    fleet = parse_fleet(_pods_doc())
    [dest] = fleet.destinations
    assert dest.discovery is not None and dest.discovery.type == "kubernetes-pods"
    assert dict(dest.discovery.selector) == SELECTOR
    assert parse_fleet(fleet_to_dict(fleet)) == fleet  # written back as read
    d = for_destination(FleetState(fleet), BlockIndex(10), dest)
    assert isinstance(d, PodSelectorDiscovery) and d.port == 8000
    with pytest.raises(ConfigError, match="selector"):
        parse_fleet(_pods_doc(selector={}))
    with pytest.raises(ConfigError, match="port"):
        parse_fleet(
            {
                "destinations": [
                    {
                        "id": "x",
                        "discovery": _pods_doc()["destinations"][0]["discovery"] | {"port": None},
                    }
                ]
            }
        )
    # Envoy: an ORIGINAL_DST cluster needs no name to resolve; override_host does.
    settings = Settings(upstream_mode="endpoint", endpoint_cluster="original_dst")
    ec.render(Config(fleet, settings))
    with pytest.raises(ConfigError, match="hostname"):
        ec.render(Config(fleet, Settings(upstream_mode="endpoint")))
    named = parse_fleet(_pods_doc(hostname="llama-pods.ns.svc.cluster.local"))
    ec.render(Config(named, Settings(upstream_mode="endpoint")))


def test_the_picker_is_ready_once_the_pods_are_listed(port: int) -> None:
    api = FakePods()
    api.lists = [{"metadata": {"resourceVersion": "3"}, "items": [_pod("p", 2, "10.4.0.9")]}]
    target = f"127.0.0.1:{port}"

    async def main() -> tuple[list[int], list[int]]:
        async with _serve(api) as url:
            fleet = parse_fleet(_pods_doc(api_url=url))
            settings = picker_settings(port, EndpointPicker(secure_serving=False))
            app = build(Config(fleet, settings))
            srv, _ = await server.start(app)
            try:
                names = ["liveness", "readiness", server.EXT_PROC_SERVICE]
                await _until(lambda: len(api.queries) == 1)  # the LIST is waiting
                before = [await _health(target, n) for n in names]
                api.listed.set()
                await _until(lambda: app.fleet.members != 0)
                for _ in range(100):
                    if await _health(target, "readiness") == SERVING:
                        break
                    await asyncio.sleep(0.02)
                return before, [await _health(target, n) for n in names]
            finally:
                await srv.stop(0)
                await app.stop()

    before, after = asyncio.run(main())
    assert before == [SERVING, NOT_SERVING, NOT_SERVING]
    assert after == [SERVING, SERVING, SERVING]
