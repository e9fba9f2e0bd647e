"""`ace-extproc ctl` against a running stack: draining a pod through the admin API
sends it no new request through Envoy (its own conversations move), undraining
brings it back, its index kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_e2e import conversation, options, running

pytestmark = pytest.mark.envoy


def ctl(admin: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ace_extproc.cli", "ctl", "--admin", admin, *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_ctl_drains_a_pod_so_it_gets_no_new_requests() -> None:
    with running(options()) as client:
        admin = client.stack.options.admin_api
        assert admin is not None
        homes = {}
        for i in range(12):
            status, headers, _ = client.chat(conversation(0, f"drain-{i}"))
            assert status == 200
            homes[i] = headers["x-sim-pod"]
        victim = homes[0]
        done = ctl(admin, "drain", f"sim/{victim}")
        assert done.returncode == 0, done.stderr
        pods = {p["key"]: p for p in json.loads(ctl(admin, "--json", "pods").stdout)["pods"]}
        assert pods[f"sim/{victim}"]["state"] == "draining"
        served = []
        for turn in (1, 2):
            for i in range(12):
                status, headers, _ = client.chat(conversation(turn, f"drain-{i}"))
                assert status == 200
                served.append(headers["x-sim-pod"])
        for i in range(12, 30):  # new conversations too
            status, headers, _ = client.chat(conversation(0, f"drain-{i}"))
            served.append(headers["x-sim-pod"])
        assert victim not in served
        # Undrained, it takes new prefixes again (its share by rendezvous), and its
        # index was kept while drained.
        assert ctl(admin, "undrain", f"sim/{victim}").returncode == 0
        pods = {p["key"]: p for p in json.loads(ctl(admin, "--json", "pods").stdout)["pods"]}
        assert pods[f"sim/{victim}"]["state"] == "healthy"
        assert pods[f"sim/{victim}"]["index"]["blocks_held"] > 0
        again = [client.chat(conversation(0, f"back-{i}"))[1]["x-sim-pod"] for i in range(20)]
        assert victim in again
        # An unknown pod is refused, with one line and a non-zero status.
        bad = ctl(admin, "drain", "sim/no-such-pod")
        assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
