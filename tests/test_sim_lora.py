"""LoRA adapters in the simulated engines: the slots (sim/lora.py), the HTTP pod's
flags and metric, and the fleet simulation's pods, which share the slots' code."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
import msgspec
import pytest

from ace_extproc.latency import get_model
from ace_extproc.routing import metrics_text
from ace_extproc.sim.app import SimConfig, SimServer, add_arguments, config_from_args
from ace_extproc.sim.engine import Engine
from ace_extproc.sim.kvcache import PrefixCache, text_block_keys
from ace_extproc.sim.lora import AdapterSlots
from bench.baselines import resolve
from bench.fleetsim import SimSettings, simulate
from bench.workloads.base import Request, Workload

MODEL = get_model("llama-3.3-70b-fp8-tp4")
LOAD_MS = 250.0


def test_slots_admit_up_to_max_loras_adapters_and_evict_the_least_recent_unused() -> None:
    clock = iter(range(100, 200))
    slots = AdapterSlots(2, LOAD_MS, clock=lambda: float(next(clock)))
    # As vLLM's gauge, which gets its first sample after a step: none before a request.
    assert slots.info_series() == []
    slots.stepped()
    assert slots.admit("a") == LOAD_MS and slots.admit("a") == 0.0
    assert slots.admit("b") == LOAD_MS
    assert not slots.admissible("c") and slots.admissible("a")  # two adapters run
    slots.release("a")
    assert not slots.admissible("c")  # "a" still has a request running
    slots.release("a")
    assert slots.admissible("c") and list(slots.loaded) == ["a", "b"]
    slots.queued("d")
    assert slots.admit("c") == LOAD_MS  # takes the slot of "a": loaded, but unused
    assert list(slots.loaded) == ["b", "c"] and (slots.loads, slots.evictions) == (3, 1)
    # vLLM 0.32 learns of a request from its first output: "b" and "c" run but are still
    # prefilling, so neither label names them yet; "d", waiting for a slot, is in
    # neither ever: it counts as a deferred request.
    assert slots.info_series()[-1][0]["running_lora_adapters"] == ""
    slots.first_token("c")
    slots.first_token("b")
    series = slots.info_series()
    # Then both labels name them, in the order they were first named.
    assert series[-1] == (
        {"max_lora": "2", "waiting_lora_adapters": "c,b", "running_lora_adapters": "c,b"},
        101.0,
    )
    assert slots.deferred() == 1
    slots.release("c")
    assert slots.deferred() == 0  # a slot to take: "d" is merely queued
    later = slots.info_series()  # a new combination: a new series, the old ones kept
    assert [stamp for _, stamp in later] == [100.0, 101.0, 102.0]
    assert later[-1][0]["waiting_lora_adapters"] == later[-1][0]["running_lora_adapters"] == "b"
    slots.admit("d")
    slots.release("d", named=False)  # aborted before its first token: never named
    assert slots.info_series()[-1][0]["running_lora_adapters"] == "b"
    with pytest.raises(ValueError, match="max_loras"):
        AdapterSlots(0, LOAD_MS)


def test_the_engine_loads_an_adapter_once_and_skips_requests_past_its_slots() -> None:
    async def main() -> None:
        engine = Engine(MODEL, PrefixCache(16, 1024), time_scale=0.0, lora=AdapterSlots(1, LOAD_MS))
        first = await engine.start([1] * 100, adapter="a", max_tokens=4)
        assert first.ttft_s == pytest.approx((MODEL.ttft_ms(100) + LOAD_MS) / 1000)
        again = await engine.start([2] * 100, adapter="a", max_tokens=4)
        assert again.ttft_s == pytest.approx(MODEL.ttft_ms(100) / 1000)  # loaded
        # "b" must wait for "a" to finish; a base-model request behind it goes at once.
        other = asyncio.create_task(engine.start([3] * 100, adapter="b", max_tokens=4))
        await asyncio.sleep(0.01)
        base = await engine.start([4] * 100, max_tokens=4)
        assert not other.done() and engine.waiting == 1
        assert engine.lora is not None and engine.lora.waiting == {"b": 1}
        for req in (first, again, base):
            engine.finish(req)
        late = await other
        # It waited (above; time_scale 0 counts no wait in its TTFT), then loaded.
        assert late.ttft_s == pytest.approx((MODEL.ttft_ms(100) + LOAD_MS) / 1000)
        engine.finish(late)
        assert engine.lora.running == {} and list(engine.lora.loaded) == ["b"]
        with pytest.raises(ValueError, match="enable-lora"):
            await Engine(MODEL, PrefixCache(16, 64)).start([1], adapter="a")

    asyncio.run(main())


def test_two_adapters_never_share_a_cached_block() -> None:
    data = b"the same system prompt " * 40
    base, a, b = (text_block_keys(data, 16, None, x) for x in (None, "a", "b"))
    assert len(base) == len(a) == len(b) > 0
    assert not set(a) & set(b) and not set(a) & set(base)
    assert text_block_keys(data, 16, "s", None) != text_block_keys(data, 16, "s", "a")


async def post(session: aiohttp.ClientSession, body: dict[str, Any], status: int = 200) -> Any:
    async with session.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


def test_the_http_pod_serves_registered_adapters_and_exports_vllms_lora_metric() -> None:
    async def main() -> None:
        config = SimConfig(
            time_scale=0.0,
            tpot_ms=1.0,
            enable_lora=True,
            max_loras=2,
            lora_modules=("sql", "legal"),
            lora_load_ms=LOAD_MS,
        )
        async with SimServer(config) as server, aiohttp.ClientSession(server.url) as s:
            messages = [{"role": "user", "content": "hello " * 50}]
            cold = await post(s, {"model": "sql", "messages": messages, "max_tokens": 2})
            assert cold["model"] == "sql"
            warm = await post(s, {"model": "sql", "messages": messages, "max_tokens": 2})
            assert cold["sim_ttft_ms"] - warm["sim_ttft_ms"] >= LOAD_MS
            base = await post(s, {"model": "sim-llama", "messages": messages, "max_tokens": 2})
            # The base model's cache is not the adapter's: the same prompt is cold there.
            assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            await post(s, {"model": "nope", "messages": messages}, status=404)
            async with s.get("/v1/models") as resp:
                cards = (await resp.json())["data"]
            assert {(c["id"], c["parent"]) for c in cards} == {
                ("sim-llama", None),
                ("sql", "sim-llama"),
                ("legal", "sim-llama"),
            }
            async with s.get("/metrics") as resp:
                text = await resp.text()
            slots = server.pod.lora
            assert slots is not None
            idle = (dict(slots.running), dict(slots.named), dict(slots.waiting))
            slots.running, slots.waiting = {"sql": 1, "legal": 1}, {"chat": 2}  # slots full
            slots.named = dict(slots.running)
            async with s.get("/metrics") as resp:
                busy = metrics_text.parse(await resp.text())
            slots.running, slots.named, slots.waiting = idle
        line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
        # Labels in the order the real vLLM 0.32 writes them (docs/engines.md).
        assert line.startswith('vllm:lora_requests_info{max_lora="2",running_lora_adapters=""')
        assert line.rsplit(" ", 1)[1].endswith("e+09")  # a Unix time, as Go prints it
        stats = metrics_text.parse(text)
        assert stats.reason == "" and stats.model_name == "sim-llama"
        assert stats.lora == metrics_text.LoraInfo(2)  # idle: no adapter in use
        assert server.pod.lora is not None and list(server.pod.lora.loaded) == ["sql"]
        # As vLLM: requests waiting for a slot are counted by reason, read beside it.
        assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="sim-llama",' in text
        assert busy.lora == metrics_text.LoraInfo(2, ("sql", "legal"), ("sql", "legal"), 2)

    asyncio.run(main())


def test_lora_flags_are_vllms() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--lora-modules", "a=/x", "b=/y"]
    )
    config = config_from_args(args)
    assert (config.enable_lora, config.max_loras, config.lora_modules) == (True, 3, ("a", "b"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "just-a-name"])
    with pytest.raises(ValueError, match="--enable-lora"):
        SimConfig(lora_modules=("a",))


def chat(model: str, text: str, at: float, max_tokens: int = 4) -> Request:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    body["max_tokens"] = max_tokens
    return Request(at, "/v1/chat/completions", msgspec.json.encode(body), max_tokens, model, text)


def test_fleet_simulation_pods_load_adapters_and_key_their_blocks_apart() -> None:
    prompt = "a question that is long enough to fill some blocks " * 20
    requests = [
        chat("sql", prompt, 0.0),
        chat("sql", prompt, 1.0),  # warm, loaded
        chat("legal", prompt, 2.0),  # another adapter: cold, and loaded first
        chat("sim-llama", prompt, 3.0),  # the base model: no adapter, cold
    ]
    workload = Workload("lora-test", "", requests, max_loras=1)
    settings = SimSettings(lora_load_ms=LOAD_MS)
    result = simulate(workload, resolve("ace"), pods=1, settings=settings, progress=False)
    recs = sorted(result.records, key=lambda r: r.arrival_s)
    cold = MODEL.ttft_ms(recs[0].prompt_tokens) / 1000
    assert recs[0].ttft_s == pytest.approx(cold + LOAD_MS / 1000)
    assert recs[1].cached_tokens > 0 and recs[1].ttft_s < cold
    assert recs[2].cached_tokens == 0 and recs[2].ttft_s == pytest.approx(recs[0].ttft_s)
    assert recs[3].cached_tokens == 0 and recs[3].ttft_s == pytest.approx(cold)
    assert (result.extra["lora_loads"], result.extra["lora_evictions"]) == (2, 1)
    # LoRA off (the default for a workload that asks none): no adapter, no load.
    plain = Workload("plain", "", requests[:1])
    base = simulate(plain, resolve("ace"), pods=1, settings=settings, progress=False)
    assert base.records[0].ttft_s == pytest.approx(cold) and "lora_loads" not in base.extra


@pytest.mark.parametrize("access_log", [True, False], ids=["access-log", "scrapes-only"])
def test_the_fleet_simulations_router_hears_of_answers_as_envoys_access_log_says(
    access_log: bool,
) -> None:
    """Each answer to a pinned request reaches the router's production observer
    ``access_log_s`` after it: with it, the adapter is free again before any scrape;
    without it (a gateway with no access log), only the next scrape would free it."""
    from ace_extproc.routing import FleetState

    fleets: list[FleetState] = []

    def ace(fleet: FleetState, index: Any) -> Any:
        fleets.append(fleet)
        return resolve("ace")(fleet, index)

    # The pod shows its adapter slots from its first request on (as vLLM): the scrape
    # at 0.4 s says one slot, then no scrape comes before the run ends.
    requests = [chat("sql", "a short question " * 20, 0.0), chat("sql", "another " * 20, 0.5)]
    settings = SimSettings(scrape_interval_s=0.4, access_log_s=0.1 if access_log else None)
    workload = Workload("lora-answers", "", requests, max_loras=1)
    result = simulate(workload, ace, pods=1, settings=settings, progress=False)
    assert len(result.records) == 2 and result.duration_s < 0.8
    view = fleets[0].load[0].lora
    assert view.max_lora == 1 and "sql" in view.loaded
    assert (view.in_use, len(view.picks)) == ((set(), 0) if access_log else ({"sql"}, 1))
