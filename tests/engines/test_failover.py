"""A real engine killed under load: no request that had not started on it is lost."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ace_extproc.vllm_pods import Pods
from tests.engines.conftest import document, front, post


@dataclass
class Sent:
    started: float
    ended: float
    status: int
    served_by: str | None


def test_a_pod_killed_under_load_loses_only_requests_running_on_it(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    with front(pods, loop) as ace:

        async def client(c: int, n: int, out: list[Sent]) -> None:
            for i in range(n):
                body = {
                    "model": "tiny",
                    "messages": [
                        {"role": "system", "content": document(f"kill-{c}-{i % 4}", 40)},
                        {"role": "user", "content": f"question {i}"},
                    ],
                    "max_tokens": 4,
                }
                started = time.monotonic()
                try:
                    status, headers, _ = await post(ace.url, "/v1/chat/completions", body)
                    served = headers.get("x-ace-served-by")
                except OSError:
                    status, served = 0, None
                out.append(Sent(started, time.monotonic(), status, served))

        async def scenario() -> tuple[list[Sent], float]:
            sent: list[Sent] = []
            load = asyncio.gather(*(client(c, 30, sent) for c in range(4)))
            deadline = time.monotonic() + 30
            while {s.served_by for s in sent} != {"vllm/pod-0", "vllm/pod-1"}:
                assert time.monotonic() < deadline, "the load never reached both pods"
                await asyncio.sleep(0.05)
            killed_at = time.monotonic()
            await pods.kill(0)  # SIGKILL, as a crash
            await load
            return sent, killed_at

        sent, killed_at = ace.run(scenario())
    assert len(sent) == 120
    before = [s for s in sent if s.ended < killed_at]
    after = [s for s in sent if s.started > killed_at]
    assert before and after
    assert "vllm/pod-0" in {s.served_by for s in before}
    failed = [s for s in sent if s.status != 200]
    in_flight = [s for s in sent if s.started <= killed_at <= s.ended]
    # A failure can only be a request that was running when the pod died...
    assert all(s.started <= killed_at for s in failed), failed
    assert len(failed) <= len(in_flight)
    # ... and everything sent afterwards was answered, by the pod that lives.
    assert all(s.status == 200 and s.served_by == "vllm/pod-1" for s in after)
