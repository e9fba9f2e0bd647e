"""The fleet file as types (``fleet_file``): what is refused names its path at every
level, and the JSON Schema and reference generated from the same types are the shipped
ones and accept the shipped fleets. The semantic checks (URLs, listen addresses, keys)
are tested beside the code that uses them (test_tls, test_discovery, test_access...)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc import config_schema
from ace_extproc import fleet_file as ff
from ace_extproc.config import (
    ConfigError,
    Settings,
    fleet_to_dict,
    load,
    parse_fleet,
    parse_settings,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "envoy" / "fleet.example.yaml"
COMPOSE_FLEET = ROOT / "compose" / "fleet.yaml"
CHART_VALUES = ROOT / "charts" / "ace-extproc" / "values.yaml"

POD = {"id": "p0", "base_url": "http://10.0.0.1:8000"}
DNS = {"type": "dns", "hostname": "llm.ns.svc.cluster.local", "port": 8000}
K8S = {"type": "kubernetes", "namespace": "ns", "service": "llm", "port": 8000}


def doc(dest: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A valid fleet document, with ``dest``'s keys over its one destination's."""
    d = {"id": "a", "base_url": "http://10.0.0.1:8000", "pods": [POD], **(dest or {})}
    return {"destinations": [d], **top}


def refused(raw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_fleet(raw, env={})
        parse_settings(raw.get("router") if isinstance(raw, dict) else None, env={})
    return str(info.value)


def schema_errors(raw: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(config_schema.fleet_schema())
    return [e.message for e in validator.iter_errors(raw)]


# ---------------------------------------------------------------- refused, by path


TYPOS = [
    ({"destinatons": []}, "destinatons: unknown field (did you mean destinations?)"),
    (doc(routr={}), "routr: unknown field (did you mean router?)"),
    (doc({"wieght": 2}), "destinations[0].wieght: unknown field"),
    (doc({"model": "m"}), "destinations[0].model: unknown field (did you mean models?)"),
    (
        doc({"pods": [POD, {**POD, "id": "p1", "wieght": 2}]}),
        "destinations[0].pods[1].wieght: unknown field (did you mean weight?)",
    ),
    (
        doc({"discovery": {**DNS, "intervals": 2}}),
        "destinations[0].discovery.intervals: unknown field (did you mean interval_s?)",
    ),
    # Another kind's key: the message lists this kind's.
    (
        doc({"discovery": {**DNS, "namespace": "ns"}}),
        "destinations[0].discovery.namespace: unknown field (expected one of hostname, port, "
        "interval_s)",
    ),
    (
        doc({"discovery": {**K8S, "svc": "x"}}),
        "destinations[0].discovery.svc: unknown field",
    ),
    (doc(router={"modes": "prod"}), "router.modes: unknown field (did you mean mode?)"),
    (
        doc(router={"tenants": {"requre_key": True}}),
        "router.tenants.requre_key: unknown field (did you mean require_key?)",
    ),
    (
        doc(router={"passive_health": {"consecutive_5x": 3}}),
        "router.passive_health.consecutive_5x: unknown field (did you mean consecutive_5xx?)",
    ),
    (
        doc(router={"ext_proc_tls": {"ca_file": "/ca", "certfile": "/c"}}),
        "router.ext_proc_tls.certfile: unknown field (did you mean cert_file?)",
    ),
]


@pytest.mark.parametrize(("raw", "message"), TYPOS)
def test_a_typo_at_any_level_is_refused_with_its_path(raw: dict[str, Any], message: str) -> None:
    assert refused(raw).startswith(message)
    assert schema_errors(raw), "the schema accepts what the decoder refuses"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "fleet: expected a mapping, got a list"),
        (None, "fleet: expected a mapping, got null"),
        ({"destinations": None}, "destinations: expected a list, got null"),
        ({"destinations": []}, "destinations: expected a non-empty list"),
        ({"destinations": ["a"]}, "destinations[0]: expected a mapping, got a string ('a')"),
        (doc({"id": "no spaces"}), "destinations[0].id: expected an id (1-63 letters"),
        (doc({"provider": "tgi"}), "destinations[0].provider: expected one of "),
        (doc({"models": 7}), "destinations[0].models: expected a string or a list"),
        (doc({"pods": {"p0": POD}}), "destinations[0].pods: expected a list or null"),
        (doc({"pods": [{"id": "p0"}]}), "destinations[0].pods[0].base_url: missing required"),
        (doc({"pods": [{**POD, "weight": "2"}]}), "destinations[0].pods[0].weight: expected a"),
        (doc({"pods": [{**POD, "weight": 0}]}), "destinations[0].pods[0].weight: expected a"),
        (doc({"kv_capacity_tokens": True}), "destinations[0].kv_capacity_tokens: expected an"),
        (doc({"discovery": "dns"}), "destinations[0].discovery: expected a mapping or null"),
        (doc({"discovery": {"type": "consul"}}), "destinations[0].discovery.type: expected one"),
        (doc({"discovery": {"port": 1}}), "destinations[0].discovery.type: missing required"),
        (doc({"discovery": {**DNS, "port": 0}}), "destinations[0].discovery.port: expected an"),
        (
            doc({"discovery": {**DNS, "hostname": "bad host!"}}),
            "destinations[0].discovery.hostname: expected a DNS name, got 'bad host!'",
        ),
        (doc(router=[]), "router: expected a mapping or null, got a list"),
        (doc(router={"block_bytes": "512"}), "router.block_bytes: expected an integer, got a"),
        (doc(router={"block_bytes": 8}), "router.block_bytes: expected an integer >= 16, got 8"),
        (doc(router={"place_sessions": "yes"}), "router.place_sessions: expected true or false"),
        (doc(router={"mode": "on"}), "router.mode: expected one of off, shadow, prod, got 'on'"),
        (doc(router={"log_format": "xml"}), "router.log_format: expected one of json, text"),
        (doc(router={"tenants": []}), "router.tenants: expected a mapping or null"),
        (doc(router={"tenants": {"api_keys": {"k": "a b"}}}), "router.tenants.api_keys (a value)"),
        (doc(router={"tenants": {"api_keys": {1: "t"}}}), "router.tenants.api_keys: a key"),
        (doc(router={"passive_health": {"max_ejection_percent": 101}}), "<= 100, got 101"),
        (doc(router={"ext_proc_tls": {"cert_file": "/c"}}), "router.ext_proc_tls.ca_file: miss"),
        (doc(router={"ext_proc_tls": {"ca_file": 1}}), "router.ext_proc_tls.ca_file: expected a"),
        (doc(router={"allow_mode_override": ["ok", "../x"]}), "allow_mode_override[1]: expected"),
        ({1: "x"}, "fleet: a key: expected a string"),
    ],
)
def test_a_wrong_value_is_refused_with_its_path(raw: Any, message: str) -> None:
    assert message in refused(raw)


def test_a_destination_weight_is_refused_saying_why() -> None:
    message = refused(doc({"weight": 2}))
    assert message.startswith("destinations[0].weight: not supported on a destination")
    assert "pods' weight" in message and "first listed" in message
    assert schema_errors(doc({"weight": 2}))
    # A pod's weight is read, and written back.
    fleet = parse_fleet(doc({"pods": [{**POD, "weight": 2}]}), env={})
    assert fleet.pods[0].weight == 2.0
    assert fleet_to_dict(fleet)["destinations"][0]["pods"][0]["weight"] == 2.0
    assert "weight" not in fleet_to_dict(fleet)["destinations"][0]


def test_null_sections_are_their_defaults() -> None:
    raw = doc(router={"tenants": None, "passive_health": None, "ext_proc_tls": None})
    settings = parse_settings(raw["router"], env={})
    assert settings.passive_health == ff.PassiveHealth() and settings.ext_proc_tls is None
    assert not settings.tenants.isolated
    assert parse_settings(None, env={"ACE_SALT_SECRET": "s"}) == parse_settings(
        {}, env={"ACE_SALT_SECRET": "s"}
    )
    assert parse_fleet(doc({"pods": None}), env={}).pods[0].id == "pod-0"


def test_a_bad_file_is_a_config_error(tmp_path: Path) -> None:
    for text, message in [
        ("- a\n- b\n", "expected a mapping with 'destinations:'"),
        ("", "expected a mapping with 'destinations:'"),
        ("destinations: [{id: a, base_url: 'http://h:1', wieght: 1}]\n", "wieght: unknown"),
        ("destinations: [{id: a, base_url: 'http://h:1'}]\nrouter:\n", None),
        ("destinations: [{id: a, base_url: 'http://h:1'}]\n2024-01-01: x\n", "a key"),
    ]:
        path = tmp_path / "fleet.yaml"
        path.write_text(text)
        if message is None:
            assert load(path, env={}).settings.mode == ff.Mode.PROD
            continue
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(path, env={})


# Anything YAML can hold, where a fleet's values go: a ConfigError or a fleet, never
# another exception.
yaml_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=4)  # !!binary
    | st.dates()  # an unquoted 2024-01-01
    | st.datetimes(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.frozensets(st.integers(), max_size=2)  # !!set
        | st.dictionaries(st.text(max_size=8) | st.integers() | st.booleans(), inner, max_size=3)
    ),
    max_leaves=8,
)
PATHS = [
    (),
    ("destinations",),
    ("destinations", 0),
    ("destinations", 0, "pods"),
    ("destinations", 0, "pods", 0),
    ("destinations", 0, "pods", 0, "weight"),
    ("destinations", 0, "discovery"),
    ("destinations", 0, "models"),
    ("router",),
    ("router", "tenants"),
    ("router", "tenants", "api_keys"),
    ("router", "passive_health"),
    ("router", "ext_proc_tls"),
    ("router", "allow_mode_override"),
    ("router", "block_bytes"),
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PATHS), yaml_values)
def test_any_value_anywhere_is_a_fleet_or_a_config_error(
    path: tuple[str | int, ...], value: Any
) -> None:
    raw: Any = doc(router={"tenants": {}, "passive_health": {}, "ext_proc_tls": {"ca_file": "c"}})
    if not path:
        raw = value
    else:
        here = raw
        for step in path[:-1]:
            here = here[step]
        here[path[-1]] = value
    try:
        parse_fleet(copy.deepcopy(raw), env={})
        parse_settings(raw.get("router") if isinstance(raw, dict) else None, env={})
    except ConfigError as exc:
        assert str(exc) and "Traceback" not in str(exc)


# ---------------------------------------------------------------- running objects


def test_every_router_setting_reaches_settings() -> None:
    """Settings is made of the router's own fields: none is dropped on the way."""
    own = set(ff.RouterBase.__struct_fields__)
    assert own <= set(Settings.__struct_fields__)
    assert own <= set(ff.Router.__struct_fields__)
    changed = {"block_bytes": 1024, "policy": "affinity", "usage_capture": True, "uds": "/s"}
    settings = parse_settings(changed, env={})
    assert {k: getattr(settings, k) for k in changed} == changed


def test_settings_never_print_their_secrets() -> None:
    settings = parse_settings({"salt_secret": "s3cret-salt"}, env={"ACE_SHARE_PASSWORD": "pw-x"})
    assert settings.salt_secret == b"s3cret-salt" and settings.share_password == "pw-x"
    assert "s3cret-salt" not in repr(settings) and "pw-x" not in repr(settings)
    assert "block_bytes=512" in repr(settings)


# ---------------------------------------------------------------- shipped files


def _example_router() -> dict[str, Any]:
    """fleet.example.yaml's commented-out router section, as the file would hold it."""
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index("# router:")
    router: dict[str, Any] = yaml.safe_load(
        "\n".join(re.sub(r"^# ?", "", line) for line in lines[start:])
    )["router"]
    return router


def _shipped() -> dict[str, Any]:
    chart = yaml.safe_load(CHART_VALUES.read_text())
    return {
        "envoy/fleet.example.yaml": yaml.safe_load(EXAMPLE.read_text()),
        "envoy/fleet.example.yaml router": {
            **yaml.safe_load(EXAMPLE.read_text()),
            "router": _example_router(),
        },
        "compose/fleet.yaml": yaml.safe_load(COMPOSE_FLEET.read_text()),
        "chart values": {"destinations": chart["destinations"], "router": chart["router"]},
    }


@pytest.mark.parametrize("name", list(_shipped()))
def test_the_shipped_fleets_load_and_match_the_schema(name: str) -> None:
    raw = _shipped()[name]
    assert schema_errors(raw) == []
    parse_fleet(raw, env={})
    settings = parse_settings(raw.get("router"), env={})
    if name.endswith("router"):  # every section of the example, uncommented
        assert settings.tenants.header == "x-tenant-id" and settings.ext_proc_tls is not None


def test_the_schema_is_a_valid_schema_and_says_what_each_key_is() -> None:
    schema = config_schema.fleet_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    router = schema["$defs"]["Router"]["properties"]
    assert router["block_bytes"] == {
        "description": router["block_bytes"]["description"],
        "type": "integer",
        "minimum": 16,
        "maximum": 65536,
        "default": 512,
    }
    assert "weight" not in schema["$defs"]["Destination"]["properties"]
    assert schema["$defs"]["Destination"]["additionalProperties"] is False


def test_the_shipped_schema_reference_and_chart_schema_are_generated() -> None:
    """ace-extproc schema --write made them from the types as they are now."""
    made = config_schema.generated()
    assert set(made) == {
        config_schema.SCHEMA_FILE,
        config_schema.REFERENCE_FILE,
        config_schema.CHART_SCHEMA_FILE,
    }
    for path, text in made.items():
        assert path.read_text() == text, f"{path.name} is stale: run ace-extproc schema --write"
    assert json.loads(config_schema.SCHEMA_FILE.read_text()) == config_schema.fleet_schema()


def test_the_reference_lists_every_key() -> None:
    text = config_schema.REFERENCE_FILE.read_text()
    for kind in (ff.FleetFile, ff.Destination, ff.Pod, ff.Router, ff.Tenants, ff.ExtProcTLS):
        for name in kind.__struct_fields__:
            assert f"| `{name}` |" in text, f"{kind.__name__}.{name}"
    assert "## `router.passive_health`" in text and "## `destinations[].pods[]`" in text


def test_the_schema_command(capsys: pytest.CaptureFixture[str]) -> None:
    from ace_extproc import cli

    assert cli.main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == config_schema.fleet_schema()
    assert cli.main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == config_schema.reference()
    assert cli.main(["schema", "--check"]) == 0
