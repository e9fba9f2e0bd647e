"""docker-compose.yaml's `gpu` profile, checked without Docker: real vLLM servers with
every engine flag the product depends on (docs/engines.md#engine-flags), one GPU each,
the fleet file that names them, and the stack before them on its own port."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ace_extproc import config as cfg

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yaml"
# Each flag the product needs of a vLLM pod (the docs say what breaks without it).
VLLM_FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config")


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def _engines() -> dict[str, Any]:
    return {n: s for n, s in _services().items() if s["image"].startswith("vllm/vllm-openai:")}


def _flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(f"{name}="):
            return arg.partition("=")[2]
    raise AssertionError(f"{name} missing from {argv}")


def test_the_gpu_profile_runs_real_vllm_pods_with_the_flags_the_product_needs() -> None:
    engines = _engines()
    assert len(engines) >= 2
    for name, engine in engines.items():
        assert engine["profiles"] == ["gpu"], name
        argv = engine["command"]
        for flag in VLLM_FLAGS:
            assert any(a == flag or a.startswith(f"{flag}=") for a in argv), (name, flag)
        assert _flag(argv, "--port") == "8000"
        events = json.loads(_flag(argv, "--kv-events-config"))
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert events["endpoint"] == "tcp://*:5557" and events["topic"]
        (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    gpus = [
        e["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for e in engines.values()
    ]
    assert len({tuple(ids) for ids in gpus}) == len(gpus)  # one GPU each, not shared


def test_the_gpu_fleet_names_the_engines_and_their_event_ports() -> None:
    services = _services()
    serve = services["ace-extproc-gpu"]
    assert serve["profiles"] == ["gpu"]
    (mount,) = [m for m in serve["volumes"] if m.endswith(":/etc/ace/fleet.yaml:ro")]
    fleet = cfg.load(ROOT / mount.split(":")[0], env={}).fleet
    engines = _engines()
    assert {p.host for p in fleet.pods} == set(engines)
    for pod in fleet.pods:
        assert pod.port == 8000 and pod.kv_events == f"tcp://{pod.host}:5557"
    assert set(serve["depends_on"]) == set(engines)
    assert all(d["condition"] == "service_healthy" for d in serve["depends_on"].values())


def test_the_gpu_stack_has_its_own_port_config_and_envoy() -> None:
    services = _services()
    envoy, sim_envoy = services["envoy-gpu"], services["envoy"]
    assert envoy["profiles"] == ["gpu"] and "profiles" not in sim_envoy
    assert envoy["network_mode"] == "service:ace-extproc-gpu"
    assert "envoy-config-gpu" in envoy["depends_on"]
    ports = {p.split(":")[0] for p in services["ace-extproc-gpu"]["ports"]}
    assert not ports & {p.split(":")[0] for p in services["ace-extproc"]["ports"]}
    for service in (envoy, sim_envoy):  # never one worker per core of the node
        assert int(_flag(service["command"], "--concurrency").split(":-")[-1].rstrip("}")) >= 1


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="no docker compose here",
)
def test_docker_compose_accepts_the_gpu_profile() -> None:
    argv = ["docker", "compose", "-f", str(COMPOSE), "--profile", "gpu", "config", "-q"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_docs_say_what_breaks_without_each_flag() -> None:
    section = (ROOT / "docs/engines.md").read_text().split("## Engine flags", 1)[1]
    for flag in (*VLLM_FLAGS, "--block-size", "--enable-metrics", "--enable-cache-report"):
        assert f"| `{flag}" in section, flag
