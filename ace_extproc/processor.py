"""What ace-extproc decides for one request, free of gRPC: the header phase settles
everything the headers can (mode, tenant, bypasses), the body phase parses, hashes,
picks and rewrites. ``server.py`` feeds it Envoy's messages; ``mutate.py`` turns
its ``Outcome`` into Envoy's mutations.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ace_extproc import request as req
from ace_extproc.config import Config, ConfigError, Mode, Pod
from ace_extproc.latency import get_model
from ace_extproc.prefix import cache_prefix_id, hash_prompt, scope_seed
from ace_extproc.routing import BlockIndex, FleetState, Picker, RoutingRequest, policies
from ace_extproc.routing.policies import PickerFactory
from ace_extproc.tenants import MissingKey, Tenants, UnknownKey

if TYPE_CHECKING:
    from ace_extproc.routing.discovery import Discovery
    from ace_extproc.routing.monitor import FleetMonitor

log = logging.getLogger("ace_extproc")

UPSTREAM_HEADER = "x-ace-upstream"
OVERRIDE_HEADER = "x-ace-skill-override"
SKILL = "prefix_kv_cache"


@dataclass(slots=True)
class Outcome:
    """The decision for one request, and everything Envoy must be told about it."""

    mode: Mode
    action: str
    prefix_key: str = "-"
    pod: Pod | None = None  # pinned only in prod
    would_pick: Pod | None = None  # the decision, in any mode
    saved_tokens: int = 0
    speedup: float = 1.0
    body: bytes | None = None  # the rewritten body (prod)
    reject_status: int = 0  # answer the client directly with this status
    reject_body: bytes = b""
    fallbacks: tuple[Pod, ...] = ()  # next-best pods for Envoy's retries (endpoint mode)
    endpoint: bool = False  # name pods by ip:port (router.upstream_mode: endpoint)

    @property
    def trace(self) -> str:
        return (
            f"mode={self.mode.value},action={self.action},prefix_key={self.prefix_key},"
            f"saved_prefill_tokens={self.saved_tokens},speedup={self.speedup:.2f}"
        )


@dataclass(slots=True)
class RequestContext:
    """What the header phase learned, kept for the body phase."""

    path: str
    mode: Mode
    tenant: str
    client_upstream: bool  # the client sent x-ace-upstream (Envoy should have stripped it)
    session: str | None = None  # x-session-id or x-user-id
    outcome: Outcome | None = None  # set when the headers alone decide


def _bypass(mode: Mode, reason: str) -> Outcome:
    return Outcome(mode, f"bypass_{reason}")


class Processor:
    def __init__(self, config: Config, picker: PickerFactory | None = None) -> None:
        """``picker`` overrides the policy the settings name (the benchmark's baselines)."""
        self.settings = config.settings
        self.fleet = FleetState(config.fleet)
        self.index = BlockIndex(config.settings.index_blocks_per_pod)
        factory = picker or policies.build(config.settings)
        self.picker: Picker = factory(self.fleet, self.index)
        self.tenants = Tenants(config.settings.tenants, config.settings.salt_secret)
        self.ttft = get_model(config.settings.ttft_model)
        # Set by server.start: keeps fleet.load and fleet.available fresh.
        self.monitor: FleetMonitor | None = None
        # Set by server.start: the loops that add and remove pods at run time.
        self.discoveries: list[Discovery] = []

    # ------------------------------------------------------------ header phase

    def on_headers(self, headers: Mapping[str, str], end_of_stream: bool) -> RequestContext:
        s = self.settings
        path = headers.get(":path", "").partition("?")[0]
        ctx = RequestContext(
            path,
            s.mode,
            s.tenants.anonymous,
            UPSTREAM_HEADER in headers,
            headers.get("x-session-id") or headers.get("x-user-id"),
        )
        if path not in req.ROUTABLE_PATHS:
            ctx.outcome = _bypass(s.mode, "unknown_path")
            return ctx
        if headers.get(":method") != "POST":
            ctx.outcome = _bypass(s.mode, "method")
            return ctx
        override = headers.get(OVERRIDE_HEADER)
        if override is not None and s.allow_mode_override:
            try:
                ctx.mode = _parse_override(override, s.mode)
            except _BadOverride as exc:
                ctx.outcome = _bypass(s.mode, exc.reason)
                return ctx
        if ctx.mode is Mode.OFF:
            ctx.outcome = Outcome(Mode.OFF, "off")
            return ctx
        try:
            ctx.tenant = self.tenants.resolve(
                headers.get("authorization"), headers.get(s.tenants.header or "")
            )
        except (UnknownKey, MissingKey) as exc:
            known = isinstance(exc, MissingKey)
            ctx.outcome = _auth_failure(ctx.mode, "missing_key" if known else "unknown_key")
            return ctx
        content_type = headers.get("content-type", "application/json").lower()
        if "json" not in content_type:
            ctx.outcome = _bypass(ctx.mode, "content_type")
        elif end_of_stream:
            ctx.outcome = _bypass(ctx.mode, "empty_body")
        elif _int(headers.get("content-length")) > s.max_body_bytes:
            ctx.outcome = _bypass(ctx.mode, "too_large")
        return ctx

    # -------------------------------------------------------------- body phase

    def on_body(self, ctx: RequestContext, body: bytes) -> Outcome:
        if ctx.outcome is not None:
            return ctx.outcome
        mode = ctx.mode
        if len(body) > self.settings.max_body_bytes:
            return _bypass(mode, "too_large")
        try:
            parsed = req.parse(ctx.path, body)
        except req.RequestError as exc:
            log.info("bypass: %s (%s)", exc.reason, exc)
            return _bypass(mode, exc.reason)
        destination = self.fleet.destination_for(parsed.model)
        if destination is None:
            return _bypass(mode, "unknown_model")
        s = self.settings
        hashes = hash_prompt(
            parsed.prompt, parsed.cacheable_end, s.block_bytes, scope_seed(ctx.tenant, parsed.model)
        )
        prompt_tokens = max(1, int(len(parsed.prompt) / s.bytes_per_token))
        routing = RoutingRequest(
            hashes, parsed.prompt, prompt_tokens, ctx.tenant, parsed.model, ctx.session
        )
        if self.monitor is not None:
            self.monitor.drain()
        pick = self.picker.pick(routing, self.fleet.candidates(destination))
        if pick is None:
            return _bypass(mode, "no_pod")
        saved = min(int(pick.matched_blocks * s.block_bytes / s.bytes_per_token), prompt_tokens - 1)
        if self.monitor is not None:
            # What this replica sent since the pods' last scrape. Prefill counts as
            # queued only behind an engine that reported a waiting queue: an engine with
            # room admits and chunks new prompts at once (the simulation keeps these
            # figures exact instead). The monitor drains and resets the estimate.
            load = self.fleet.load[pick.slot]
            load.inflight += 1
            if load.waiting:
                load.queued_prefill_tokens += prompt_tokens - saved
        outcome = Outcome(
            mode,
            pick.action,
            hashes.prefix_key,
            would_pick=pick.pod,
            saved_tokens=saved,
            speedup=self.ttft.speedup(prompt_tokens, saved),
        )
        if mode is Mode.PROD:
            outcome.pod = pick.pod
            outcome.endpoint = self.settings.upstream_mode == "endpoint"
            if pick.fallbacks:
                outcome.fallbacks = tuple(self.fleet.pods[slot] for slot in pick.fallbacks)
            fields = (
                f'"cache_prefix_id":"{cache_prefix_id(ctx.tenant, hashes.prefix_key)}",'
                f'"cache_salt":"{self.tenants.salt(ctx.tenant)}"'
            )
            outcome.body = rewrite_body(body, fields, parsed.has_router_fields)
        return outcome


def rewrite_body(body: bytes, fields: str, strip_client_fields: bool) -> bytes:
    """The body with the router's fields (a JSON object fragment, no braces) added.

    The common case splices them in after the opening brace, leaving the client's
    bytes as they were; only a body carrying its own ``cache_salt`` or
    ``cache_prefix_id`` is decoded and re-encoded, so the client's values are gone
    rather than shadowed by a duplicate key.
    """
    if strip_client_fields:
        obj = msgspec.json.decode(body)
        for name in req.ROUTER_FIELDS:
            obj.pop(name, None)
        body = msgspec.json.encode(obj)
    start = body.index(b"{") + 1
    first = start
    while body[first : first + 1] in _JSON_SPACE:
        first += 1
    sep = b"" if body[first : first + 1] == b"}" else b","
    # One copy of the client's bytes (join reads the memoryview in place).
    return b"".join((body[:start], fields.encode(), sep, memoryview(body)[start:]))


_JSON_SPACE = (b" ", b"\t", b"\r", b"\n")


class _BadOverride(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_override(value: str, default: Mode) -> Mode:
    """``prefix_kv_cache=<mode>`` (other skills' entries, comma-separated, are ignored)."""
    mode = default
    for item in value.split(","):
        if not item.strip():
            continue
        skill, sep, setting = item.partition("=")
        if not sep or not skill.strip():
            raise _BadOverride("bad_override")
        if skill.strip() == SKILL:
            try:
                mode = Mode.parse(setting)
            except ConfigError:
                raise _BadOverride("unknown_mode") from None
    return mode


def _auth_failure(mode: Mode, reason: str) -> Outcome:
    # In shadow the router must not change what happens to a request: report only.
    if mode is not Mode.PROD:
        return _bypass(mode, reason)
    message = "missing API key" if reason == "missing_key" else "invalid API key"
    body = msgspec.json.encode(
        {"error": {"message": message, "type": "authentication_error", "code": 401}}
    )
    return Outcome(mode, f"reject_{reason}", reject_status=401, reject_body=body)


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
