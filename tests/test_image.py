"""The image's build, checked without a Docker engine: the Dockerfile's stages and
layers, the pinned dependencies it installs through, and what `make up` installs."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _instructions() -> list[tuple[str, str]]:
    """(instruction, its arguments) of the Dockerfile, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in _instructions():
        if word == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        current.append((word, rest))
    return stages


def _lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"requirements.lock: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def test_wheels_are_built_in_a_stage_and_never_copied_into_the_image() -> None:
    stages = _stages()
    assert set(stages) == {"build", "runtime"}
    runtime = stages["runtime"]
    assert not [rest for word, rest in runtime if word in {"COPY", "ADD"} and "wheel" in rest]
    installs = [rest for word, rest in runtime if word == "RUN" and "pip install" in rest]
    assert installs
    for rest in installs:  # each from the builder's wheels, mounted for that RUN only
        assert "--mount=type=bind,from=build" in rest and "--no-index" in rest


def test_the_dependency_layer_is_built_before_the_source_is_copied() -> None:
    build = _stages()["build"]
    copies = [i for i, (word, _) in enumerate(build) if word == "COPY"]
    deps = next(
        i for i, (w, rest) in enumerate(build) if w == "RUN" and "requirements.lock" in rest
    )
    assert build[copies[0]][1] == "requirements.lock ./"
    assert copies[0] < deps < copies[1]  # nothing but the lock before the dependencies
    assert "--no-deps" in build[-1][1] and "pip wheel" in build[-1][1]  # then the package


def test_the_lock_pins_every_runtime_dependency_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _lock()
    for line in project["dependencies"] + project["optional-dependencies"]["envoy"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements.lock does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (line, pins[name])


@pytest.mark.parametrize(("target", "extra"), [("up", "envoy"), ("test", "test")])
def test_make_installs_only_what_the_target_needs(tmp_path: Path, target: str, extra: str) -> None:
    out = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    installs = [line for line in out.stdout.splitlines() if "pip install" in line and "-e" in line]
    assert installs == [installs[0]] and installs[0].endswith(f"-e '.[{extra}]'")
