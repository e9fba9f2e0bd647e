"""Write requirements.lock: the image's runtime dependencies (the package's own and
extra ``envoy``), each pinned with ``==`` to the version installed here, with everything
they need in turn. The Dockerfile installs through it (``pip install -c``).

    make lock        # after changing dependencies in pyproject.toml, in an installed venv

Reads installed metadata only: no network. Markers are evaluated for this interpreter
and platform, which must match the image's (CPython 3.11 on Linux)."""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("envoy",)
HEADER = """\
# The image's runtime dependencies, pinned (tools/lock_requirements.py; `make lock`).
# Generated from an installed environment: edit pyproject.toml, then regenerate.
"""


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def closure(roots: list[Requirement]) -> dict[str, str]:
    """Each distribution the roots need (markers evaluated here), by name: its version."""
    pinned: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        dist = metadata.distribution(req.name)  # PackageNotFoundError: not installed
        pinned[name] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            for wanted in req.extras or {""}:
                todo.append((sub, wanted))
    return pinned


def render() -> str:
    pins = closure(runtime_requirements())
    return HEADER + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def main() -> int:
    (ROOT / "requirements.lock").write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
