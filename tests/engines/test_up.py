"""``ace-extproc up --engine vllm`` as a user runs it: real vLLM servers behind the same
``ready:`` line, a request through them, and Ctrl-C leaves no process behind (a vLLM
server's engine core included)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

from ace_extproc.vllm_pods import VllmOptions
from tests.conftest import alive, children, free_ports, up_command


def test_up_with_real_engines_serves_and_stops_cleanly(engines: VllmOptions) -> None:
    ports = free_ports(2)
    listen, argv, env = up_command(
        2, "--engine", "vllm", "--kv-blocks", "2048",
        "--metrics", f"127.0.0.1:{ports[0]}", "--admin-api", f"127.0.0.1:{ports[1]}",
    )  # fmt: skip
    argv.remove("--time-scale")
    argv.remove("0.001")
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until ready (or exit)
        assert line == f"ready: http://{listen}\n", proc.stderr.read() if proc.stderr else ""
        spawned = children(proc.pid)
        # Two API servers, each with its engine core (and worker), ace-extproc, Envoy.
        assert len(spawned) >= 6
        body = {
            "model": "sim-llama",  # the README's request, unchanged, reaches a real pod
            "messages": [{"role": "user", "content": "hello " * 200}],
        }
        answers = []
        for _ in range(2):
            req = urllib.request.Request(
                f"http://{listen}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
                answers.append((resp.headers["x-ace-pinned"], json.loads(resp.read())))
        (pod, first), (again, second) = answers
        assert pod == again and pod.startswith("vllm/pod-")
        assert first["model"] == "tiny"  # vLLM's own answer
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert first["usage"]["completion_tokens"] <= 16  # the model's default max_tokens
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in spawned) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in spawned if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
