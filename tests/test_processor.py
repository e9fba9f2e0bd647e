import asyncio
import dataclasses
import hashlib

import msgspec
import pytest

from ace_extproc.config import Config, Mode, Settings, TenantConfig, sim_fleet
from ace_extproc.processor import rewrite_body
from tests.conftest import make_processor

CHAT = "/v1/chat/completions"


def make(mode=Mode.PROD, **settings):
    fleet = sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)])
    base = Settings(mode=mode, salt_secret=b"secret", **settings)
    return make_processor(Config(fleet, base))


def headers(path=CHAT, method="POST", **extra):
    h = {":path": path, ":method": method, "content-type": "application/json"}
    h.update({k.replace("_", "-"): v for k, v in extra.items()})
    return h


def body(messages, **extra):
    return msgspec.json.encode({"model": "sim-llama", "messages": messages, **extra})


LONG = "You are a helpful assistant. " * 100  # ~2.9 KB: several blocks


def run(p, h, b, eos=False):
    ctx = p.on_headers(h, eos)
    return p.on_body(ctx, b)


def test_prod_pins_rewrites_and_reports():
    p = make()
    b = body([{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}])
    first = run(p, headers(), b)
    assert first.mode is Mode.PROD and first.action == "miss" and first.pod is not None
    sent = msgspec.json.decode(first.body)
    assert sent["cache_prefix_id"] == f"ace-kv-anon-{first.prefix_key}"
    salt = sent["cache_salt"]
    assert len(salt) == 64 and all(c in "0123456789abcdef" for c in salt)
    assert sent["messages"] == msgspec.json.decode(b)["messages"]
    second = run(
        p,
        headers(),
        body(
            [
                {"role": "system", "content": LONG},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"},
            ]
        ),
    )
    assert second.action == "hit" and second.pod == first.pod
    assert second.saved_tokens > 600 and second.speedup > 1.5
    # The estimate, from the calibrated model: cold TTFT over (and less) the warm one.
    model, n, c = p.ttft[second.pod.destination], second.prompt_tokens, second.saved_tokens
    assert second.speedup == model.ttft_ms(n) / model.ttft_ms(n - c, c)
    assert second.saved_ms == model.ttft_ms(n) - model.ttft_ms(n - c, c)
    assert first.saved_tokens == 0 and first.speedup == 1.0 and first.saved_ms == 0.0
    assert second.trace == (
        f"mode=prod,action=hit,prefix_key={second.prefix_key},"
        f"saved_prefill_tokens={second.saved_tokens},speedup={second.speedup:.2f}"
    )


def test_shadow_decides_but_neither_pins_nor_rewrites():
    p = make(Mode.SHADOW)
    out = run(p, headers(), body([{"role": "user", "content": LONG}]))
    assert out.mode is Mode.SHADOW and out.action == "miss"
    assert out.pod is None and out.body is None and out.would_pick is not None


def test_override_header_switches_mode_per_request():
    p = make()
    h = headers(x_ace_skill_override="prefix_kv_cache=shadow")
    assert run(p, h, body([{"role": "user", "content": "x"}])).mode is Mode.SHADOW
    h = headers(x_ace_skill_override="other=1, prefix_kv_cache=off")
    assert run(p, h, body([{"role": "user", "content": "x"}])).action == "off"
    locked = make(allow_mode_override=False)
    h = headers(x_ace_skill_override="prefix_kv_cache=off")
    assert run(locked, h, body([{"role": "user", "content": "x"}])).mode is Mode.PROD


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("garbage", "bad_override"),
        ("=prod", "bad_override"),
        ("prefix_kv_cache=fast", "unknown_mode"),
    ],
)
def test_bad_override_passes_through(value, reason):
    out = run(make(), headers(x_ace_skill_override=value), body([{"role": "user", "content": "x"}]))
    assert out.action == f"bypass_{reason}" and out.pod is None and out.body is None


@pytest.mark.parametrize(
    ("h", "eos", "reason"),
    [
        (headers(path="/v1/models", method="GET"), True, "unknown_path"),
        (headers(path="/v1/embeddings"), False, "unknown_path"),
        (headers(method="GET"), True, "method"),
        (headers(content_type="text/plain"), False, "content_type"),
        (headers(), True, "empty_body"),
        (headers(content_length="999999999"), False, "too_large"),
    ],
)
def test_headers_alone_decide_bypasses(h, eos, reason):
    ctx = make().on_headers(h, eos)
    assert ctx.outcome is not None and ctx.outcome.action == f"bypass_{reason}"


def test_body_over_limit_and_unknown_model_bypass():
    p = make(max_body_bytes=1000)
    assert (
        run(p, headers(), body([{"role": "user", "content": "x" * 2000}])).action
        == "bypass_too_large"
    )
    fleet = sim_fleet(["127.0.0.1:8001"])
    dest = dataclasses.replace(fleet.destinations[0], models=("only-this",))
    p2 = make_processor(Config(dataclasses.replace(fleet, destinations=(dest,)), Settings()))
    assert (
        run(p2, headers(), body([{"role": "user", "content": "x"}])).action
        == "bypass_unknown_model"
    )


def test_query_string_does_not_hide_the_path():
    out = run(make(), headers(path=CHAT + "?x=1"), body([{"role": "user", "content": "x"}]))
    assert out.action == "miss"


def keyed(**kw):
    digests = {
        hashlib.sha256(b"key-a").digest(): "acme",
        hashlib.sha256(b"key-b").digest(): "globex",
    }
    return make(tenants=TenantConfig(key_digests=digests, **kw))


def test_tenants_from_api_keys_get_their_own_prefix_space_and_salt():
    p = keyed()
    b = body([{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}])
    a = run(p, headers(authorization="Bearer key-a"), b)
    g = run(p, headers(authorization="Bearer key-b"), b)
    assert a.action == g.action == "miss"  # the same text, but not the same prefix
    assert a.prefix_key != g.prefix_key
    sa, sg = (msgspec.json.decode(o.body) for o in (a, g))
    assert sa["cache_salt"] != sg["cache_salt"]
    assert sa["cache_prefix_id"].startswith("ace-kv-acme-")
    assert sg["cache_prefix_id"].startswith("ace-kv-globex-")


def test_unknown_key_gets_401_and_the_key_is_never_echoed():
    out = run(
        keyed(),
        headers(authorization="Bearer sk-secret-123"),
        body([{"role": "user", "content": "x"}]),
    )
    assert out.reject_status == 401
    err = msgspec.json.decode(out.reject_body)
    assert err["error"]["type"] == "authentication_error"
    assert b"sk-secret" not in out.reject_body and "sk-secret" not in out.trace
    # Missing key: anonymous unless required.
    assert run(keyed(), headers(), body([{"role": "user", "content": "x"}])).action == "miss"
    assert (
        run(
            keyed(require_key=True), headers(), body([{"role": "user", "content": "x"}])
        ).reject_status
        == 401
    )
    # Shadow and off change routing, not who may send a request: refused there too.
    for mode in (Mode.SHADOW, Mode.OFF):
        other = make(mode, tenants=keyed().tenants._config)
        out = run(
            other, headers(authorization="Bearer nope"), body([{"role": "user", "content": "x"}])
        )
        assert (out.action, out.reject_status) == ("reject_unknown_key", 401)


def test_trusted_tenant_header():
    p = make(tenants=TenantConfig(header="x-tenant"))
    out = run(p, headers(x_tenant="team-7"), body([{"role": "user", "content": "x"}]))
    assert msgspec.json.decode(out.body)["cache_prefix_id"].startswith("ace-kv-team-7-")
    bad = run(p, headers(x_tenant="../evil"), body([{"role": "user", "content": "x"}]))
    assert msgspec.json.decode(bad.body)["cache_prefix_id"].startswith("ace-kv-anon-")


def test_client_cache_fields_are_replaced_not_shadowed():
    b = body([{"role": "user", "content": "x"}], cache_salt="mine", cache_prefix_id="forged")
    out = run(make(), headers(), b)
    raw = out.body
    assert raw.count(b'"cache_salt"') == 1 and raw.count(b'"cache_prefix_id"') == 1
    sent = msgspec.json.decode(raw)
    assert sent["cache_salt"] != "mine" and sent["cache_prefix_id"] != "forged"


@pytest.mark.parametrize(
    "original",
    [b'{"a":1}', b'  {  "a" : [1, {"b": 2}] }  ', b"{}", b'{"cache_salt": null, "z": 1}'],
)
def test_rewrite_body_is_valid_json_with_the_fields(original):
    out = rewrite_body(
        original, '"cache_prefix_id":"p","cache_salt":"s"', b"cache_salt" in original
    )
    obj = msgspec.json.decode(out)
    assert obj["cache_prefix_id"] == "p" and obj["cache_salt"] == "s"
    assert {k: v for k, v in obj.items() if k not in ("cache_prefix_id", "cache_salt")} == {
        k: v for k, v in msgspec.json.decode(original).items() if k != "cache_salt"
    }


def test_a_hosted_api_is_pinned_and_told_what_shares_a_prefix_not_sent_engine_fields():
    """``provider: openai``: the request is pinned to it; its body carries neither
    cache_prefix_id nor cache_salt (a hosted API may refuse arguments it does not know)
    but a ``prompt_cache_key`` (OpenAI's, Mistral's), the same for requests that share
    their first block or their session, so the API keeps them on one cache. A client's
    own values stay as sent; stream_options for usage capture is still added."""
    from ace_extproc.config import parse_fleet

    doc = {"destinations": [{"id": "gpt", "provider": "openai", "base_url": "https://api.x/v1"}]}
    settings = Settings(salt_secret=b"s", usage_capture=True)
    p = make_processor(Config(parse_fleet(doc), settings))

    def sent(messages, session=None, **extra):
        h = headers(**({"x_session_id": session} if session else {}))
        out = run(p, h, body(messages, **extra))
        assert out.pod is not None and out.pod.destination == "gpt"
        return msgspec.json.decode(out.body) if out.body is not None else None

    first = sent([{"role": "user", "content": LONG}], cache_salt="client-own")
    assert first["cache_salt"] == "client-own" and "cache_prefix_id" not in first
    key = first["prompt_cache_key"]
    assert key.startswith("ace-") and len(key) == 20
    later = sent(
        [{"role": "user", "content": LONG + " and more"}, {"role": "user", "content": "?"}]
    )
    assert later["prompt_cache_key"] == key  # the same first block: the same cache
    other = sent([{"role": "user", "content": "Something else entirely. " * 40}])
    assert other["prompt_cache_key"] != key
    a = sent([{"role": "user", "content": LONG}], session="s1")["prompt_cache_key"]
    b = sent([{"role": "user", "content": "unrelated " * 60}], session="s1")["prompt_cache_key"]
    assert a == b != key  # a session keeps one key whatever its prompts
    assert sent([{"role": "user", "content": LONG}], prompt_cache_key="mine") is None
    streamed = sent([{"role": "user", "content": LONG}], stream=True)
    assert streamed["stream_options"] == {"include_usage": True}
    assert "cache_salt" not in streamed and streamed["prompt_cache_key"] == key


def test_a_pinned_request_carries_its_destination_s_key_not_the_client_s():
    from ace_extproc import mutate
    from ace_extproc.config import parse_fleet

    doc = {
        "destinations": [
            {
                "id": "keyed",
                "base_url": "http://10.0.0.1:8000",
                "api_key_env": "K",
                "models": ["a"],
            },
            {"id": "open", "base_url": "http://10.0.0.2:8000", "models": ["b"]},
        ]
    }
    fleet = parse_fleet(doc, env={"K": "pod-key"})
    for mode, model, expected in (
        (Mode.PROD, "a", b"Bearer pod-key"),
        (Mode.PROD, "b", None),  # no key of its own: the client's goes as sent
        (Mode.SHADOW, "a", None),  # shadow changes nothing
    ):
        p = make_processor(Config(fleet, Settings(mode=mode, salt_secret=b"s")))
        msg = msgspec.json.encode({"model": model, "messages": [{"role": "user", "content": LONG}]})
        out = run(p, headers(authorization="Bearer client"), msg)
        assert out.upstream_auth == expected
        change = mutate.changes(out, False)
        assert (("authorization", expected) in change.headers) is (expected is not None)
        assert all(name != "authorization" for name, _ in change.headers) is (expected is None)


def test_a_routed_request_records_its_step_times_with_its_decision():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def step_counts(p):
        text = generate_latest(p.telemetry.registry).decode()
        return {
            s.labels["step"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "ace_decision_step_seconds_count"
        }

    p = make()
    before = step_counts(p)
    out = run(p, headers(), body([{"role": "user", "content": LONG}]))
    assert out.steps_ns is not None and len(out.steps_ns) == 4
    assert all(t >= 0 for t in out.steps_ns) and out.steps_ns[2] > 0
    after = step_counts(p)
    assert {k: after[k] - before.get(k, 0) for k in after} == dict.fromkeys(
        ("parse", "hash", "pick", "rewrite"), 1
    )
    # A request that is not routed records none.
    bypass = run(p, headers(path="/v1/models", method="GET"), b"", eos=True)
    assert bypass.steps_ns is None and step_counts(p) == after


# ------------------------------------------------------------------ the Responses API

RESPONSES = "/v1/responses"


def responses_body(**fields):
    return msgspec.json.encode({"model": "sim-llama", **fields})


def test_a_responses_request_is_routed_and_salted_like_a_chat():
    """Keyed by its prefix like the same chat (the same pod), salted per tenant with the
    client's own salt gone; a stream gets no stream_options (its usage comes anyway);
    an answer the engine is asked to store is marked for the observe filter."""
    p = make(usage_capture=True)
    chat = run(
        p, headers(), body([{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}])
    )
    fields = {"instructions": LONG, "input": "hi", "stream": True, "cache_salt": "mine"}
    out = run(p, headers(RESPONSES), responses_body(**fields))
    assert (out.action, out.pod, out.prefix_key) == ("hit", chat.pod, chat.prefix_key)
    sent = msgspec.json.decode(out.body)
    assert sent["cache_salt"] == msgspec.json.decode(chat.body)["cache_salt"] != "mine"
    assert "stream_options" not in sent and sent["input"] == "hi"
    assert out.store_tenant == "anon" and "previous_response" not in out.trace
    unstored = run(p, headers(RESPONSES), responses_body(input="hi", store=False))
    assert unstored.store_tenant == ""


def test_a_continuation_goes_to_the_pod_that_stored_its_response():
    p = make(responses_wait_ms=0)  # the answers here are never observed: none awaited
    first = run(p, headers(RESPONSES), responses_body(input=LONG))
    home = next(slot for slot in range(4) if slot != first.slot)
    p.homes.remember("anon", "resp_1", p.fleet.pods[home].key)
    for _ in range(5):  # whatever its prefix says
        out = run(p, headers(RESPONSES), responses_body(input=LONG, previous_response_id="resp_1"))
        assert (out.action, out.slot, out.pod) == ("previous_response", home, p.fleet.pods[home])
        assert out.trace.endswith(",previous_response=pinned")
        assert msgspec.json.decode(out.body)["cache_salt"]  # salted as any other
    # Unknown here: routed by its prefix, and the trace says so.
    unknown = run(p, headers(RESPONSES), responses_body(input=LONG, previous_response_id="resp_9"))
    assert unknown.action == "hit" and unknown.slot == first.slot
    assert unknown.trace.endswith(",previous_response=unknown")


def test_a_continuation_whose_pod_is_gone_is_refused_saying_why():
    p = make()
    p.homes.remember("anon", "resp_1", p.fleet.pods[1].key)
    continued = responses_body(input="more", previous_response_id="resp_1")
    p.fleet.set_available(1, False)
    down = run(p, headers(RESPONSES), continued)
    assert (down.action, down.reject_status) == ("reject_response_unavailable", 503)
    error = msgspec.json.decode(down.reject_body)["error"]
    assert "resp_1" in error["message"] and "health checks" in error["message"]
    assert error["param"] == "previous_response_id"
    p.fleet.set_available(1, True)
    p.fleet.remove_pod(1)
    lost = run(p, headers(RESPONSES), continued)
    assert (lost.action, lost.reject_status) == ("reject_response_lost", 404)
    message = msgspec.json.decode(lost.reject_body)["error"]["message"]
    assert "is lost" in message and "left the fleet" in message
    # Shadow changes nothing for the client: routed as usual, the trace says what it saw.
    shadow = run(
        p, headers(RESPONSES, **{"x_ace_skill_override": "prefix_kv_cache=shadow"}), continued
    )
    assert shadow.reject_status == 0 and shadow.pod is None
    assert shadow.trace.endswith(",previous_response=lost")


@pytest.mark.parametrize("mode", [Mode.PROD, Mode.SHADOW])
def test_shadow_reports_the_pin_without_pinning(mode):
    """Shadow says where the turn would go, and neither pins it nor counts it there
    (Envoy sends it elsewhere); production does both."""
    p = make(mode=mode)
    p.load.active = True  # as where the monitor runs
    p.homes.remember("anon", "resp_1", p.fleet.pods[3].key)
    out = run(p, headers(RESPONSES), responses_body(input="more", previous_response_id="resp_1"))
    assert out.action == "previous_response" and out.would_pick == p.fleet.pods[3]
    assert out.pod == (p.fleet.pods[3] if mode is Mode.PROD else None)
    assert p.fleet.load[3].inflight == (1 if mode is Mode.PROD else 0)


def test_a_tenant_cannot_pin_to_another_tenant_s_response():
    p = keyed()
    p.homes.remember("acme", "resp_1", p.fleet.pods[2].key)
    continued = responses_body(input=LONG, previous_response_id="resp_1")
    own = run(p, headers(RESPONSES, authorization="Bearer key-a"), continued)
    assert own.previous_response == "pinned" and own.slot == 2
    other = run(p, headers(RESPONSES, authorization="Bearer key-b"), continued)
    assert other.previous_response == "unknown" and other.action != "previous_response"


def test_a_continuation_whose_pod_is_outside_the_gateway_s_subset_is_unavailable():
    p = make()
    p.homes.remember("anon", "resp_1", p.fleet.pods[0].key)
    ctx = p.on_headers(headers(RESPONSES), False, frozenset({p.fleet.pods[1].endpoint}))
    out = p.on_body(ctx, responses_body(input="more", previous_response_id="resp_1"))
    assert (out.action, out.reject_status) == ("reject_response_unavailable", 503)


@pytest.mark.parametrize("mode", [Mode.PROD, Mode.SHADOW])
def test_a_turn_naming_an_id_not_noted_yet_is_decided_once_it_is(mode):
    """Production: a stored answer sent is awaited; a turn naming an unknown id then
    defers its decision (uncounted) and, once noted, is pinned. Shadow never delays."""
    p = make(mode=mode)
    first = run(p, headers(RESPONSES), responses_body(input=LONG))
    assert p.homes.awaits("anon") is (mode is Mode.PROD)
    ctx = p.on_headers(headers(RESPONSES), False)
    continued = responses_body(input="more", previous_response_id="resp_1")
    out = p.on_body(ctx, continued)
    if mode is Mode.SHADOW:
        assert ctx.awaiting is None and out.previous_response == "unknown"
        return
    assert ctx.awaiting == "resp_1" and out.action == "await_previous_response"
    assert p.homes.found["unknown"] == 0
    p.homes.remember("anon", "resp_1", p.fleet.pods[first.slot].key)
    asyncio.run(p.noted(ctx))
    out = p.on_body(ctx, continued)
    assert (out.action, out.slot, ctx.awaiting) == ("previous_response", first.slot, None)
