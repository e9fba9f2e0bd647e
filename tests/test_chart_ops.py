"""The chart under GitOps and prometheus-operator, and its values schema: secrets a
render never generates, every worker's metrics port scraped, the dashboard and the
alerts in the operator's kinds (checked against their CRDs, ``tests/crds/``), Envoy's
worker count and stop sequence, and values the schema or the templates refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests import crd_schema
from tests.test_chart import (
    CHART,
    KUBERNETES,
    REDIS_PASSWORD,
    Manifest,
    containers,
    one,
    render,
    render_as_is,
)

OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}


def validate_all(docs: list[Manifest]) -> None:
    """Kubernetes' own kinds against its schemas, the rest against their CRDs."""
    for doc in docs:
        if crd_schema.describes(doc):
            crd_schema.validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def secrets(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] == "Secret"]


# ------------------------------------------------------------------ GitOps-safe secrets


def test_two_renders_make_the_same_secrets() -> None:
    values = {"shareRedis": {"enabled": True, "password": REDIS_PASSWORD}}
    first, second = render(values), render(values)
    assert len(secrets(first)) == 2  # the salt's and the chart's Redis's
    assert secrets(first) == secrets(second)
    # ... and the pods roll only when a value changes (the checksums are stable).
    assert [d for d in first if d["kind"] == "Deployment"] == [
        d for d in second if d["kind"] == "Deployment"
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "saltSecret: set saltSecret.existingSecret .* or saltSecret.value"),
        (
            {"saltSecret": {"value": "x"}, "shareRedis": {"enabled": True}},
            "shareRedis: set shareRedis.existingSecret .* or shareRedis.password",
        ),
    ],
    ids=["salt", "redis-password"],
)
def test_a_render_without_a_secret_fails_saying_why(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message) as failed:
        render_as_is(values)
    assert "helm template" in str(failed.value)  # why: a render cannot keep one


def test_the_redis_password_is_named_once() -> None:
    both = {"enabled": True, "password": REDIS_PASSWORD, "existingSecret": "team-redis"}
    with pytest.raises(helm.HelmError, match="existingSecret or password, not both"):
        render({"shareRedis": both})


def test_the_redis_password_from_a_secret_of_yours() -> None:
    docs = render({"shareRedis": {"enabled": True, "existingSecret": "team-redis"}})
    assert [s["metadata"]["name"] for s in secrets(docs)] == ["gw-ace-extproc-salt"]
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if e["name"] in ("ACE_SHARE_PASSWORD", "REDIS_PASSWORD")
    ]
    assert refs == [{"name": "team-redis", "key": "ACE_SHARE_PASSWORD"}] * 2


# ------------------------------------------------------------------ monitoring


def test_the_pod_monitor_scrapes_every_worker() -> None:
    docs = render({"extproc": {"workers": 3}, "podMonitor": {"enabled": True}})
    validate_all(docs)
    monitor = one(docs, "PodMonitor")
    ports = {p["name"]: p["containerPort"] for p in containers(docs)["ace-extproc"]["ports"]}
    # serve --workers 3: metrics_listen's port, +1, +2 (telemetry.worker_listen)
    assert ports == {"metrics": 9090, "metrics-1": 9091, "metrics-2": 9092}
    scraped = {e["port"]: e["path"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == {
        "metrics": "/metrics",
        "metrics-1": "/metrics",
        "metrics-2": "/metrics",
        "envoy-stats": "/stats/prometheus",  # Envoy's, not its admin port
    }
    assert containers(docs)["envoy"]["ports"][1] == {
        "name": "envoy-stats",
        "containerPort": 9902,
        "protocol": "TCP",
    }
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    policy = one(docs, "NetworkPolicy")
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert {9090, 9091, 9092} <= admitted


def test_the_workers_metrics_ports_match_the_server_s() -> None:
    from ace_extproc import telemetry

    docs = render({"extproc": {"workers": 4}})
    declared = [p["containerPort"] for p in containers(docs)["ace-extproc"]["ports"]]
    served = [int(telemetry.worker_listen("0.0.0.0:9090", i).rsplit(":", 1)[1]) for i in range(4)]
    assert declared == served


def test_the_operator_selects_by_the_labels_given() -> None:
    labels = {"release": "kube-prometheus-stack"}
    docs = render(
        {
            "podMonitor": {"enabled": True, "labels": labels},
            "prometheusRule": {"enabled": True, "labels": labels},
        }
    )
    validate_all(docs)
    for kind in OPERATOR_KINDS:
        assert one(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "scheme"], "gopher"),
        ("PodMonitor", ["spec", "podMetricsEndpoints", 0, "portt"], "metrics"),
        ("PrometheusRule", ["spec", "groups", 0, "rules", 0, "for"], "ten minutes"),
    ],
)
def test_the_crd_check_bites(kind: str, path: list[Any], value: Any) -> None:
    docs = render({"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}})
    crd_schema.assert_refused(one(docs, kind), path, value)


def test_the_dashboard_configmap_for_grafana_s_sidecar() -> None:
    assert not [d for d in render() if d["metadata"]["name"].endswith("-dashboard")]  # off
    docs = render({"dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}})
    validate_all(docs)
    (cm,) = [d for d in docs if d["metadata"]["name"] == "gw-ace-extproc-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((CHART.parent.parent / "dashboards" / "ace-extproc.json").read_text())
    assert json.loads(cm["data"]["ace-extproc.json"]) == shipped


# ------------------------------------------------------------------ values and options


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"serviceMonitor": {"enabled": True}}, ""),
        ({"resources": {"limits": {"cpu": 1}}}, ""),
        ({"podMonitor": {"enabeld": True}}, "/podMonitor"),
        ({"envoy": {"resources": {"limit": {"cpu": 1}}}}, "/envoy/resources"),
        ({"envoy": {"concurrency": 0}}, "/envoy/concurrency"),
        ({"extproc": {"extraArgs": "--x"}}, "/extproc/extraArgs"),
        ({"drain": {"timeout": 30}}, "/drain"),
        ({"serviceAccount": {"annotation": {}}}, "/serviceAccount"),
    ],
)
def test_the_schema_refuses_unknown_and_wrong_keys(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmError, match=f"at '{where}'"):
        render(values)


def test_every_value_the_chart_ships_is_in_the_schema() -> None:
    """The schema is closed (additionalProperties: false), so each key of values.yaml
    must be declared: checked here without Helm, object by object."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)

    def closed(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert "additionalProperties" in node, where
            for key, value in node.items():
                closed(value, f"{where}/{key}")

    closed(schema, "")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"ports": {"http": 9090}},
            "port clash: ports.http and ports.metrics .worker 0. are both 9090",
        ),
        ({"ports": {"http": 9901}}, "port clash: ports.http and Envoy's admin are both 9901"),
        (
            {"extproc": {"workers": 2}, "ports": {"extproc": 9091}},
            "port clash: ports.extproc and ports.metrics .worker 1. are both 9091",
        ),
        ({"terminationGracePeriodSeconds": 30}, "terminationGracePeriodSeconds .30. is shorter"),
    ],
)
def test_the_templates_refuse_what_cannot_run(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_several_workers_free_the_admin_port() -> None:
    """With more than one worker ace-extproc has no admin API (9091): worker 1's
    metrics port may take it (the default values do)."""
    assert one(render({"extproc": {"workers": 2}}), "Deployment")


def test_names_flags_and_envoy_s_workers() -> None:
    docs = render(
        {
            "fullnameOverride": "router",
            "envoy": {"concurrency": 4, "extraArgs": ["--component-log-level", "ext_proc:debug"]},
            "extproc": {"extraArgs": ["--metrics-listen", "0.0.0.0:9090"]},
        }
    )
    validate_all(docs)
    assert one(docs, "Deployment")["metadata"]["name"] == "router"
    assert one(docs, "Service")["metadata"]["name"] == "router"
    envoy_args = containers(docs)["envoy"]["args"]
    assert envoy_args[envoy_args.index("--concurrency") + 1] == "4"
    assert envoy_args[-2:] == ["--component-log-level", "ext_proc:debug"]
    assert containers(docs)["ace-extproc"]["args"][-2:] == ["--metrics-listen", "0.0.0.0:9090"]
    default = containers(render())["envoy"]["args"]
    assert default[default.index("--concurrency") + 1] == "2"  # not one per node CPU


def test_the_chart_names_the_kubernetes_it_needs() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.23.0-0"
    major, minor = (int(x) for x in KUBERNETES.split(".")[:2])
    assert (major, minor) >= (1, 23)  # the schemas the tests validate against satisfy it


def test_extra_args_reach_a_server_that_accepts_them(tmp_path: Path) -> None:
    import argparse

    from ace_extproc import server

    docs = render({"extproc": {"extraArgs": ["--metrics-listen", "0.0.0.0:9090"]}})
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(one(docs, "ConfigMap")["data"]["fleet.yaml"])
    args = containers(docs)["ace-extproc"]["args"]
    server.load_config(
        parser.parse_args([str(fleet) if a.startswith("/etc/ace/") else a for a in args[1:]])
    )


@pytest.mark.envoy
def test_envoy_s_stats_listener_serves_only_its_prometheus_stats(tmp_path: Path) -> None:
    """The init container's bootstrap, run by the real Envoy: the stats listener
    answers /stats/prometheus (Envoy's own series, the fail-open counter's family among
    them) and nothing else of the admin (no /config_dump, no /quitquitquit)."""
    import subprocess
    import time
    import urllib.error
    import urllib.request

    from ace_extproc.stack import envoy_binary
    from tests.conftest import free_port
    from tests.test_chart import run_envoy_config

    stats = free_port()
    admin = free_port()
    docs = render({"envoy": {"statsPort": stats}, "ports": {"http": free_port()}})
    init = containers(docs)["envoy-config"]
    init["args"][init["args"].index("--admin") + 1] = f"127.0.0.1:{admin}"
    bootstrap = run_envoy_config(docs, tmp_path)
    (listener,) = [
        x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "envoy_stats"
    ]
    assert listener["address"]["socket_address"]["port_value"] == stats
    proc = subprocess.Popen(
        [
            envoy_binary(),
            "-c",
            str(tmp_path / "envoy.yaml"),
            "--disable-hot-restart",
            "-l",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{stats}/stats/prometheus", timeout=2
                ) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "envoy did not start"
                time.sleep(0.1)
        assert "# TYPE envoy_server_live gauge" in text
        assert "envoy_http_ace_ext_proc" in text or "envoy_cluster_upstream_cx_total" in text
        for path in ("/config_dump", "/quitquitquit", "/stats"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(
                    urllib.request.Request(f"http://127.0.0.1:{stats}{path}", method="POST"),
                    timeout=2,
                )
            assert refused.value.code == 404
        assert proc.poll() is None  # still running: /quitquitquit never reached the admin
    finally:
        proc.terminate()
        proc.wait(10)


def test_ace_extproc_s_graceful_stop_is_the_chart_s(tmp_path: Path) -> None:
    """SIGTERM gives streams router.shutdown_grace_s (server.py): the chart sets it from
    drain.shutdownGraceSeconds with its own Envoy, and from drain.timeoutSeconds where
    another gateway's streams last as long as their generations."""
    from ace_extproc import config as cfg

    def grace(values: dict[str, Any]) -> float:
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(one(render(values), "ConfigMap")["data"]["fleet.yaml"])
        return cfg.load(fleet, env={}).settings.shutdown_grace_s

    assert grace({"drain": {"shutdownGraceSeconds": 20}}) == 20
    picker = {
        "mode": "endpoint-picker",
        "inferencePool": {"selector": {"app": "vllm"}},
        "networkPolicy": {"grpcFrom": [{"podSelector": {}}]},
        "drain": {"timeoutSeconds": 600},
        "terminationGracePeriodSeconds": 700,
    }
    assert grace(picker) == 600
