"""The example engine pods (``charts/engine``, ``examples/vllm.yaml`` and
``examples/sglang.yaml``): valid Kubernetes, a GPU asked for, a startup probe that
waits for the model, the flags ace-extproc depends on, and ace-extproc's example
values finding them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from ace_extproc import config as cfg
from tests.test_chart import CHART, KUBERNETES, Manifest, one, render

ENGINE = CHART.parent / "engine"
# Each engine's flags ace-extproc depends on (docs/engines.md says what each is for).
FLAGS = {
    "vllm": ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config"],
    "sglang": ["--enable-metrics", "--enable-cache-report", "--page-size"],
}


def render_engine(values: dict[str, Any], name: str = "llama") -> list[Manifest]:
    with helm.Chart.load(str(ENGINE)) as chart:
        out = chart.render(values, name=name, namespace="inference")
    return [d for text in out.values() for d in yaml.safe_load_all(text) if d]


def example(engine: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((ENGINE / "examples" / f"{engine}.yaml").read_text())
    return values


@pytest.mark.parametrize("engine", list(FLAGS))
def test_the_engine_examples_are_valid_pods_with_the_flags(engine: str) -> None:
    docs = render_engine(example(engine))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    flags = {a.split("=")[0] for a in container["args"]}
    assert set(FLAGS[engine]) <= flags
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600  # minutes to load
    service = one(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"  # Envoy resolves every pod


def test_vllm_s_kv_events_config_is_json_naming_the_declared_ports() -> None:
    import json

    docs = render_engine(example("vllm"))
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    config = json.loads(args[args.index("--kv-events-config") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config["enable_kv_cache_events"] is True
    assert config["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert config["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"


@pytest.mark.parametrize("name", ["vllm-gateway", "vllm-endpoint-picker"])
def test_ace_extproc_s_examples_find_the_engine_pods(name: str, tmp_path: Path) -> None:
    engine = render_engine(example("vllm"))
    values = yaml.safe_load((CHART / "examples" / f"{name}.yaml").read_text())
    docs = render(values)
    for doc in docs:
        if doc["apiVersion"].startswith("inference.networking.k8s.io/"):
            continue  # checked against its CRD in test_chart_modes
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(one(docs, "ConfigMap")["data"]["fleet.yaml"])
    (destination,) = cfg.load(fleet, env={}).fleet.destinations
    discovery = values["destinations"][0]["discovery"]
    service = one(engine, "Service")
    assert discovery["service"] == service["metadata"]["name"]
    assert discovery["port"] == service["spec"]["ports"][0]["port"]
    assert destination.id == "llama"
    pool = [d for d in docs if d["kind"] == "InferencePool"]
    pod_labels = one(engine, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for p in pool:
        assert p["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**example("vllm"), "gpu": 1}, "additional properties|gpu"),
        ({**example("vllm"), "args": []}, "args: the engine's command line is needed"),
    ],
)
def test_the_engine_chart_refuses(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render_engine(values)
