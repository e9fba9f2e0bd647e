"""What ace-extproc learns from the real engines' /metrics: the KV cache size that
bounds its index, the load it did not send itself, and each pod's pace."""

from __future__ import annotations

import asyncio
import math
import re
import time

from ace_extproc import vllm_pods
from ace_extproc.latency import get_model
from ace_extproc.vllm_pods import Pods
from tests.engines.conftest import KV_BLOCKS, document, front, get_text, metric, post, usage


def test_the_index_is_sized_from_the_engines_cache_config_info(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    engine = loop.run_until_complete(get_text(f"{pods.urls[0]}/metrics"))
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", engine, re.M)
    assert info is not None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert int(labels["num_gpu_blocks"]) == KV_BLOCKS  # the size the servers were given
    tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    with front(pods, loop) as ace:
        s = ace.stack.config.settings  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while True:
            text = ace.metrics()
            try:
                learned = metric(text, "ace_pod_kv_capacity_tokens", pod="pod-0")
                break
            except KeyError:
                assert time.monotonic() < deadline, "the KV size was never scraped"
                time.sleep(0.2)
        assert learned == tokens
        entries = metric(text, "ace_index_pod_capacity_entries", pod="pod-0")
        assert entries == int(tokens * s.bytes_per_token / s.block_bytes)
        assert entries != s.index_blocks_per_pod  # learned, not the default


def test_load_the_router_did_not_send_is_read_from_the_engines_metrics(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    """Requests sent to pod-0 directly, past the router, still show as pod-0's load."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count slowly"}],
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    with front(pods, loop) as ace:

        async def scenario() -> tuple[float, float]:
            direct = [
                asyncio.ensure_future(post(pods.urls[0], "/v1/chat/completions", body))
                for _ in range(4)
            ]
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    text = await get_text(ace.metrics_url)
                    busy = metric(text, "ace_pod_running_requests", pod="pod-0")
                    if busy >= 4:
                        return busy, metric(text, "ace_pod_running_requests", pod="pod-1")
                    await asyncio.sleep(0.1)
                raise AssertionError("pod-0's running requests never reached 4")
            finally:
                for task in direct:
                    task.cancel()
                await asyncio.gather(*direct, return_exceptions=True)

        busy, idle = ace.run(scenario())
    assert busy >= 4 and idle == 0


def test_short_requests_avoid_the_pod_of_a_long_prompt_its_gauges_do_not_count_yet(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    """vLLM counts a request in ``num_requests_running`` only once its API server has
    tokenized it (bench.gauge_lag: 0.13-0.28 s for 30K tokens on an idle pod), so the
    scrapes in between read that pod idle. Short requests sent then must still see the
    long prompt queued there and go to the other pod (before routing/load.py kept a pick
    counted through such readings, they went by their keys: half of them onto it).

    The short ones are sent together, all within the long prompt's modelled TTFT: the
    router keeps a pick counted that long, and on a machine slower than the model's
    calibration the real prefill outlasts it (docs/routing.md, load and health), so
    short requests sent one after another could outlast it too and test the
    calibration, not the gauges' lag."""
    long_body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": document("gauge-lag", repeats=1500)}],
        "max_tokens": 2,
    }

    async def short(i: int, url: str) -> str:
        # Each its own first block, so each has its own key (rendezvous order).
        text = f"{i}-{i * 7919}: a short question of its own. " * 40
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        status, headers, answer = await post(url, "/v1/chat/completions", body)
        assert status == 200, answer
        return headers["x-ace-served-by"]

    with front(pods, loop) as ace:

        async def scenario() -> tuple[str, list[str]]:
            slow = asyncio.ensure_future(post(ace.url, "/v1/chat/completions", long_body))
            await asyncio.sleep(0.15)  # picked, and a scrape or two read its pod idle
            served = await asyncio.gather(*(short(i, ace.url) for i in range(6)))
            status, headers, answer = await slow
            assert status == 200, answer
            assert usage(answer)["prompt_tokens"] > 20_000
            return headers["x-ace-served-by"], served

        long_pod, short_pods = ace.run(scenario())
    assert long_pod not in short_pods, (long_pod, short_pods)


def test_requests_waiting_on_a_pod_the_router_prices_as_free_are_counted(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    """A pod busier than the router's estimate says (as one slower than its TTFT model
    is): a long prompt sent to pod-0 directly, past the router, and short ones behind it
    wait in its engine (vLLM's chunked prefill gives the long one each step's token
    budget), while the router's queued-prefill estimate for it is empty. Its scrapes
    count that (``ace_pod_underpriced_waits_total``); idle pod-1 counts nothing."""
    long_body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": document("underpriced", repeats=1500)}],
        "max_tokens": 2,
    }
    with front(pods, loop) as ace:

        async def scenario() -> tuple[float, float]:
            pod = pods.urls[0]
            long = asyncio.ensure_future(post(pod, "/v1/chat/completions", long_body))
            await asyncio.sleep(0.5)  # tokenized, and prefilling
            shorts = []
            for i in range(3):
                msgs = [{"role": "user", "content": f"{i}: a short one. " * 20}]
                body = {"model": "tiny", "messages": msgs, "max_tokens": 2}
                shorts.append(asyncio.ensure_future(post(pod, "/v1/chat/completions", body)))
            answers = await asyncio.gather(long, *shorts)
            assert all(status == 200 for status, _, _ in answers)
            text = await get_text(ace.metrics_url)
            return (
                metric(text, "ace_pod_underpriced_waits_total", pod="pod-0"),
                metric(text, "ace_pod_underpriced_waits_total", pod="pod-1"),
            )

        busy, idle = ace.run(scenario())
    assert busy >= 1 and idle == 0, (busy, idle)


def test_each_pods_pace_is_learned_from_the_engines_ttft_histogram(
    pods: Pods, loop: asyncio.AbstractEventLoop
) -> None:
    """Cold prompts sent one at a time through the router: each pod's pace moves from 1
    toward the ratio of the mean TTFT its engine reports (vllm:time_to_first_token_seconds,
    read from the engine directly here) to the mean the router predicted (the TTFT model
    at the prompt tokens it counted), and not past it; a pod that served nothing keeps 1."""
    model = get_model(vllm_pods.TTFT_MODEL)
    with front(pods, loop) as ace:

        async def scenario() -> dict[str, tuple[float, float]]:
            await _scraped(ace.metrics_url)
            before = [await get_text(f"{url}/metrics") for url in pods.urls]
            for i in range(8):
                msgs = [{"role": "user", "content": document(f"pace {i}", repeats=150)}]
                body = {"model": "tiny", "messages": msgs, "max_tokens": 2}
                status, _, _ = await post(ace.url, "/v1/chat/completions", body)
                assert status == 200
            await asyncio.sleep(0.5)  # a few scrapes
            after = [await get_text(f"{url}/metrics") for url in pods.urls]
            text = await get_text(ace.metrics_url)
            out = {}
            for n, pod in enumerate(("pod-0", "pod-1")):
                try:
                    picks = metric(text, "ace_picks_total", pod=pod)
                except KeyError:  # never picked
                    picks = 0.0
                pace = metric(text, "ace_pod_prefill_pace", pod=pod)
                if not picks:
                    out[pod] = (pace, 1.0)
                    continue
                counted = metric(text, "ace_estimated_prompt_tokens_total", pod=pod) / picks
                first = [_ttft(t) for t in (before[n], after[n])]
                served = first[1][0] - first[0][0]
                assert served == picks  # every first token counted, none other
                reported_ms = (first[1][1] - first[0][1]) / served * 1000
                out[pod] = (pace, reported_ms / model.ttft_ms(round(counted)))
            return out

        paces = ace.run(scenario())
    assert any(ratio != 1.0 for _, ratio in paces.values())  # some pod served
    for pod, (pace, ratio) in paces.items():
        if ratio == 1.0:
            assert pace == 1.0, pod
        elif abs(math.log(ratio)) > 0.1:
            # Moved toward the ratio, a part of the way, never past it.
            assert 0 < math.log(pace) / math.log(ratio) <= 1.0, (pod, pace, ratio)
        else:
            assert abs(math.log(pace)) <= 0.1, (pod, pace, ratio)


async def _scraped(metrics_url: str) -> None:
    """Once the router has scraped the pods (their KV size is its first news of them)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            metric(await get_text(metrics_url), "ace_pod_kv_capacity_tokens", pod="pod-1")
            metric(await get_text(metrics_url), "ace_pod_kv_capacity_tokens", pod="pod-0")
            return
        except KeyError:
            assert time.monotonic() < deadline, "the pods were never scraped"
            await asyncio.sleep(0.2)


def _ttft(engine_metrics: str) -> tuple[float, float]:
    """The engine's TTFT histogram: first tokens so far and their summed seconds."""
    return (
        metric(engine_metrics, "vllm:time_to_first_token_seconds_count"),
        metric(engine_metrics, "vllm:time_to_first_token_seconds_sum"),
    )
