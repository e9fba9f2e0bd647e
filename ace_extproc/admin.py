"""The admin gRPC API (``protos/ace/admin/v1/admin.proto``): list pods with their state,
load and index size, look up where a prefix was sent, drain or undrain a pod, read the
active configuration. ``ace-extproc ctl`` is its client.

It runs as its own ``grpc.aio`` server on ``router.admin_listen`` (default
127.0.0.1:9091, ``unix:/path``, or ``off``), on the ext_proc server's event loop but
never on its port, and it is off the request path: each call reads the state the
router keeps (``FleetState``, ``BlockIndex``, the monitor's figures) or flips one
bit of it (a drain). A failure to bind it is logged and costs only the admin API.

Each process answers for itself: replicas, and ``serve --workers`` workers, keep
their own fleet state and index, so a drain is per process (``serve --workers N``
turns the API off rather than let one worker answer for all).
"""

from __future__ import annotations

import logging
import re
import weakref
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
import yaml

from ace_extproc import __version__
from ace_extproc.config import Config, Settings, fleet_to_dict
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.placements import PrefixPlacements
from ace_extproc.routing.replicas import redacted_url

try:
    from ace_extproc._proto.ace.admin.v1 import admin_pb2 as pb
    from ace_extproc._proto.ace.admin.v1 import admin_pb2_grpc as pb_grpc
except ImportError as exc:  # pragma: no cover - a checkout that was never built
    raise ImportError(
        "ace_extproc._proto is generated at build time from protos/: "
        "reinstall the package (pip install -e .) to compile it"
    ) from exc

if TYPE_CHECKING:
    from ace_extproc.app import App

__all__ = [
    "AdminServer",
    "AdminServicer",
    "PrefixPlacements",
    "parse_prefix_ref",
    "pb",
    "pb_grpc",
    "serve_admin",
]

log = logging.getLogger("ace_extproc.admin")

_PREFIX_KEY = re.compile(r"[0-9a-fA-F]{16}")
_CACHE_PREFIX_ID = re.compile(
    r"ace-kv-(?P<tenant>[A-Za-z0-9][A-Za-z0-9_.-]*)-(?P<key>[0-9a-fA-F]{16})"
)


def parse_prefix_ref(ref: str) -> tuple[str, str]:
    """``(tenant, prefix_key)`` from a prefix key (16 hex) or a cache_prefix_id
    (``ace-kv-{tenant}-{prefix_key}``); tenant is "" for a bare key. ValueError else."""
    ref = ref.strip()
    if _PREFIX_KEY.fullmatch(ref):
        return "", ref.lower()
    m = _CACHE_PREFIX_ID.fullmatch(ref)
    if m:
        return m["tenant"], m["key"].lower()
    raise ValueError(
        f"{ref!r} is neither a prefix key (16 hex digits) nor a cache_prefix_id "
        "(ace-kv-<tenant>-<16 hex digits>)"
    )


# ------------------------------------------------------------------ servicer


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AdminServicer(pb_grpc.AdminServicer):
    """Reads and flips the state of one process (``app.App``); runs on its event loop,
    so every call sees the state between two requests, never in the middle of one."""

    def __init__(self, app: App, admin_listen: str = "") -> None:
        self.app = app
        self.admin_listen = admin_listen
        self.drains = app.drains  # where drains are kept across restarts, if anywhere

    # ---------------------------------------------------------------- calls

    async def ListPods(self, request: pb.ListPodsRequest, context: Any) -> pb.ListPodsResponse:
        fleet = self.app.fleet
        pods = [
            self._pod(slot)
            for slot in range(len(fleet.pods))
            if request.include_removed or fleet.is_member(slot)
        ]
        return pb.ListPodsResponse(pods=pods)

    async def LookupPrefix(
        self, request: pb.LookupPrefixRequest, context: Any
    ) -> pb.LookupPrefixResponse:
        try:
            tenant, key = parse_prefix_ref(request.key)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raises; this is for readers and type checkers
        placements = self.app.placements
        out = pb.LookupPrefixResponse(prefix_key=key, tenant=tenant)
        out.recording = True
        out.capacity = placements.capacity
        seen = placements.get(key)
        if seen is None:
            return out
        mask, picks, last, age = seen
        out.found = True
        out.picks = picks
        out.last_pick_age_s = age
        for slot in _slots(mask):
            out.placements.append(pb.Placement(pod=self._pod(slot), last=slot == last))
        return out

    async def DrainPod(self, request: pb.DrainPodRequest, context: Any) -> pb.DrainPodResponse:
        slot = await self._resolve(request.pod, context)
        changed = self.app.fleet.drain(slot)
        if changed:
            log.info("admin: pod %s drained", self.app.fleet.pods[slot].key)
            if self.drains is not None:
                await self.drains.save()
        return pb.DrainPodResponse(
            pod=self._pod(slot),
            changed=changed,
            destination_available=self._destination_available(slot),
        )

    async def UndrainPod(
        self, request: pb.UndrainPodRequest, context: Any
    ) -> pb.UndrainPodResponse:
        slot = await self._resolve(request.pod, context)
        changed = self.app.fleet.undrain(slot)
        if changed:
            log.info("admin: pod %s undrained", self.app.fleet.pods[slot].key)
            if self.drains is not None:
                await self.drains.save()
        return pb.UndrainPodResponse(
            pod=self._pod(slot),
            changed=changed,
            destination_available=self._destination_available(slot),
        )

    async def GetConfig(self, request: pb.GetConfigRequest, context: Any) -> pb.GetConfigResponse:
        s = self.app.config.settings
        doc = config_document(Config(self.app.fleet.fleet, s))
        return pb.GetConfigResponse(
            version=__version__,
            mode=s.mode.value,
            yaml=yaml.safe_dump(doc, sort_keys=False),
            admin_listen=self.admin_listen or s.admin_listen,
        )

    # -------------------------------------------------------------- helpers

    def _pod(self, slot: int) -> pb.Pod:
        app = self.app
        fleet = app.fleet
        pod = fleet.pods[slot]
        load = fleet.load[slot]
        monitor = app.monitor
        s = app.config.settings
        return pb.Pod(
            key=pod.key,
            destination=pod.destination,
            id=pod.id,
            address=pod.address,
            cluster=pod.cluster,
            slot=slot,
            state=_state(fleet, slot),
            healthy=fleet.is_healthy(slot),
            drained=fleet.is_drained(slot),
            available=fleet.is_available(slot),
            ejected=fleet.is_ejected(slot),
            watched=monitor is not None and slot in monitor.watched,
            load=pb.PodLoad(
                inflight=max(0, load.inflight),
                running=max(0, load.running),
                waiting=max(0, load.waiting),
                kv_usage=load.kv_usage,
                queued_prefill_ms=max(0.0, load.queued_prefill_ms),
            ),
            index=pb.PodIndex(
                blocks_held=app.index.blocks_held(slot),
                capacity_blocks=app.index.capacity_of(slot),
                kv_capacity_tokens=fleet.capacity_tokens[slot] or 0,
                block_bytes=s.block_bytes,
            ),
        )

    async def _resolve(self, ref: str, context: Any) -> int:
        try:
            return resolve_pod(self.app.fleet, ref)
        except _Refused as exc:
            await context.abort(exc.code, str(exc))
            raise  # abort raises; this is for readers and type checkers

    def _destination_available(self, slot: int) -> int:
        fleet = self.app.fleet
        name = fleet.pods[slot].destination
        for dest in fleet.fleet.destinations:
            if dest.id == name:
                return fleet.candidates(dest).bit_count()
        return 0


def resolve_pod(fleet: FleetState, ref: str) -> int:
    """The slot of the pod ``ref`` names: ``destination/pod``, or a pod id or
    ``host:port`` that only one pod has (pods in the fleet win over pods that left)."""
    ref = ref.strip()
    if not ref:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "no pod given")
    slot = fleet.slot_of(ref)
    if slot is not None:
        return slot
    matches = [s for s, pod in enumerate(fleet.pods) if ref in (pod.id, pod.address)]
    if len(matches) > 1:
        members = [s for s in matches if fleet.is_member(s)]
        matches = members or matches
    if not matches:
        raise _Refused(grpc.StatusCode.NOT_FOUND, f"no pod {ref!r} (see `ace-extproc ctl pods`)")
    if len(matches) > 1:
        names = ", ".join(fleet.pods[s].key for s in matches)
        raise _Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{ref!r} names several pods ({names}): use destination/pod",
        )
    return matches[0]


def _state(fleet: FleetState, slot: int) -> pb.PodState:
    if not fleet.is_member(slot):
        return pb.POD_STATE_REMOVED
    if fleet.is_drained(slot):
        return pb.POD_STATE_DRAINING
    if not fleet.is_healthy(slot):
        return pb.POD_STATE_DOWN
    return pb.POD_STATE_HEALTHY


def _slots(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def config_document(config: Config) -> dict[str, Any]:
    """The configuration in ``fleet.yaml`` form (``config.load`` reads it back), less the
    salt secret and the share URL's password (``****``); API keys appear only as
    ``sha256:`` digests, as the file may hold them."""
    s = config.settings
    router: dict[str, Any] = {"mode": s.mode.value}
    for name in Settings.__struct_fields__:
        if name in ("mode", "tenants", "salt_secret", "salt_secret_generated", "share_password"):
            continue
        value = getattr(s, name)
        if name == "share_url":
            value = redacted_url(value)
        elif isinstance(value, msgspec.Struct):  # passive_health, ext_proc_tls, pipeline
            value = {k: v for k, v in msgspec.to_builtins(value).items() if v is not None}
        elif isinstance(value, tuple):
            value = list(value)  # allow_mode_override's tenants
        if value is not None:
            router[name] = value
    t = s.tenants
    tenants: dict[str, Any] = {"anonymous": t.anonymous, "require_key": t.require_key}
    if t.header:
        tenants["header"] = t.header
    if t.key_digests:
        tenants["api_keys"] = {f"sha256:{d.hex()}": name for d, name in t.key_digests.items()}
    router["tenants"] = tenants
    return {**fleet_to_dict(config.fleet), "router": router}


# -------------------------------------------------------------------- serving


class AdminServer:
    """A running admin API: its own ``grpc.aio`` server."""

    def __init__(self, server: Any, address: str) -> None:
        self.server = server
        self.address = address  # what it listens on (the bound port, for port 0)

    async def stop(self, grace: float | None = 0) -> None:
        """Stop taking calls (those in flight get ``grace`` seconds). Safe twice."""
        server, self.server = self.server, None
        if server is not None:
            await server.stop(grace)
            log.info("admin API on %s stopped", self.address)

    def follow(self, ext_proc: Any) -> None:
        """Stop with the ext_proc server ``ext_proc``: its ``stop`` stops this too,
        once its own grace period is over (so the API answers while streams in flight
        finish). Inside that ``stop``, not in a task woken by it: a grpc.aio server
        stopped while its event loop is closing leaves gRPC threads behind, and gRPC's
        fork handlers then break every child process forked later. This object lives
        as long as the ext_proc server, which holds it; nothing here holds that server
        (a reference cycle would keep it, and gRPC, alive until a garbage collection
        long after its event loop has closed: the same broken fork handlers)."""
        stop_ext_proc = type(ext_proc).stop
        ref = weakref.ref(ext_proc)

        async def stop(grace: float | None) -> None:
            try:
                if (server := ref()) is not None:
                    await stop_ext_proc(server, grace)
            finally:
                await self.stop()

        ext_proc.stop = stop


async def serve_admin(app: App, follow: Any = None) -> AdminServer | None:
    """Start the admin API on ``admin_listen`` for ``app``, or
    nothing when it is ``off``. With ``follow`` (the ext_proc ``grpc.aio.Server``),
    stopping that server stops it too. A failure to listen is logged, not raised: the
    admin API must never cost the data path."""
    address = app.config.settings.admin_listen
    if address == "off":
        return None
    # No SO_REUSEPORT: a second process on the same port must fail, not share it and
    # answer for a random process's fleet.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = AdminServicer(app, address)
    pb_grpc.add_AdminServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises on a bind failure
        log.warning("admin API: cannot listen on %s (%s); running without it", address, exc)
        return None
    if not port:
        log.warning("admin API: cannot listen on %s; running without it", address)
        return None
    if not address.startswith("unix:") and address.endswith(":0"):
        address = f"{address[:-2]}:{port}"
        servicer.admin_listen = address
    await server.start()
    log.info("admin API on %s", address)
    admin = AdminServer(server, address)
    if follow is not None:
        admin.follow(follow)
    return admin
