"""The chart's modes (``mode``): each renders, validates against the Kubernetes
schemas and its kinds' CRDs (``tests/crds/``), has a negative case that fails, and
what ace-extproc is given loads; where a mode yields Envoy configuration (Istio's
EnvoyFilter patch), the real Envoy validates it."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from ace_extproc import config as cfg
from ace_extproc import envoy_config, server
from tests import crd_schema
from tests.conftest import envoy_validate
from tests.test_chart import Manifest, containers, fleet_file, one, render
from tests.test_chart_ops import validate_all

GATEWAY_PODS = [{"podSelector": {"matchLabels": {"istio": "ingressgateway"}}}]
MODES: dict[str, dict[str, Any]] = {
    "gateway": {},
    "endpoint-picker": {
        "mode": "endpoint-picker",
        "inferencePool": {"selector": {"app": "vllm-llama"}},
        "networkPolicy": {"grpcFrom": GATEWAY_PODS},
    },
    "extension": {
        "mode": "extension",
        "extension": {
            "targetRefs": [
                {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "llm"}
            ]
        },
        "networkPolicy": {"grpcFrom": GATEWAY_PODS},
    },
    "istio": {
        "mode": "istio",
        "istio": {"workloadSelector": {"istio": "ingressgateway"}, "namespace": "istio-system"},
        "networkPolicy": {"grpcFrom": GATEWAY_PODS},
    },
    "istio-pool": {
        "mode": "istio",
        "istio": {"path": "inferencePool"},
        "inferencePool": {"selector": {"app": "vllm-llama"}},
        "networkPolicy": {"grpcFrom": GATEWAY_PODS},
    },
}
# The kinds beyond the shared ones each mode adds.
MODE_KINDS = {
    "gateway": set(),
    "endpoint-picker": {"InferencePool"},
    "extension": {"EnvoyExtensionPolicy", "BackendTrafficPolicy"},
    "istio": {"EnvoyFilter"},  # one path or the other, never both (each would ask)
    "istio-pool": {"InferencePool"},
}
EXT_PROC_HOST = "gw-ace-extproc.gateway.svc.cluster.local"
TYPES = "type.googleapis.com/envoy.extensions"
HCM = f"{TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_renders_valid_manifests(mode: str) -> None:
    docs = render(MODES[mode])
    validate_all(docs)
    kinds = {d["kind"] for d in docs}
    for other, extra in MODE_KINDS.items():
        assert extra <= kinds if other == mode else not (extra - MODE_KINDS[mode]) & kinds


@pytest.mark.parametrize("mode", [m for m in MODES if m != "gateway"])
def test_outside_gateway_mode_ace_extproc_stands_alone_on_a_grpc_service(
    mode: str, tmp_path: Path
) -> None:
    docs = render(MODES[mode])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["ace-extproc"]
    assert "initContainers" not in pod
    (grpc,) = [p for p in one(docs, "Service")["spec"]["ports"] if p["name"] == "grpc"]
    assert (grpc["port"], grpc["targetPort"]) == (50051, "grpc")
    extproc = containers(docs)["ace-extproc"]
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in extproc["ports"]
    # What it is given, it accepts: listening on the pod's address, asking no token.
    fleet = fleet_file(docs, tmp_path)
    config = cfg.load(fleet, env={})
    assert config.settings.listen == "0.0.0.0:50051" and config.settings.uds is None
    assert config.settings.require_peer_token is False
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = [str(fleet) if a == "/etc/ace/fleet.yaml" else a for a in extproc["args"][1:]]
    server.load_config(parser.parse_args(args))
    # ... and only the gateway's pods may dial it.
    policy = one(docs, "NetworkPolicy")
    (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 50051]
    assert rule["from"] == GATEWAY_PODS


@pytest.mark.parametrize("mode", ["endpoint-picker", "istio-pool"])
def test_the_inference_pool_points_at_ace_extproc(mode: str) -> None:
    docs = render(MODES[mode])
    pool = one(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service")
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert ref["failureMode"] == "FailOpen"
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm-llama"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]


def test_the_extension_policy_dials_the_service() -> None:
    docs = render(MODES["extension"])
    (ext,) = one(docs, "EnvoyExtensionPolicy")["spec"]["extProc"]
    assert ext["backendRefs"] == [{"name": "gw-ace-extproc", "port": 50051}]
    assert ext["processingMode"]["request"] == {"body": "Buffered"}
    assert ext["messageTimeout"] == "1000ms"
    assert "envoy.lb" in ext["metadata"]["writableNamespaces"]
    duplex = render({**MODES["extension"], "envoy": {"processingMode": "full_duplex"}})
    (ext,) = one(duplex, "EnvoyExtensionPolicy")["spec"]["extProc"]
    assert ext["processingMode"]["request"] == {"body": "FullDuplexStreamed"}


@pytest.mark.parametrize(
    ("mode", "kind", "path", "value"),
    [
        (
            "endpoint-picker",
            "InferencePool",
            ["spec", "endpointPickerRef", "failureMode"],
            "Sometimes",
        ),
        ("endpoint-picker", "InferencePool", ["spec", "targetPorts"], []),
        (
            "extension",
            "EnvoyExtensionPolicy",
            ["spec", "extProc", 0, "processingMode", "request", "body"],
            "Whole",
        ),
        ("extension", "EnvoyExtensionPolicy", ["spec", "extProc", 0, "failOpn"], True),
        ("istio", "EnvoyFilter", ["spec", "configPatches", 0, "patch", "operation"], "SQUEEZE_IN"),
        ("istio", "EnvoyFilter", ["spec", "configPatches", 0, "match", "context"], "EVERYWHERE"),
    ],
)
def test_each_mode_s_crd_check_bites(mode: str, kind: str, path: list[Any], value: Any) -> None:
    crd_schema.assert_refused(one(render(MODES[mode]), kind), path, value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"mode": "endpoint-picker", "networkPolicy": {"grpcFrom": GATEWAY_PODS}},
            "inferencePool.selector",
        ),
        (
            {"mode": "extension", "networkPolicy": {"grpcFrom": GATEWAY_PODS}},
            "extension.targetRefs",
        ),
        ({"mode": "istio", "networkPolicy": {"grpcFrom": GATEWAY_PODS}}, "istio.workloadSelector"),
        (
            {
                "mode": "istio",
                "istio": {"path": "inferencePool"},
                "networkPolicy": {"grpcFrom": GATEWAY_PODS},
            },
            "inferencePool.selector",
        ),
        ({**MODES["endpoint-picker"], "networkPolicy": {}}, "set networkPolicy.grpcFrom"),
        ({"mode": "sidecar"}, "at '/mode'"),
    ],
)
def test_a_mode_missing_what_it_needs_fails_saying_what(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


# ------------------------------------------------------------------ Istio's patch, in Envoy


def _bootstrap_with(filter_: Manifest, cluster: str) -> Manifest:
    """A minimal bootstrap as Istio's gateway has it where the patch lands: an HTTP
    connection manager whose filters are the patch's then the router, and the cluster
    Istio makes for ace-extproc's Service (HTTP/2)."""
    hcm = {
        "@type": HCM,
        "stat_prefix": "ingress",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}],
                }
            ]
        },
        "http_filters": [
            filter_,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": cluster,
                    "type": "STRICT_DNS",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        HTTP_OPTIONS: {
                            "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": cluster,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "localhost",
                                                    "port_value": 50051,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        }
    }


@pytest.mark.envoy
@pytest.mark.parametrize("processing", ["buffered", "full_duplex"])
def test_the_envoy_filter_s_patch_is_what_envoy_runs(processing: str, tmp_path: Path) -> None:
    docs = render({**MODES["istio"], "envoy": {"processingMode": processing}})
    envoy_filter = one(docs, "EnvoyFilter")
    assert envoy_filter["metadata"]["namespace"] == "istio-system"
    (patch,) = envoy_filter["spec"]["configPatches"]
    assert patch["match"]["context"] == "GATEWAY"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    value = patch["patch"]["value"]
    config = value["typed_config"]
    # Istio's name for the Service's cluster: outbound|port||host.
    cluster = config["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert cluster == f"outbound|50051||{EXT_PROC_HOST}"
    # As ace-extproc's own Envoy is configured (envoy_config.py), token aside.
    assert config["processing_mode"] == envoy_config.PROCESSING_MODES[processing]
    assert config["metadata_options"]["receiving_namespaces"]["untyped"] == list(
        envoy_config.METADATA_NAMESPACES
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(_bootstrap_with(value, cluster)))
    envoy_validate(path)


@pytest.mark.envoy
def test_envoy_refuses_a_broken_patch(tmp_path: Path) -> None:
    """The negative case: the check above bites on what Envoy refuses."""
    (patch,) = one(render(MODES["istio"]), "EnvoyFilter")["spec"]["configPatches"]
    value = copy.deepcopy(patch["patch"]["value"])
    value["typed_config"]["processing_mode"]["request_body_mode"] = "WHOLE"
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(_bootstrap_with(value, "c")))
    with pytest.raises(AssertionError, match="envoy rejected"):
        envoy_validate(path)


# ------------------------------------------------------------------ the pool modes' picker

POOL_DESTINATION = [{"id": "llama", "models": ["llama"]}]  # says nowhere where its pods are


@pytest.mark.parametrize("mode", ["endpoint-picker", "istio-pool"])
def test_a_pool_mode_makes_ace_extproc_the_pool_s_endpoint_picker(
    mode: str, tmp_path: Path
) -> None:
    """What the InferencePool asks is GIE's endpoint picker: TLS (self-signed), endpoint
    mode, and the pool's own pods found by label, with the pods API granted."""
    docs = render({**MODES[mode], "destinations": POOL_DESTINATION}, namespace="serving")
    config = cfg.load(fleet_file(docs, tmp_path), env={})
    picker = config.settings.endpoint_picker
    assert picker is not None and picker.secure_serving and not picker.cert_file
    assert config.settings.upstream_mode == "endpoint"
    (destination,) = config.fleet.destinations
    discovery = destination.discovery
    assert discovery is not None and discovery.type == "kubernetes-pods"
    assert (discovery.namespace, dict(discovery.selector), discovery.port) == (
        "serving",
        {"app": "vllm-llama"},
        8000,
    )
    roles = [
        d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "gw-ace-extproc-pods"
    ]
    assert [r["metadata"]["namespace"] for r in roles] == ["serving"]
    assert roles[0]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    validate_all(docs)


def test_the_picker_s_certificate_from_a_secret_and_tls_off(tmp_path: Path) -> None:
    values = {
        **MODES["endpoint-picker"],
        "endpointPicker": {"tls": {"existingSecret": "epp-cert"}, "fallbacks": True},
    }
    docs = render(values)
    picker = cfg.load(fleet_file(docs, tmp_path), env={}).settings.endpoint_picker
    assert picker is not None and picker.fallbacks
    assert (picker.cert_file, picker.key_file) == (
        "/etc/ace-epp-tls/tls.crt",
        "/etc/ace-epp-tls/tls.key",
    )
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "epp-tls"]
    assert volume["secret"]["secretName"] == "epp-cert"
    mounts = containers(docs)["ace-extproc"]["volumeMounts"]
    assert {"name": "epp-tls", "mountPath": "/etc/ace-epp-tls", "readOnly": True} in mounts
    validate_all(docs)
    plain = render({**MODES["endpoint-picker"], "endpointPicker": {"tls": {"enabled": False}}})
    picker = cfg.load(fleet_file(plain, tmp_path), env={}).settings.endpoint_picker
    assert picker is not None and not picker.secure_serving
    assert not [
        v
        for v in one(plain, "Deployment")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "epp-tls"
    ]


def test_outside_the_pool_modes_no_endpoint_picker_and_destinations_as_given(
    tmp_path: Path,
) -> None:
    for mode in ("gateway", "extension", "istio"):
        docs = render(MODES[mode])
        config = cfg.load(fleet_file(docs, tmp_path), env={})
        assert config.settings.endpoint_picker is None, mode
        assert not [d for d in docs if d["metadata"]["name"].endswith("-pods")], mode
    with pytest.raises(helm.HelmError, match="endpointPicker"):
        render({**MODES["endpoint-picker"], "endpointPicker": {"tls": {"secret": "x"}}})


# ------------------------------------------------------------------ Envoy Gateway's pinning


def test_extension_mode_pins_through_a_backend_traffic_policy(tmp_path: Path) -> None:
    """Envoy Gateway balances the route's backend itself: the BackendTrafficPolicy on the
    same targets takes the endpoint ace-extproc names, and ace-extproc names pods as
    ip:port (endpoint mode)."""
    docs = render(MODES["extension"])
    btp = one(docs, "BackendTrafficPolicy")["spec"]
    assert btp["targetRefs"] == MODES["extension"]["extension"]["targetRefs"]
    assert btp["loadBalancer"] == {
        "type": "LeastRequest",
        "endpointOverride": {"extractFrom": [{"header": envoy_config.GIE_HEADER}]},
    }
    assert cfg.load(fleet_file(docs, tmp_path), env={}).settings.upstream_mode == "endpoint"
    validate_all(docs)  # the CRD vendored from envoyproxy/gateway
    crd_schema.assert_refused(
        one(docs, "BackendTrafficPolicy"),
        ["spec", "loadBalancer", "endpointOverride", "extractFrm"],
        [{"header": "x"}],
    )
    off = render(
        {
            **MODES["extension"],
            "extension": {**MODES["extension"]["extension"], "endpointOverride": False},
        }
    )
    assert not [d for d in off if d["kind"] == "BackendTrafficPolicy"]
    with pytest.raises(helm.HelmError, match="destination llama needs discovery"):
        render({**MODES["extension"], "destinations": POOL_DESTINATION})
