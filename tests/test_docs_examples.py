"""The fleet examples the docs give load, and Envoy's bootstrap renders from them, as
the chart's init container (`ace-extproc envoy-config`) renders it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_yaml_block(doc: Path, heading: str) -> str:
    text = doc.read_text()
    section = text[text.index(heading) :]
    found = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert found, f"{doc}: no yaml example under {heading!r}"
    return found.group(1)


def _envoy_config(fleet: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet)
    argv = [sys.executable, "-m", "ace_extproc.cli", "envoy-config", "--fleet", str(path)]
    argv += ["--output", str(tmp_path / "envoy.yaml")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_the_discovery_example_renders_envoy_config(tmp_path: Path) -> None:
    example = _first_yaml_block(ROOT / "docs/routing.md", "## Discovery")
    out = _envoy_config(example, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "qwen-7b.inference.svc.cluster.local" in (tmp_path / "envoy.yaml").read_text()


def test_the_port_name_line_the_example_offers_renders_too(tmp_path: Path) -> None:
    """The commented-out ``port_name`` line, uncommented, keeps ``port`` beside it."""
    example = _first_yaml_block(ROOT / "docs/routing.md", "## Discovery")
    assert "# port_name: http" in example
    with_name = example.replace("# port_name: http", "port_name: http")
    out = _envoy_config(with_name, tmp_path)
    assert out.returncode == 0, out.stderr
