"""Fleet discovery: FleetState membership, DNS and Kubernetes EndpointSlices (against
a fake API server), the monitor following membership, and the config syntax."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import pytest
from aiohttp import web

from ace_extproc.config import (
    ConfigError,
    Destination,
    Fleet,
    Pod,
    Settings,
    fleet_to_dict,
    parse_fleet,
)
from ace_extproc.routing import rendezvous
from ace_extproc.routing.discovery import (
    DnsDiscovery,
    KubernetesDiscovery,
    StaticDiscovery,
    for_destination,
)
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.monitor import FleetMonitor
from tests.conftest import serving


def _fleet(n: int = 2, dest: str = "a") -> Fleet:
    pods = tuple(Pod(dest, f"p{i}", f"10.0.0.{i + 1}", 8000) for i in range(n))
    return Fleet((Destination(dest, "vllm", "http://svc:8000", pods),))


def _run(coro: Awaitable[None], timeout: float = 10.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(coro, timeout)

    asyncio.run(main())


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- FleetState


def test_add_and_remove_pod_masks_and_slot_reuse() -> None:
    fs = FleetState(_fleet(2))
    dest = fs.fleet.destinations[0]
    changes: list[tuple[int, str]] = []
    fs.on_change.append(lambda slot, change: changes.append((slot, change)))
    assert fs.candidates(dest) == 0b11

    new = Pod("a", "p9", "10.0.0.9", 8000)
    slot = fs.add_pod(new)
    assert slot == 2 and fs.pods[2] == new
    assert len(fs.seeds) == len(fs.load) == len(fs.capacity_tokens) == 3
    assert fs.seeds[2] == (rendezvous.pod_seed(new.key), 1.0)
    assert fs.candidates(dest) == 0b111 and fs.available == 0b111
    assert fs.add_pod(new) == 2  # already in: nothing changes, no event
    assert changes == [(2, "added")]

    fs.load[0].inflight = 5
    fs.capacity_tokens[0] = 1000
    fs.remove_pod(0)
    assert fs.candidates(dest) == 0b110 and not fs.is_member(0)
    assert len(fs.pods) == 3  # the slot waits for the pod
    fs.set_available(0, True)  # a late good probe does not bring it back
    assert fs.candidates(dest) == 0b110 and not fs.available & 1
    fs.remove_pod(0)  # twice: nothing
    assert changes == [(2, "added"), (0, "removed")]

    assert fs.add_pod(Pod("a", "p0", "10.0.0.1", 8000)) == 0  # back in its old slot
    assert fs.candidates(dest) == 0b111
    assert fs.load[0].inflight == 0 and fs.capacity_tokens[0] is None  # a new process
    assert changes[-1] == (0, "added")
    with pytest.raises(ValueError):
        fs.add_pod(Pod("nope", "x", "10.0.0.1", 1))


def test_listener_errors_do_not_stop_others() -> None:
    fs = FleetState(_fleet(1))
    seen: list[int] = []

    def broken(slot: int, change: str) -> None:
        raise RuntimeError("bug")

    fs.on_change += [broken, lambda slot, change: seen.append(slot)]
    fs.add_pod(Pod("a", "x", "10.0.0.5", 1))
    assert seen == [1]


def test_rendezvous_moves_only_what_membership_changes() -> None:
    fs = FleetState(_fleet(8))
    dest = fs.fleet.destinations[0]
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(10_000)]

    def owners() -> list[int]:
        cand = fs.candidates(dest)
        return [rendezvous.best(k, fs.seeds, cand) for k in keys]

    before = owners()
    slot = fs.add_pod(Pod("a", "p8", "10.0.0.9", 8000))
    after = owners()
    moved = [i for i in range(len(keys)) if before[i] != after[i]]
    assert all(after[i] == slot for i in moved)  # keys move only to the new pod
    assert abs(len(moved) / len(keys) - 1 / 9) < 0.02  # about 1/9 of them

    fs.remove_pod(3)
    gone = owners()
    changed = [i for i in range(len(keys)) if after[i] != gone[i]]
    assert changed and all(after[i] == 3 for i in changed)  # only that pod's keys move
    assert 3 not in gone


def test_static_discovery_changes_nothing() -> None:
    fleet = _fleet(2)
    fs = FleetState(fleet)
    d = for_destination(fs, BlockIndex(10), fleet.destinations[0])
    assert isinstance(d, StaticDiscovery)

    async def main() -> None:
        await d.start()
        await asyncio.sleep(0.01)
        await d.stop()

    _run(main())
    assert fs.members == 0b11


# ---------------------------------------------------------------- DNS


def test_dns_discovery_follows_the_records(caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet((Destination("a", "vllm", "http://svc:8000", ()),))
    fs = FleetState(fleet)
    index = BlockIndex(100)
    answers: list[list[str] | Exception] = [
        ["10.1.0.1", "10.1.0.2"],
        ["10.1.0.2", "10.1.0.3", "fd00::7"],
        socket.gaierror(-2, "Name or service not known"),
        socket.gaierror(-2, "Name or service not known"),
        ["10.1.0.3", "fd00::7"],
    ]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> Iterable[str]:
        asked.append((host, port))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    d = DnsDiscovery(fs, index, "a", "svc.ns.svc.cluster.local", 8000, 0.01, resolver=resolver)
    dest = fleet.destinations[0]
    assert fs.candidates(dest) == 0  # no pods until discovery finds some

    async def main() -> None:
        await d.refresh()
        assert [fs.pods[s].host for s in d.slots.values()] == ["10.1.0.1", "10.1.0.2"]
        assert fs.pods[0] == Pod("a", "10-1-0-1", "10.1.0.1", 8000)
        index.record(0, [1, 2, 3])
        index.record(1, [1, 2])
        await d.refresh()
        assert fs.candidates(dest) == 0b1110  # 10.1.0.1 left, two joined
        assert index.blocks_held(0) == 0 and index.longest_match([1, 2, 3], -1) == (2, 0b10)
        assert fs.pods[3].id == "fd00--7"
        with caplog.at_level("WARNING"):
            await d.refresh()
            await d.refresh()
        assert fs.candidates(dest) == 0b1110  # errors keep the last known set
        assert sum("resolving" in r.message for r in caplog.records) == 1  # logged once
        await d.refresh()
        assert fs.candidates(dest) == 0b1100

    _run(main())
    assert asked[0] == ("svc.ns.svc.cluster.local", 8000)


def test_dns_discovery_loop_runs_and_stops() -> None:
    fs = FleetState(Fleet((Destination("a", "vllm", "http://svc:8000", ()),)))

    async def resolver(host: str, port: int) -> Iterable[str]:
        await asyncio.sleep(0)
        return ["127.0.0.1"]

    d = DnsDiscovery(fs, BlockIndex(10), "a", "svc", 8000, 0.01, resolver=resolver)

    async def main() -> None:
        await d.start()
        await _until(lambda: d.syncs >= 3)
        await d.stop()
        await d.stop()

    _run(main())
    assert fs.members == 1


def test_dns_default_resolver_uses_getaddrinfo() -> None:
    fs = FleetState(Fleet((Destination("a", "vllm", "http://svc:8000", ()),)))
    d = DnsDiscovery(fs, BlockIndex(10), "a", "localhost", 8000, 1.0)
    _run(d.refresh())
    assert fs.members and all(fs.pods[s].port == 8000 for s in d.slots.values())


# ---------------------------------------------------------------- Kubernetes


def _slice(name: str, rv: int, endpoints: list[tuple[str, bool, bool]]) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "resourceVersion": str(rv),
            "labels": {"kubernetes.io/service-name": "llm"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "terminating": terminating}}
            for ip, ready, terminating in endpoints
        ],
    }


class FakeApi:
    """A Kubernetes API server with just EndpointSlices: LIST, and a scripted WATCH."""

    def __init__(self) -> None:
        self.lists: list[dict[str, Any]] = []  # the answers of successive LISTs
        self.watches: list[list[dict[str, Any]] | int] = []  # events, or an HTTP status
        self.requests: list[dict[str, str]] = []
        self.auth: list[str] = []
        self.step = asyncio.Event()  # set by the test to let the watch go on
        self.hold: set[int] = set()  # indexes of watch events to wait for ``step`` before
        self.closing = asyncio.Event()  # ends idle watches, so the server can stop

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        self.auth.append(request.headers.get("Authorization", ""))
        assert request.path == "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices"
        assert query["labelSelector"] == "kubernetes.io/service-name=llm"
        if "watch" not in query:
            return web.json_response(self.lists.pop(0))
        script = self.watches.pop(0) if self.watches else []
        if isinstance(script, int):
            return web.Response(status=script)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, event in enumerate(script):
            if i in self.hold:
                await self.step.wait()
                self.step.clear()
            await resp.write(json.dumps(event).encode() + b"\n")
        if not script:
            await self.closing.wait()  # an idle watch, until the server stops
        return resp


@contextlib.asynccontextmanager
async def _serve(api: FakeApi) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", api.handle)
    async with serving(app) as port:
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            api.closing.set()


def test_kubernetes_discovery_list_watch_relist(tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    fleet = Fleet((Destination("a", "vllm", "http://llm.ns.svc:8000", ()),))
    fs = FleetState(fleet)
    dest = fleet.destinations[0]
    index = BlockIndex(100)
    monitor = FleetMonitor(fs, index, Settings())  # follows membership (not started)
    api = FakeApi()
    api.lists = [
        {
            "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": "10"},
            "items": [
                _slice("llm-x", 9, [("10.2.0.1", True, False), ("10.2.0.2", True, False)]),
                _slice("llm-y", 9, [("10.2.0.9", False, False)]),  # not ready yet
            ],
        },
        {  # the re-list after 410: llm-x as it is now, and a new slice
            "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": "30"},
            "items": [
                _slice("llm-x", 13, [("10.2.0.2", True, False), ("10.2.0.3", False, False)]),
                _slice("llm-z", 29, [("10.2.0.5", True, False)]),
            ],
        },
    ]
    api.watches = [
        [
            # an endpoint added
            {
                "type": "MODIFIED",
                "object": _slice(
                    "llm-x",
                    11,
                    [
                        ("10.2.0.1", True, False),
                        ("10.2.0.2", True, False),
                        ("10.2.0.3", True, False),
                    ],
                ),
            },
            # one turning not ready (10.2.0.3), one draining (10.2.0.1)
            {
                "type": "MODIFIED",
                "object": _slice(
                    "llm-x",
                    12,
                    [
                        ("10.2.0.1", True, True),
                        ("10.2.0.2", True, False),
                        ("10.2.0.3", False, False),
                    ],
                ),
            },
            {"type": "DELETED", "object": _slice("llm-y", 13, [])},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}},
            {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}},
        ],
        [],  # after the re-list: an idle watch
    ]
    api.hold = {1, 3}

    def hosts() -> set[str]:
        return {fs.pods[s].host for s in range(len(fs.pods)) if fs.candidates(dest) >> s & 1}

    async def main() -> None:
        async with _serve(api) as url:
            d = KubernetesDiscovery(
                fs,
                index,
                "a",
                url,
                "ns",
                "llm",
                port_name="http",
                token_path=str(token),
                ca_path=str(tmp_path / "none.crt"),
                interval_s=0.05,
            )
            await d.start()
            try:
                await _until(lambda: hosts() == {"10.2.0.1", "10.2.0.2", "10.2.0.3"})
                assert monitor.watched == [0, 1, 2]
                slot1 = d.slots["a/10-2-0-1"]
                slot3 = d.slots["a/10-2-0-3"]
                index.record(slot1, [7, 8, 9])
                index.record(slot3, [7, 8])
                api.step.set()
                await _until(lambda: hosts() == {"10.2.0.2"})
                assert index.blocks_held(slot1) == index.blocks_held(slot3) == 0
                assert index.longest_match([7, 8, 9], -1) == (0, 0)  # entries dropped
                assert monitor.watched == [d.slots["a/10-2-0-2"]]
                assert d.resource_version == "13"
                api.step.set()  # the BOOKMARK, then 410: a re-list
                await _until(lambda: d.lists == 2)
                await _until(lambda: hosts() == {"10.2.0.2", "10.2.0.5"})
                assert d.resource_version == "30"
                assert fs.pods[d.slots["a/10-2-0-5"]].port == 8000
                await _until(lambda: len(api.requests) == 4)  # the idle watch is open
            finally:
                await d.stop()

    _run(main())
    watch_queries = [q for q in api.requests if "watch" in q]
    assert watch_queries[0]["resourceVersion"] == "10"
    assert watch_queries[1]["resourceVersion"] == "30"
    assert set(api.auth) == {"Bearer s3cret"}
    assert len(fs.pods) == 4  # 10.2.0.1, .2, .3 and .5: the departed pods' slots wait


def test_engines_sharing_an_ip_are_told_apart_by_port() -> None:
    """Host-networked engines on one node share its IP; slices give them different ports."""
    fleet = Fleet((Destination("a", "vllm", "http://llm.ns.svc:8000", ()),))
    fs = FleetState(fleet)
    d = KubernetesDiscovery(fs, BlockIndex(10), "a", "http://unused", "ns", "llm", port_name="http")
    one = _slice("s1", 1, [("10.4.0.1", True, False), ("10.4.0.2", True, False)])
    other = _slice("s2", 1, [("10.4.0.1", True, False)])
    other["ports"] = [{"name": "http", "port": 8001, "protocol": "TCP"}]
    d._set_slice(one)
    d._set_slice(other)
    d._apply()
    members = sorted(
        (fs.pods[s].id, fs.pods[s].address) for s in range(len(fs.pods)) if fs.is_member(s)
    )
    assert members == [
        ("10-4-0-1-8000", "10.4.0.1:8000"),
        ("10-4-0-1-8001", "10.4.0.1:8001"),
        ("10-4-0-2", "10.4.0.2:8000"),
    ]


def test_kubernetes_watch_http_410_and_errors_recover() -> None:
    fleet = Fleet((Destination("a", "vllm", "http://llm.ns.svc:8000", ()),))
    fs = FleetState(fleet)
    api = FakeApi()
    api.lists = [
        {
            "metadata": {"resourceVersion": "1"},
            "items": [_slice("s", 1, [("10.3.0.1", True, False)])],
        },
        {
            "metadata": {"resourceVersion": "5"},
            "items": [_slice("s", 5, [("10.3.0.2", True, False)])],
        },
    ]
    api.watches = [500, 410, []]  # an error (retried with backoff), Gone (re-list), idle

    async def main() -> None:
        async with _serve(api) as url:
            d = KubernetesDiscovery(fs, BlockIndex(10), "a", url, "ns", "llm", port=9000)
            d.interval_s = 0.02
            await d.start()
            try:
                await _until(lambda: d.lists == 2 and len(api.requests) == 5)
            finally:
                await d.stop()
            assert {fs.pods[s].address for s in d.slots.values()} == {"10.3.0.2:9000"}

    _run(main())
    assert fs.members == 0b10


# ---------------------------------------------------------------- config


def _doc(discovery: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"destinations": [{"id": "a", "discovery": discovery, **extra}]}


def test_config_dns_and_kubernetes() -> None:
    fleet = parse_fleet(
        _doc({"type": "dns", "hostname": "llm.ns.svc.cluster.local", "port": 8000, "interval_s": 2})
    )
    d = fleet.destinations[0]
    assert d.pods == () and d.base_url == "http://llm.ns.svc.cluster.local:8000"
    assert d.discovery is not None and d.discovery.type == "dns" and d.discovery.interval_s == 2.0
    assert parse_fleet(fleet_to_dict(fleet)) == fleet

    fleet = parse_fleet(
        _doc(
            {"type": "kubernetes", "namespace": "ns", "service": "llm", "port": 8000},
            base_url="http://gw:80",
            pods=[{"id": "p0", "base_url": "http://10.0.0.1:8000"}],
        )
    )
    d = fleet.destinations[0]
    assert d.base_url == "http://gw:80" and len(d.pods) == 1
    assert d.discovery is not None
    assert d.discovery.api_url == "https://kubernetes.default.svc"
    assert d.discovery.token_path.endswith("serviceaccount/token")
    assert parse_fleet(fleet_to_dict(fleet)) == fleet
    fs = FleetState(fleet)
    k = for_destination(fs, BlockIndex(10), d)
    assert isinstance(k, KubernetesDiscovery) and k.port == 8000
    # The old form still parses as before: no discovery, one implied pod.
    plain = parse_fleet({"destinations": [{"id": "a", "base_url": "http://h:1"}]})
    assert plain.destinations[0].discovery is None and len(plain.destinations[0].pods) == 1


@pytest.mark.parametrize(
    ("discovery", "field"),
    [
        ({"type": "consul"}, "discovery.type"),
        ("dns", "discovery"),
        ({"type": "dns", "port": 8000}, "hostname"),
        ({"type": "dns", "hostname": "bad host!", "port": 8000}, "discovery.hostname"),
        ({"type": "dns", "hostname": "h", "port": 0}, "discovery.port"),
        ({"type": "dns", "hostname": "h", "port": 1, "interval_s": -1}, "discovery.interval_s"),
        ({"type": "dns", "hostname": "h", "port": 1, "namespace": "x"}, "discovery.namespace"),
        ({"type": "kubernetes", "namespace": "ns", "service": "llm"}, "discovery.port"),
        ({"type": "kubernetes", "namespace": "NS!", "service": "s", "port": 1}, "namespace"),
        ({"type": "kubernetes", "namespace": "ns", "port": 1}, "service"),
        (
            {
                "type": "kubernetes",
                "namespace": "n",
                "service": "s",
                "port": 1,
                "api_url": "ftp://x",
            },
            "discovery.api_url",
        ),
        (
            {"type": "kubernetes", "namespace": "n", "service": "s", "port_name": 5},
            "discovery.port_name",
        ),
    ],
)
def test_config_bad_discovery_names_the_field(discovery: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_fleet(_doc(discovery))


# ---------------------------------------------------------------- wiring


def test_server_start_runs_discovery_and_stops_it(port: int) -> None:
    from ace_extproc import server
    from ace_extproc.app import build
    from ace_extproc.config import Config

    fleet = parse_fleet(
        _doc({"type": "dns", "hostname": "localhost", "port": 8000, "interval_s": 0.05})
    )
    cfg = Config(fleet, Settings(listen=f"127.0.0.1:{port}", probe_interval_s=0))
    app = build(cfg)

    async def main() -> None:
        srv, _health = await server.start(app)
        try:
            [d] = app.discoveries
            assert isinstance(d, DnsDiscovery)
            await _until(lambda: app.fleet.members != 0)
            await app.stop()
            assert d._task is None  # stopped
        finally:
            await srv.stop(None)

    _run(main())
    assert app.fleet.pods[0].port == 8000
