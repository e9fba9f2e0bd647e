"""What ace-extproc decides for one request, free of gRPC: the header phase settles
everything the headers can (mode, tenant, bypasses), the body phase parses, hashes,
picks and rewrites. ``server.py`` feeds it Envoy's messages; ``mutate.py`` turns
its ``Outcome`` into Envoy's mutations.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING

import msgspec
import xxhash

from ace_extproc import execute
from ace_extproc import request as req
from ace_extproc.config import Config, ConfigError, Destination, Mode, Pod, ttft_models
from ace_extproc.observe import Observer
from ace_extproc.prefix import PrefixHashes, cache_prefix_id, hash_prompt, scope_seed
from ace_extproc.routing import BlockIndex, FleetState, Picker, RoutingRequest, policies
from ace_extproc.routing.fleet import ADDED, RETIRED
from ace_extproc.routing.placements import PrefixPlacements
from ace_extproc.routing.policies import PickerFactory
from ace_extproc.speedups import native
from ace_extproc.telemetry import Telemetry
from ace_extproc.tenants import MissingKey, Tenants, UnknownKey

if TYPE_CHECKING:
    from ace_extproc.routing.discovery import Discovery
    from ace_extproc.routing.monitor import FleetMonitor
    from ace_extproc.routing.replicas import PlacementSink

log = logging.getLogger("ace_extproc")

UPSTREAM_HEADER = "x-ace-upstream"
OVERRIDE_HEADER = "x-ace-skill-override"
SKILL = "prefix_kv_cache"

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(slots=True)
class Outcome:
    """The decision for one request, and everything Envoy must be told about it."""

    mode: Mode
    action: str
    prefix_key: str = "-"
    pod: Pod | None = None  # pinned only in prod
    would_pick: Pod | None = None  # the decision, in any mode
    saved_tokens: int = 0
    speedup: float = 1.0  # estimated: cold TTFT over warm (calibrated TTFT model)
    saved_ms: float = 0.0  # estimated: cold TTFT less warm, for the metrics
    body: bytes | None = None  # the rewritten body (prod)
    reject_status: int = 0  # answer the client directly with this status
    reject_body: bytes = b""
    fallbacks: tuple[Pod, ...] = ()  # next-best pods for Envoy's retries (endpoint mode)
    endpoint: bool = False  # name pods by ip:port (router.upstream_mode: endpoint)
    path: str | None = None  # a new :path (the native API's request becomes a chat)
    slot: int = -1  # the picked pod's slot (any mode), for the metrics
    prompt_tokens: int = 0  # estimated from the canonical prompt
    # The pinned destination's own ``authorization`` (its api_key_env), for the client's.
    upstream_auth: bytes | None = None
    # For the metrics: the routed steps' times (parse, hash, pick, rewrite; ns).
    steps_ns: tuple[int, int, int, int] | None = None

    @property
    def trace(self) -> str:
        return (
            f"mode={self.mode},action={self.action},prefix_key={self.prefix_key},"
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
    execute: bool = False  # the native API (execute.py): its response is enveloped


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
        # Each destination's TTFT model, for the estimate the trace and metrics report.
        self.ttft = ttft_models(config.fleet, config.settings)
        # Set by server.start: keeps fleet.load and fleet.available fresh.
        self.monitor: FleetMonitor | None = None
        # What became of the requests (the observe-only filter's reports).
        self.observer = Observer(self.fleet)
        # Decisions and step times, read by the metrics endpoint (telemetry.py).
        self.telemetry = Telemetry(config.settings, self.fleet, self.index, lambda: self.monitor)
        self.telemetry.ledger = self.observer.ledger
        # Where each recent prefix was sent: the admin API's LookupPrefix.
        self.placements: PrefixPlacements | None = PrefixPlacements()
        # Set by server.start: the loops that add and remove pods at run time.
        self.discoveries: list[Discovery] = []
        # Set by server.start when router.share_url is: this replica's placements go to
        # the other replicas, and theirs come into this one's index and load view.
        self.sharing: PlacementSink | None = None
        self.telemetry.sharing = lambda: self.sharing
        self.fleet.on_change.append(self._fleet_changed)
        # A destination's configured KV size bounds its pods' index until they report one.
        tokens_per_block = config.settings.block_bytes / config.settings.bytes_per_token
        self._configured_blocks = {
            d.id: max(1, int(d.kv_capacity_tokens / tokens_per_block))
            for d in config.fleet.destinations
            if d.kv_capacity_tokens
        }
        for slot in range(len(self.fleet.pods)):
            self._bound_index(slot)
        self._endpoint = config.settings.upstream_mode == "endpoint"
        # Each destination's own key, as the header it goes in (made once, not per request).
        self._upstream_auth = {
            d.id: f"Bearer {d.api_key}".encode() for d in config.fleet.destinations if d.api_key
        }

    def _bound_index(self, slot: int) -> None:
        """Size the slot's index from its destination's configured KV size, unless its
        engine already reported one."""
        if self.fleet.capacity_tokens[slot] is None:
            blocks = self._configured_blocks.get(self.fleet.pods[slot].destination)
            if blocks is not None:
                self.index.set_capacity(slot, blocks)

    def _fleet_changed(self, slot: int, change: str) -> None:
        if change == ADDED:
            self._bound_index(slot)
        if change == RETIRED:  # another pod takes the slot: forget the one that left
            self.index.retire_pod(slot)
            self.telemetry.retire_slot(slot)
            self.observer.ledger.by_pod.pop(self.fleet.pods[slot].key, None)
            if self.placements is not None:
                self.placements.forget_slot(slot)

    # ------------------------------------------------------------ header phase

    def on_headers(self, headers: Mapping[str, str], end_of_stream: bool) -> RequestContext:
        ctx = self._headers(headers, end_of_stream)
        outcome = ctx.outcome
        # Decided here: counted now, unless a native-API body still follows.
        if outcome is not None and (not ctx.execute or outcome.reject_status):
            self._count(ctx, outcome, 0)
        return ctx

    def _headers(self, headers: Mapping[str, str], end_of_stream: bool) -> RequestContext:
        s = self.settings
        path = headers.get(":path", "").partition("?")[0]
        ctx = RequestContext(
            path,
            s.mode,
            s.tenants.anonymous,
            UPSTREAM_HEADER in headers,
            headers.get("x-session-id") or headers.get("x-user-id"),
        )
        if path == execute.PATH:
            ctx.execute = True
            if end_of_stream:  # the envelope is the request: without one, a 400 now
                error = execute.EnvelopeError("body", "expected the /v1/execute envelope")
                ctx.outcome = _invalid_envelope(s.mode, error)
                return ctx
        elif path not in req.ROUTABLE_PATHS:
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
        if ctx.mode is Mode.OFF and not ctx.execute:  # an envelope may still turn it on
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
        if ctx.outcome is not None and not ctx.execute:
            return ctx.outcome  # decided, and counted, by the headers
        start = perf_counter_ns()
        outcome = self._execute(ctx, body) if ctx.execute else self._route(ctx, body)
        self._count(ctx, outcome, perf_counter_ns() - start)
        return outcome

    def _count(self, ctx: RequestContext, outcome: Outcome, latency_ns: int) -> None:
        self.telemetry.decision(
            outcome.mode,  # a StrEnum, so the str itself
            outcome.action,
            ctx.tenant,
            outcome.slot,
            outcome.prompt_tokens,
            outcome.saved_tokens,
            outcome.saved_ms,
            latency_ns,
            outcome.steps_ns,
        )

    def _execute(self, ctx: RequestContext, body: bytes) -> Outcome:
        """The native API: the envelope becomes a chat completion, routed like one,
        and goes to the engine's chat path in every mode (it cannot serve the
        envelope). A bypass the headers decided still takes effect."""
        if ctx.outcome is not None and ctx.outcome.reject_status:
            return ctx.outcome
        try:
            chat, mode = execute.to_chat(body)
        except execute.EnvelopeError as exc:
            return _invalid_envelope(ctx.mode, exc)
        if mode is not None and self.settings.allow_mode_override and ctx.outcome is None:
            ctx.mode = mode
        ctx.path = req.CHAT_PATH
        if ctx.outcome is not None:
            outcome = ctx.outcome
        elif ctx.mode is Mode.OFF:
            outcome = Outcome(Mode.OFF, "off")
        else:
            outcome = self._route(ctx, chat)
        outcome.path = req.CHAT_PATH
        if outcome.body is None and not outcome.reject_status:
            outcome.body = chat
        return outcome

    def _route(self, ctx: RequestContext, body: bytes) -> Outcome:
        if ctx.outcome is not None:
            return ctx.outcome
        mode = ctx.mode
        if len(body) > self.settings.max_body_bytes:
            return _bypass(mode, "too_large")
        started = perf_counter_ns()
        try:
            parsed = req.parse(ctx.path, body)
        except req.RequestError as exc:
            log.debug("bypass: %s (%s)", exc.reason, exc)  # counted, and logged, as anomaly
            return _bypass(mode, exc.reason)
        destination = self.fleet.destination_for(parsed.model)
        if destination is None:
            return _bypass(mode, "unknown_model")
        s = self.settings
        parsed_at = perf_counter_ns()
        hashes = hash_prompt(
            parsed.prompt, parsed.cacheable_end, s.block_bytes, scope_seed(ctx.tenant, parsed.model)
        )
        hashed_at = perf_counter_ns()
        prompt_tokens = max(1, int(len(parsed.prompt) / s.bytes_per_token))
        routing = RoutingRequest(
            hashes, parsed.prompt, prompt_tokens, ctx.tenant, parsed.model, ctx.session
        )
        if self.monitor is not None:
            self.monitor.drain()
        pick = self.picker.pick(routing, self.fleet.candidates(destination))
        if pick is None:
            return _bypass(mode, "no_pod")
        if self.placements is not None:
            self.placements.note(hashes.prefix_key, pick.slot)
        saved = min(int(pick.matched_blocks * s.block_bytes / s.bytes_per_token), prompt_tokens - 1)
        if self.monitor is not None:
            # What this replica sent since the pods' last scrape, and the prefill it
            # adds ahead of the next request there: an engine prefills its running
            # requests' prompts in turn (vLLM's chunked prefill shares each step's token
            # budget among them), so a new one waits behind them whether or not the
            # engine reports a waiting queue (the simulation keeps these figures exact).
            # The monitor drains the estimate, and drops it when the engine is idle.
            load = self.fleet.load[pick.slot]
            load.inflight += 1
            load.queued_prefill_tokens += prompt_tokens - saved
        if self.sharing is not None:  # queued for the other replicas; no I/O here
            self.sharing.note(
                pick.pod.key, hashes.blocks, ctx.tenant, ctx.session, prompt_tokens - saved
            )
        # The estimate the trace header and the metrics report, computed once.
        speedup, saved_ms = self.ttft[destination.id].gain(prompt_tokens, saved)
        outcome = Outcome(
            mode,
            pick.action,
            hashes.prefix_key,
            would_pick=pick.pod,
            saved_tokens=saved,
            speedup=speedup,
            saved_ms=saved_ms,
            slot=pick.slot,
            prompt_tokens=prompt_tokens,
        )
        picked_at = perf_counter_ns()
        rewrite_ns = 0
        if mode is Mode.PROD:
            outcome.pod = pick.pod
            outcome.upstream_auth = self._upstream_auth.get(destination.id)
            outcome.endpoint = self._endpoint
            if pick.fallbacks:
                pods = self.fleet.pods
                outcome.fallbacks = tuple([pods[slot] for slot in pick.fallbacks])
            fields = self._body_fields(destination, ctx, hashes, parsed, body)
            if fields:
                strip = parsed.has_router_fields and not destination.hosted
                outcome.body = rewrite_body(body, fields, strip)
            rewrite_ns = perf_counter_ns() - picked_at
        outcome.steps_ns = (
            parsed_at - started,
            hashed_at - parsed_at,
            picked_at - hashed_at,
            rewrite_ns,
        )
        return outcome

    def _body_fields(
        self,
        destination: Destination,
        ctx: RequestContext,
        hashes: PrefixHashes,
        parsed: req.ParsedRequest,
        body: bytes,
    ) -> str:
        """The fields (a JSON object fragment) the body gets on its way to ``destination``:
        the engine's cache fields, or for a hosted API, which may refuse those as
        unknown, the key it caches by; and the usage chunk a stream should end with."""
        if destination.hosted:
            fields = _prompt_cache_key(body, hashes, ctx.session)
        else:
            fields = (
                f'"cache_prefix_id":"{cache_prefix_id(ctx.tenant, hashes.prefix_key)}",'
                f'"cache_salt":"{self.tenants.salt(ctx.tenant)}"'
            )
        if parsed.stream and self.settings.usage_capture and not parsed.stream_options:
            # The engine then ends the stream with a usage chunk the observe filter
            # reads; a client's own stream_options is left as it chose.
            fields += ("," if fields else "") + '"stream_options":{"include_usage":true}'
        return fields


def _prompt_cache_key(body: bytes, hashes: PrefixHashes, session: str | None) -> str:
    """For a hosted API, the field that asks it to keep requests sharing a prefix on
    one cache (OpenAI's and Mistral's ``prompt_cache_key``): the session's if the
    request has one, else its first block's, either scoped by tenant and model (the
    hashes' seed). A client's own key is left as it is (no field added)."""
    if b'"prompt_cache_key"' in body:
        return ""
    key = _xxh3(session.encode(), hashes.seed) if session else hashes.route_key
    return f'"prompt_cache_key":"ace-{key:016x}"'


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
    return splice(body, fields)


def splice_pure(body: bytes, fields: str) -> bytes:
    """``fields`` inserted after the body's opening brace (``splice`` in Python alone)."""
    start = body.index(b"{") + 1
    first = start
    while body[first : first + 1] in _JSON_SPACE:
        first += 1
    sep = b"" if body[first : first + 1] == b"}" else b","
    # One copy of the client's bytes (join reads the memoryview in place).
    return b"".join((body[:start], fields.encode(), sep, memoryview(body)[start:]))


_JSON_SPACE = (b" ", b"\t", b"\r", b"\n")
# One C call, the body copied once, where the extension was built (speedups.py).
splice = native.splice if native is not None else splice_pure


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


def _invalid_envelope(mode: Mode, error: execute.EnvelopeError) -> Outcome:
    # Even in shadow: no engine can serve an envelope it cannot read.
    return Outcome(mode, "reject_invalid_envelope", reject_status=400, reject_body=error.body())


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
