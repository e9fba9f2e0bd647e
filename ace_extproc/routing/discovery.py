"""Fleet discovery: which pods a destination has, kept current at run time.

* ``StaticDiscovery``: the pods ``fleet.yaml`` lists; nothing to do at run time.
* ``DnsDiscovery``: a headless service's A/AAAA records, re-resolved every
  ``interval_s`` off the event loop (``loop.getaddrinfo`` runs in a thread); each
  address is a pod. A resolver error keeps the last known set.
* ``KubernetesDiscovery``: the service's EndpointSlices, LISTed then WATCHed from
  the list's ``resourceVersion``; a ``410 Gone`` re-lists. An endpoint that is not
  ready, or terminating (draining), is out of the fleet.
* ``PodSelectorDiscovery``: the pods a label selector matches (an InferencePool's),
  LISTed then WATCHed through the pods API the same way; a Ready pod, not being
  deleted, is in the fleet at its podIP and the pool's port. No Service needed.

A pod that joins takes a slot (``FleetState.add_pod``: the slot it had if it was here
before and no other pod has taken it since, else a departed pod's, so slots stay
bounded as pods come and go) and starts with an empty index; a pod that leaves gets nothing new
(``FleetState.remove_pod``) and its index entries are dropped. Rendezvous placement
means a joining pod takes about 1/N of new prefixes from the others, and a leaving
pod's prefixes spread over the rest; no other key moves. Pods listed in
``fleet.yaml`` are never removed by discovery.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import aiohttp

from ace_extproc.config import Destination, DiscoveryConfig, Pod, canonical_host
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex

log = logging.getLogger("ace_extproc.discovery")

Resolver = Callable[[str, int], Awaitable[Iterable[str]]]
MAX_BACKOFF_S = 30.0
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; it is then resumed


def pod_id(ip: str) -> str:
    """A discovered pod's id: its IP with ``.`` and ``:`` replaced (``10-0-0-7``)."""
    return ip.replace(".", "-").replace(":", "-")


class Discovery:
    """Keeps one destination's discovered pods in the ``FleetState`` and the index.

    Subclasses find the pods and call ``sync`` with the full set they see now."""

    def __init__(self, fleet: FleetState, index: BlockIndex, destination_id: str) -> None:
        self.fleet = fleet
        self.index = index
        self.destination_id = destination_id
        dest = next((d for d in fleet.fleet.destinations if d.id == destination_id), None)
        if dest is None:
            raise ValueError(f"discovery: no destination {destination_id!r}")
        self._static = frozenset(p.key for p in dest.pods)
        self.tls = dest.tls  # its pods are reached as its base_url says
        self.slots: dict[str, int] = {}  # pod key -> slot, of the pods discovery added
        self._task: asyncio.Task[None] | None = None
        self.syncs = 0  # for tests and debugging
        # Set by the first sync: until then the pods are not known (gRPC readiness).
        self.synced = asyncio.Event()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(
                self.run(), name=f"ace-discovery-{self.destination_id}"
            )

    async def stop(self) -> None:
        """Cancel the discovery loop; safe to call twice or without ``start``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run(self) -> None:
        """The discovery loop (runs until cancelled)."""

    def sync(self, pods: Iterable[Pod]) -> None:
        """Make the discovered pods exactly ``pods``: add the new, remove the gone."""
        self.syncs += 1
        self.synced.set()
        want = {p.key: p for p in pods if p.key not in self._static}
        for key in [k for k in self.slots if k not in want]:
            slot = self.slots.pop(key)
            self.fleet.remove_pod(slot)
            self.index.drop_pod(slot)
            log.info("discovery: pod %s left (slot %d)", key, slot)
        for key, pod in want.items():
            if key in self.slots:
                continue
            slot = self.slots[key] = self.fleet.add_pod(pod)
            self.index.add_pod(slot)
            log.info("discovery: pod %s joined at %s (slot %d)", key, pod.address, slot)


class StaticDiscovery(Discovery):
    """The pods ``fleet.yaml`` lists: already in the ``FleetState``."""

    def __init__(self, fleet: FleetState, index: BlockIndex, destination_id: str) -> None:
        super().__init__(fleet, index, destination_id)
        self.synced.set()  # nothing to wait for


async def system_resolver(hostname: str, port: int) -> list[str]:
    """A and AAAA records through the system resolver, in a worker thread."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        hostname, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [str(info[4][0]) for info in infos]


class DnsDiscovery(Discovery):
    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        destination_id: str,
        hostname: str,
        port: int,
        interval_s: float = 5.0,
        resolver: Resolver | None = None,
    ) -> None:
        super().__init__(fleet, index, destination_id)
        self.hostname = hostname
        self.port = port
        self.interval_s = interval_s
        self.resolver: Resolver = resolver or system_resolver
        self._error = ""  # the last resolver error logged, so each is logged once

    async def refresh(self) -> None:
        """Resolve once and sync; on an error keep the pods as they are."""
        try:
            addrs = await asyncio.wait_for(
                self.resolver(self.hostname, self.port), timeout=max(self.interval_s, 1.0)
            )
            ips = sorted({canonical_host(a.split("%", 1)[0]) for a in addrs})  # no zone ids
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # gaierror, a timeout, a broken resolver
            why = f"{type(exc).__name__}: {exc}"
            if why != self._error:
                self._error = why
                log.warning(
                    "discovery: resolving %s failed (%s); keeping %d pods",
                    self.hostname,
                    why,
                    len(self.slots),
                )
            return
        if self._error:
            log.info("discovery: resolving %s works again", self.hostname)
            self._error = ""
        self.sync(Pod(self.destination_id, pod_id(ip), ip, self.port, tls=self.tls) for ip in ips)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class KubernetesDiscovery(Discovery):
    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        destination_id: str,
        api_url: str,
        namespace: str,
        service: str,
        port: int | None = None,
        port_name: str | None = None,
        token_path: str | None = None,
        ca_path: str | None = None,
        interval_s: float = 1.0,
    ) -> None:
        super().__init__(fleet, index, destination_id)
        if port is None and port_name is None:
            raise ValueError("kubernetes discovery needs a port or a port_name")
        self.api_url = api_url.rstrip("/")
        self.namespace = namespace
        self.service = service
        self.port = port
        self.port_name = port_name
        self.token_path = token_path
        self.ca_path = ca_path
        self.interval_s = interval_s
        self.resource_version: str | None = None
        self.slices: dict[str, list[Pod]] = {}  # EndpointSlice name -> its ready pods
        self.lists = 0  # LISTs done, for tests
        self._error = ""

    # ------------------------------------------------------------ endpoints

    @property
    def url(self) -> str:
        selector = quote(f"kubernetes.io/service-name={self.service}", safe="=")
        return (
            f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}"
            f"/endpointslices?labelSelector={selector}"
        )

    def pods_of(self, endpoint_slice: Mapping[str, Any]) -> list[Pod]:
        """The ready, not terminating endpoints of one EndpointSlice, as pods."""
        if endpoint_slice.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            return []  # FQDN: endpoint mode needs IP addresses
        port = self.port
        if self.port_name is not None:
            for p in endpoint_slice.get("ports") or ():
                if p.get("name") == self.port_name and isinstance(p.get("port"), int):
                    port = p["port"]
                    break
        if port is None:
            return []
        pods = []
        for ep in endpoint_slice.get("endpoints") or ():
            cond = ep.get("conditions") or {}
            # An unset "ready" means ready (the API's own reading).
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            for address in ep.get("addresses") or ():
                ip = canonical_host(str(address))
                pods.append(Pod(self.destination_id, pod_id(ip), ip, port, tls=self.tls))
        return pods

    def _apply(self) -> None:
        pods = [p for pods in self.slices.values() for p in pods]
        ports: dict[str, set[int]] = {}
        for pod in pods:
            ports.setdefault(pod.id, set()).add(pod.port)
        # Engines sharing one IP (host networking) differ only by port: name them by both,
        # or they would collapse into one pod and all but one would never be routed to.
        self.sync(
            replace(pod, id=f"{pod.id}-{pod.port}") if len(ports[pod.id]) > 1 else pod
            for pod in pods
        )

    def _set_slice(self, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        self.slices[name] = self.pods_of(obj)

    # ------------------------------------------------------------ the API

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_path and os.path.exists(self.token_path):
            try:
                with open(self.token_path) as f:  # re-read: the token rotates
                    token = f.read().strip()
            except OSError:
                token = ""
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.api_url.startswith("https:"):
            return None
        if self.ca_path and os.path.exists(self.ca_path):
            return ssl.create_default_context(cafile=self.ca_path)
        return ssl.create_default_context()

    async def list(self, session: aiohttp.ClientSession) -> None:
        """LIST the service's slices: the whole set, and the version to watch from."""
        async with session.get(
            self.url, headers=self._headers(), timeout=aiohttp.ClientTimeout(total=30)
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"LIST answered {resp.status}: {(await resp.text())[:200]}")
            doc = await resp.json(content_type=None)
        self.slices = {}
        for item in doc.get("items") or ():
            self._set_slice(item)
        self.resource_version = str((doc.get("metadata") or {}).get("resourceVersion", "")) or None
        self.lists += 1
        self._apply()

    async def watch(self, session: aiohttp.ClientSession) -> int:
        """WATCH from ``resource_version`` until the server ends the stream; returns
        how many events came. Raises ``_Gone`` when the version is too old."""
        url = (
            f"{self.url}&watch=1&allowWatchBookmarks=true&timeoutSeconds={WATCH_TIMEOUT_S}"
            f"&resourceVersion={quote(self.resource_version or '')}"
        )
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=WATCH_TIMEOUT_S + 60)
        events = 0
        async with session.get(url, headers=self._headers(), timeout=timeout) as resp:
            if resp.status == 410:
                raise _Gone
            if resp.status != 200:
                raise RuntimeError(f"WATCH answered {resp.status}: {(await resp.text())[:200]}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        events += 1
                        self._event(json.loads(line))
            if buf.strip():
                events += 1
                self._event(json.loads(buf))
        return events

    def _event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Gone
            raise RuntimeError(f"WATCH error {code}: {obj.get('message', '')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        if kind in ("ADDED", "MODIFIED"):
            self._set_slice(obj)
            self._apply()
        elif kind == "DELETED":
            self.slices.pop(str((obj.get("metadata") or {}).get("name", "")), None)
            self._apply()
        # BOOKMARK: only the version moves.

    async def run(self) -> None:
        delay = self.interval_s
        connector = aiohttp.TCPConnector(ssl=self._ssl() or False)
        async with aiohttp.ClientSession(connector=connector) as session:
            while True:
                began = time.monotonic()
                try:
                    if self.resource_version is None:
                        await self.list(session)
                    events = await self.watch(session)
                except _Gone:
                    log.info("discovery: %s watch expired (410); listing again", self.service)
                    self.resource_version = None
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the API unreachable, an answer not understood
                    self._complain(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF_S)
                    continue
                if self._error:
                    log.info("discovery: %s: the API answers again", self.service)
                    self._error = ""
                delay = self.interval_s
                if not events and time.monotonic() - began < 1.0:
                    await asyncio.sleep(delay)  # a watch ended at once: do not spin

    def _complain(self, why: str) -> None:
        if why != self._error:
            self._error = why
            log.warning(
                "discovery: %s of %s/%s: %s; keeping %d pods, retrying",
                self.kind,
                self.namespace,
                self.service,
                why,
                len(self.slots),
            )

    kind = "EndpointSlices"  # what is watched, for the logs


class PodSelectorDiscovery(KubernetesDiscovery):
    """The pods ``selector`` matches in ``namespace`` (an InferencePool's selector and
    target port), through the pods API: each object is one pod, in the fleet while it
    is Ready and not being deleted. The list and watch are ``KubernetesDiscovery``'s,
    keyed by object name as for EndpointSlices."""

    kind = "pods"

    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        destination_id: str,
        api_url: str,
        namespace: str,
        selector: Mapping[str, str],
        port: int,
        token_path: str | None = None,
        ca_path: str | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        super().__init__(
            fleet,
            index,
            destination_id,
            api_url,
            namespace,
            self.selector,  # named in the logs where a service would be
            port=port,
            token_path=token_path,
            ca_path=ca_path,
            interval_s=interval_s,
        )

    @property
    def url(self) -> str:
        selector = quote(self.selector, safe="=,")
        return f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}"

    def pods_of(self, obj: Mapping[str, Any]) -> list[Pod]:
        """The pod as a fleet pod, if it may take requests: Running, Ready, an IP, and
        not being deleted (terminating: draining)."""
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            return []
        status = obj.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not isinstance(ip, str) or not ip:
            return []
        conditions = status.get("conditions") or ()
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            return []
        ip = canonical_host(ip)
        assert self.port is not None  # required by the configuration
        return [Pod(self.destination_id, pod_id(ip), ip, self.port, tls=self.tls)]


def for_destination(fleet: FleetState, index: BlockIndex, dest: Destination) -> Discovery:
    """The discovery a destination's configuration asks for."""
    d: DiscoveryConfig | None = dest.discovery
    if d is None:
        return StaticDiscovery(fleet, index, dest.id)
    if d.type == "dns":
        assert d.port is not None  # parse_discovery requires it
        return DnsDiscovery(fleet, index, dest.id, d.hostname, d.port, d.interval_s)
    if d.type == "kubernetes-pods":
        assert d.port is not None  # required by the configuration
        return PodSelectorDiscovery(
            fleet,
            index,
            dest.id,
            d.api_url,
            d.namespace,
            dict(d.selector),
            d.port,
            token_path=d.token_path,
            ca_path=d.ca_path,
            interval_s=d.interval_s,
        )
    return KubernetesDiscovery(
        fleet,
        index,
        dest.id,
        d.api_url,
        d.namespace,
        d.service,
        port=d.port,
        port_name=d.port_name,
        token_path=d.token_path,
        ca_path=d.ca_path,
        interval_s=d.interval_s,
    )
