"""The sim engine's queueing and timing.  Timing checks use ``time_scale=0``
(simulated time only, deterministic) or lower bounds and orderings on wall time."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from ace_extproc.latency import get_model
from ace_extproc.sim.engine import CapacityError, Engine
from ace_extproc.sim.kvcache import PrefixCache

MODEL = get_model("llama-3.3-70b-fp8-tp4")


def make(
    *,
    blocks: int = 1024,
    time_scale: float = 0.0,
    tpot_ms: float = 20.0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> Engine:
    return Engine(
        MODEL,
        PrefixCache(block_size=16, num_gpu_blocks=blocks),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        time_scale=time_scale,
        tpot_ms=tpot_ms,
    )


def test_a_lone_request_gets_the_model_ttft() -> None:
    async def main() -> None:
        engine = make()
        prompt = list(range(1000))
        async with engine.generate(prompt, max_tokens=4) as req:
            assert req.ttft_s == pytest.approx(MODEL.ttft_ms(1000, 0) / 1000)
            assert engine.running == 1
            await engine.decode(req, 3)
        async with engine.generate([*prompt, 7], max_tokens=4) as warm:
            pass
        assert warm.cached_tokens == 992  # 62 full blocks
        assert warm.ttft_s == pytest.approx(MODEL.ttft_ms(1001 - 992, 992) / 1000)
        assert warm.ttft_s < req.ttft_s
        stats = engine.stats
        assert stats.prompt_tokens == 2001
        assert stats.cached_prompt_tokens == 992
        assert stats.generation_tokens == 4 + 1  # the second stopped after its first token
        assert stats.ttft.count == 2
        assert engine.running == 0 and engine.cache.used_blocks == 0

    asyncio.run(main())


def test_the_ttft_histogram_is_wall_clock_as_vllms_is() -> None:
    """On a pods' clock of 0.01 a request's simulated TTFT passes in a hundredth of the
    time, and the histogram a router learns pods' pace from says so."""

    async def main() -> None:
        engine = make(time_scale=0.01)
        async with engine.generate(list(range(1000)), max_tokens=1) as req:
            pass
        assert engine.stats.ttft.count == 1
        assert engine.stats.ttft.sum == pytest.approx(req.ttft_s * 0.01)
        instant = make(time_scale=0.0)
        async with instant.generate(list(range(1000)), max_tokens=1):
            pass
        assert instant.stats.ttft.sum == 0.0

    asyncio.run(main())


def test_concurrent_prefills_batch_and_later_ones_wait() -> None:
    async def main() -> None:
        engine = make(max_num_batched_tokens=1000)
        prompts = [list(range(i * 10_000, i * 10_000 + 600)) for i in range(3)]
        reqs = await asyncio.gather(*(engine.start(p, max_tokens=1) for p in prompts))
        # 600 + 600 > 1000: each prompt is its own batch, and each waits for those ahead.
        one = MODEL.ttft_ms(600) / 1000
        assert [r.ttft_s for r in reqs] == pytest.approx([one, 2 * one, 3 * one])
        for r in reqs:
            engine.finish(r)

        engine = make()  # default budget 8192: the three share one batch
        reqs = await asyncio.gather(*(engine.start(p, max_tokens=1) for p in prompts))
        batch = engine.batch_ms([(600, 0)] * 3) / 1000
        assert [r.ttft_s for r in reqs] == pytest.approx([batch] * 3)
        assert MODEL.ttft_ms(600) / 1000 < batch < 3 * MODEL.ttft_ms(600) / 1000

    asyncio.run(main())


def test_sleeps_scale_with_time_scale() -> None:
    async def timed(scale: float) -> float:
        engine = make(time_scale=scale, tpot_ms=20.0)
        begin = time.perf_counter()
        async with engine.generate(list(range(2000)), max_tokens=5) as req:
            await engine.decode(req, 4)
        return time.perf_counter() - begin

    model_s = (MODEL.ttft_ms(2000) + 4 * 20.0) / 1000
    fast = asyncio.run(timed(0.0))
    slow = asyncio.run(timed(0.2))
    assert slow >= 0.2 * model_s * 0.9  # never returns before the scaled sleeps
    assert slow > fast


def test_max_num_seqs_queues_fifo() -> None:
    async def main() -> None:
        engine = make(max_num_seqs=1)
        order: list[int] = []
        first = await engine.start([1] * 20, max_tokens=1)

        async def later(i: int) -> None:
            async with engine.generate([i] * 20, max_tokens=1):
                order.append(i)

        tasks = [asyncio.create_task(later(i)) for i in (2, 3)]
        await asyncio.sleep(0.01)
        assert (engine.running, engine.waiting) == (1, 2)
        engine.finish(first)
        await asyncio.gather(*tasks)
        assert order == [2, 3]
        assert (engine.running, engine.waiting) == (0, 0)

    asyncio.run(main())


def test_waits_for_kv_blocks_and_rejects_what_never_fits() -> None:
    async def main() -> None:
        engine = make(blocks=4)  # 64 tokens of KV
        with pytest.raises(CapacityError):
            engine.check(60, 5)
        first = await engine.start(list(range(40)), max_tokens=8)  # 3 blocks
        second = asyncio.create_task(engine.start(list(range(100, 140)), max_tokens=8))
        await asyncio.sleep(0.01)
        assert engine.waiting == 1 and not second.done()
        engine.finish(first)
        req = await second
        assert engine.running == 1 and engine.waiting == 0
        engine.finish(req)

    asyncio.run(main())


def test_cancelled_requests_leak_nothing() -> None:
    async def main() -> None:
        engine = make(max_num_seqs=1, time_scale=1.0)
        slow = asyncio.create_task(engine.start(list(range(10_000)), max_tokens=1))
        await asyncio.sleep(0.01)  # admitted, in its (long) prefill
        queued = asyncio.create_task(engine.start([1, 2, 3], max_tokens=1))
        await asyncio.sleep(0.01)
        assert (engine.running, engine.waiting) == (1, 1)
        queued.cancel()
        slow.cancel()
        await asyncio.gather(slow, queued, return_exceptions=True)
        assert (engine.running, engine.waiting) == (0, 0)
        assert engine.cache.used_blocks == 0
        assert engine.stats.finished == {"abort": 1}

    asyncio.run(main())


def test_the_gauges_count_a_request_once_the_server_has_read_it() -> None:
    """A real vLLM's gauges count a request only once its API server has tokenized it
    (bench/gauge_lag.py); the sim's do too, for the server's share of its prompt."""

    async def main() -> None:
        slow_server = dataclasses.replace(MODEL, t0_ms=10.0, token_ms=0.02)
        engine = Engine(
            slow_server, PrefixCache(block_size=16, num_gpu_blocks=4096), time_scale=1.0
        )
        long = asyncio.create_task(engine.start(list(range(20_000)), max_tokens=1))
        await asyncio.sleep(0.05)  # its server share: 10 + 0.02 * 20,000 = 410 ms
        assert engine.running == 1  # admitted, and prefilling in the engine's timing
        assert engine.gauges() == (0, 0)  # but not reported yet
        short = asyncio.create_task(engine.start(list(range(30_000, 30_100)), max_tokens=1))
        await asyncio.sleep(0.1)  # the short one's share (12 ms) has passed, not the long's
        assert engine.gauges() == (1, 0)
        await asyncio.sleep(0.45)  # both read; the long one's prefill runs past 1 s
        assert engine.gauges() == (2, 0)
        for req in await asyncio.gather(long, short):
            engine.finish(req)
        assert engine.gauges() == (0, 0)

    asyncio.run(main())


def test_a_request_cancelled_before_admission_leaves_the_gauges() -> None:
    async def main() -> None:
        slow_server = dataclasses.replace(MODEL, t0_ms=200.0)
        engine = Engine(
            slow_server,
            PrefixCache(block_size=16, num_gpu_blocks=4096),
            time_scale=1.0,
            max_num_seqs=1,
        )
        first = asyncio.create_task(engine.start(list(range(100)), max_tokens=1))
        await asyncio.sleep(0)
        queued = asyncio.create_task(engine.start(list(range(1000, 1100)), max_tokens=1))
        await asyncio.sleep(0.01)
        assert (engine.running, engine.waiting) == (1, 1)
        assert engine.gauges() == (0, 0)  # neither read yet (200 ms each)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert engine.waiting == 0 and engine.gauges() == (0, 0)  # not -1 waiting
        engine.finish(await first)

    asyncio.run(main())
