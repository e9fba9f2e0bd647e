"""Access control and tenant isolation in the decision itself: the key is checked
before anything else a request says, overrides need a tenant allowed them, and where
tenants are configured every request that goes on to an engine carries its tenant's
salt and none of the client's cache fields, routed or not. The same through the real
Envoy: tests/test_adversarial.py."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import msgspec
import pytest

from ace_extproc import request as req
from ace_extproc.config import (
    Config,
    ConfigError,
    Destination,
    Mode,
    Settings,
    TenantConfig,
    parse_settings,
    sim_fleet,
)
from ace_extproc.processor import Outcome, Processor
from ace_extproc.tenants import Tenants
from tests.conftest import make_processor

CHAT = "/v1/chat/completions"
KEYS = {hashlib.sha256(b"key-a").digest(): "acme", hashlib.sha256(b"key-b").digest(): "globex"}
SALTS = Tenants(TenantConfig(), b"secret")


def make(mode: Mode = Mode.PROD, fleet: Any = None, **settings: Any) -> Processor:
    fleet = fleet or sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)])
    settings.setdefault("tenants", TenantConfig(key_digests=KEYS))
    return make_processor(Config(fleet, Settings(mode=mode, salt_secret=b"secret", **settings)))


def headers(path: str = CHAT, method: str = "POST", **extra: str) -> dict[str, str]:
    h = {":path": path, ":method": method, "content-type": "application/json"}
    h.update({k.replace("_", "-"): v for k, v in extra.items()})
    return h


def chat(**extra: Any) -> bytes:
    messages = [{"role": "system", "content": "Be brief. " * 80}, {"role": "user", "content": "hi"}]
    return msgspec.json.encode({"model": "sim-llama", "messages": messages, **extra})


def run(p: Processor, h: dict[str, str], body: bytes, eos: bool = False) -> Outcome:
    return p.on_body(p.on_headers(h, eos), body)


def sent(outcome: Outcome) -> dict[str, Any]:
    assert outcome.body is not None, outcome.action
    decoded: dict[str, Any] = msgspec.json.decode(outcome.body)
    return decoded


# ------------------------------------------------------------------ the key comes first


@pytest.mark.parametrize(
    "h",
    [
        headers(x_ace_skill_override="prefix_kv_cache=off"),
        headers(x_ace_skill_override="prefix_kv_cache=shadow"),
        headers(x_ace_skill_override="garbage"),
        headers(path="/v1/%63hat/completions"),
        headers(path="//v1//chat/./completions"),
        headers(path="/v1/models", method="GET"),
        headers(content_type="text/plain"),
        headers(content_length="999999999"),
        headers(x_tenant="acme"),
    ],
    ids=["off", "shadow", "bad-override", "escaped", "slashes", "models", "text", "huge", "hdr"],
)
@pytest.mark.parametrize("mode", list(Mode))
def test_an_unknown_key_is_refused_whatever_else_the_request_says(
    h: dict[str, str], mode: Mode
) -> None:
    p = make(mode, tenants=TenantConfig(key_digests=KEYS, header="x-tenant"))
    ctx = p.on_headers({**h, "authorization": "Bearer stolen"}, False)
    assert ctx.outcome is not None
    assert (ctx.outcome.reject_status, ctx.outcome.action) == (401, "reject_unknown_key")


def test_a_missing_key_is_refused_on_every_path_when_required() -> None:
    p = make(tenants=TenantConfig(key_digests=KEYS, require_key=True))
    for h in (headers(path="/v1/models", method="GET"), headers(path="/metrics", method="GET")):
        ctx = p.on_headers(h, True)
        assert ctx.outcome is not None and ctx.outcome.reject_status == 401
    # A known key passes, and an unknown path then goes on as before.
    ctx = p.on_headers(headers(path="/v1/models", method="GET", authorization="Bearer key-a"), True)
    assert ctx.outcome is not None and ctx.outcome.action == "bypass_unknown_path"


def test_the_trusted_header_names_a_tenant_only_without_a_key() -> None:
    p = make(tenants=TenantConfig(key_digests=KEYS, header="x-tenant"))
    keyed = run(p, headers(authorization="Bearer key-a", x_tenant="globex"), chat())
    assert sent(keyed)["cache_salt"] == SALTS.salt("acme")
    vouched = run(p, headers(x_tenant="globex"), chat())
    assert sent(vouched)["cache_salt"] == SALTS.salt("globex")


def test_an_escaped_path_is_the_path_the_engine_serves() -> None:
    p = make()
    for path in ("/v1/%63hat/completions", "//v1//chat/completions", "/v1%2Fchat%2Fcompletions"):
        out = run(p, headers(path=path, authorization="Bearer key-a"), chat())
        assert out.pod is not None and sent(out)["cache_salt"] == SALTS.salt("acme"), path


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ("/v1/chat/completions?stream=1", CHAT),
        ("/v1/%63hat/completions", CHAT),
        ("/v1/chat%2Fcompletions", CHAT),
        ("/v1/chat%2fcompletions", CHAT),
        ("///v1//chat/completions", CHAT),
        ("/v1/x/../chat/./completions", CHAT),
        ("/%2e%2e/v1/chat/completions", CHAT),
        ("/v1/chat/completions/", CHAT + "/"),
        ("/v1/models", "/v1/models"),
        ("/", "/"),
    ],
)
def test_canonical_path(raw: str, path: str) -> None:
    assert req.canonical_path(raw) == path


# ------------------------------------------------------------------ overrides


def test_overrides_need_a_tenant_allowed_them() -> None:
    off = headers(x_ace_skill_override="prefix_kv_cache=off")
    # Tenants configured: the anonymous tenant may not, an authenticated one may.
    p = make()
    assert run(p, off, chat()).action == "miss"
    assert run(p, {**off, "authorization": "Bearer key-a"}, chat()).action == "off"
    # A list names who may.
    listed = make(allow_mode_override=("globex",))
    assert run(listed, {**off, "authorization": "Bearer key-a"}, chat()).pod is not None
    assert run(listed, {**off, "authorization": "Bearer key-b"}, chat()).action == "off"
    # No tenants configured: everyone is the one tenant there is.
    open_fleet = make(tenants=TenantConfig())
    assert open_fleet.on_headers(off, False).outcome == Outcome(Mode.OFF, "off")
    # And false: nobody.
    closed = make(tenants=TenantConfig(), allow_mode_override=False)
    assert run(closed, off, chat()).pod is not None


def test_the_override_setting_is_read_and_checked() -> None:
    assert parse_settings({"allow_mode_override": ["acme"]}).allow_mode_override == ("acme",)
    assert parse_settings({"allow_mode_override": False}).allow_mode_override is False
    with pytest.raises(ConfigError, match="allow_mode_override"):
        parse_settings({"allow_mode_override": "yes"})
    with pytest.raises(ConfigError, match="allow_mode_override"):
        parse_settings({"allow_mode_override": ["../x"]})


# ------------------------------------------------------------------ salted on every path


def _unroutable_fleet() -> Any:
    fleet = sim_fleet(["127.0.0.1:8001"])
    only = dataclasses.replace(fleet.destinations[0], models=("only-this",))
    return dataclasses.replace(fleet, destinations=(only,))


@pytest.mark.parametrize(
    ("mode", "extra", "action"),
    [
        (Mode.PROD, {"x_ace_skill_override": "prefix_kv_cache=off"}, "off"),
        (Mode.PROD, {"x_ace_skill_override": "prefix_kv_cache=shadow"}, "miss"),
        (Mode.PROD, {"x_ace_skill_override": "prefix_kv_cache=fast"}, "bypass_unknown_mode"),
        (Mode.SHADOW, {}, "miss"),
        (Mode.OFF, {}, "off"),
    ],
)
def test_every_unpinned_request_carries_its_tenant_salt_and_not_the_client_s(
    mode: Mode, extra: dict[str, str], action: str
) -> None:
    p = make(mode)
    body = chat(cache_salt="shared-with-everyone", cache_prefix_id="forged")
    out = run(p, headers(authorization="Bearer key-b", **extra), body)
    assert out.action == action and out.pod is None
    fields = sent(out)
    assert fields["cache_salt"] == SALTS.salt("globex")
    assert "cache_prefix_id" not in fields
    assert fields["messages"] == msgspec.json.decode(body)["messages"]


def test_other_paths_bodies_are_salted_too() -> None:
    """vLLM takes cache_salt on its other prompt APIs (Anthropic messages among them):
    a tenant's body there goes on unrouted, salted, and never with its own salt. The
    Responses API is routed, and salted as chat is."""
    p = make()
    body = msgspec.json.encode({"model": "sim-llama", "input": "hi", "cache_salt": "mine"})
    for path in ("/v1/messages", "/v1/embeddings", "/v1/chat/completions/"):
        out = run(p, headers(path=path, authorization="Bearer key-a"), body)
        assert out.action == "bypass_unknown_path" and out.pod is None, path
        assert sent(out) == {"model": "sim-llama", "input": "hi", "cache_salt": SALTS.salt("acme")}
    routed = run(p, headers(path="/v1/responses", authorization="Bearer key-a"), body)
    assert routed.pod is not None and sent(routed)["cache_salt"] == SALTS.salt("acme")
    for path in ("/v1/messages", "/v1/responses"):
        assert run(p, headers(path=path), b"[1]").reject_status == 400
    # A GET has no body to salt; without tenants nothing is read at all.
    assert p.on_headers(headers(path="/v1/models", method="GET"), True).outcome is not None
    plain = make(tenants=TenantConfig()).on_headers(headers(path="/v1/messages"), False)
    assert plain.outcome is not None and plain.outcome.action == "bypass_unknown_path"


def test_bypasses_of_the_body_are_salted_too() -> None:
    unknown = run(make(fleet=_unroutable_fleet()), headers(authorization="Bearer key-a"), chat())
    assert unknown.action == "bypass_unknown_model"
    assert sent(unknown)["cache_salt"] == SALTS.salt("acme")
    nobody = make()
    for slot in range(4):
        nobody.fleet.set_available(slot, False)
    out = run(nobody, headers(authorization="Bearer key-a"), chat())
    assert out.action == "bypass_no_pod" and sent(out)["cache_salt"] == SALTS.salt("acme")
    # A JSON object the parser does not understand still goes on, salted and stripped.
    odd = msgspec.json.encode({"messages": 5, "cache_salt": "x", "n": 1e300})
    out = run(make(), headers(), odd)
    assert out.action == "bypass_invalid_body"
    assert sent(out) == {"cache_salt": SALTS.salt("anon"), "messages": 5, "n": 1e300}


def test_a_client_salt_however_spelled_is_stripped() -> None:
    body = (
        b'{"model":"sim-llama","messages":[{"role":"user","content":"hi"}],"cache\\u005fsalt":"x"}'
    )
    for extra in ({}, {"x_ace_skill_override": "prefix_kv_cache=off"}):
        out = run(make(), headers(authorization="Bearer key-a", **extra), body)
        assert out.body is not None and out.body.count(b'"cache_salt"') == 1
        assert b"u005f" not in out.body
        assert sent(out)["cache_salt"] == SALTS.salt("acme")


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe{}", b"   "])
def test_what_cannot_be_salted_is_refused_where_tenants_are_configured(body: bytes) -> None:
    out = run(make(), headers(authorization="Bearer key-a"), body)
    assert out.reject_status == 400 and out.body is None
    error = msgspec.json.decode(out.reject_body)["error"]
    assert error["type"] == "invalid_request_error" and "JSON object" in error["message"]
    # Without tenants it goes on as it came: the engine answers it.
    plain = run(make(tenants=TenantConfig()), headers(), body)
    assert plain.action.startswith("bypass_") and plain.body is None


def test_a_body_over_the_limit_is_refused_where_it_cannot_be_salted() -> None:
    big = headers(authorization="Bearer key-a", content_length="100000")
    ctx = make(max_body_bytes=1000).on_headers(big, False)
    assert ctx.outcome is not None and ctx.outcome.reject_status == 413
    out = make(max_body_bytes=1000).on_body(
        make(max_body_bytes=1000).on_headers(headers(authorization="Bearer key-a"), False),
        chat(pad="x" * 2000),
    )
    assert out.reject_status == 413
    plain = make(tenants=TenantConfig(), max_body_bytes=1000).on_headers(big, False)
    assert plain.outcome is not None and plain.outcome.action == "bypass_too_large"


def test_the_native_api_is_salted_in_every_mode() -> None:
    envelope = msgspec.json.encode(
        {
            "input": {"messages": [{"role": "user", "content": "hi"}]},
            "target": {"model": "sim-llama"},
        }
    )
    for mode in Mode:
        out = run(make(mode), headers(path="/v1/execute", authorization="Bearer key-a"), envelope)
        assert out.path == CHAT and sent(out)["cache_salt"] == SALTS.salt("acme"), mode


def test_without_tenants_mode_off_skips_the_body() -> None:
    ctx = make(Mode.OFF, tenants=TenantConfig()).on_headers(headers(), False)
    assert ctx.outcome == Outcome(Mode.OFF, "off")
    # With tenants it needs it, to salt.
    ctx = make(Mode.OFF).on_headers(headers(), False)
    assert ctx.outcome is None and ctx.unrouted == "off"


def test_a_hosted_api_gets_no_engine_fields_even_unrouted() -> None:
    fleet = _unroutable_fleet()
    hosted = Destination("api", "openai", "https://api.example.com", (), ("only-this",))
    fleet = dataclasses.replace(fleet, destinations=(hosted,))
    out = run(make(fleet=fleet), headers(authorization="Bearer key-a"), chat())
    assert out.action == "bypass_unknown_model" and out.body is None


# ------------------------------------------------------------------ failure mode


def test_failure_mode_defaults_to_closed_where_requests_are_checked_or_salted() -> None:
    assert not Settings().fails_closed
    assert Settings(tenants=TenantConfig(key_digests=KEYS)).fails_closed
    assert Settings(tenants=TenantConfig(header="x-tenant")).fails_closed
    assert Settings(tenants=TenantConfig(require_key=True)).fails_closed
    assert Settings(failure_mode="closed").fails_closed
    header_only = parse_settings({"tenants": {"header": "x-t"}, "failure_mode": "open"})
    assert not header_only.fails_closed  # the deployment's choice, said in the docs
    with pytest.raises(ConfigError, match="failure_mode: open would let requests past"):
        parse_settings({"tenants": {"api_keys": {"k": "acme"}}, "failure_mode": "open"})
    with pytest.raises(ConfigError, match="failure_mode"):
        parse_settings({"failure_mode": "sometimes"})
    with pytest.raises(ConfigError, match="anonymous tenant"):
        parse_settings({"tenants": {"api_keys": {"k": "anon"}}})
    with pytest.raises(ConfigError, match=r"tenants\.requre_key"):
        parse_settings({"tenants": {"requre_key": True}})


def test_a_client_salt_beside_bytes_that_are_not_utf8_is_refused_not_a_crash() -> None:
    """The typed parse skips fields it does not need, unread; stripping a client's
    cache field reads the body whole and finds it is not JSON an engine could read
    (found by the soak run: an internal error, before)."""
    body = b'{"model":"sim-llama","messages":[{"role":"user","content":"hi"}],"x\xff":1,'
    body += b'"cache_salt":"mine"}'
    out = run(make(), headers(authorization="Bearer key-a"), body)
    assert (out.reject_status, out.action) == (400, "reject_not_utf8")
    plain = run(make(tenants=TenantConfig()), headers(), body)
    assert plain.action == "bypass_not_utf8" and plain.body is None and plain.pod is None
