"""What a destination says of its engines: its own TTFT model
(``destinations[].ttft_model``: a fleet serving an 8B model beside a 70B one prices,
drains and reports each destination's pods with its own calibrated constants, not the
router's) and its pods' KV size where their metrics do not say (``kv_capacity_tokens``)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from ace_extproc.config import (
    Config,
    ConfigError,
    Pod,
    Settings,
    fleet_to_dict,
    parse_fleet,
    ttft_models,
)
from ace_extproc.latency import DEFAULT_MODEL, get_model
from ace_extproc.prefix import hash_prompt
from ace_extproc.routing import BlockIndex, FleetState, RoutingRequest
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.routing.pipeline import Pipeline
from ace_extproc.routing.policies import cost_policy
from tests.conftest import make_app, make_processor

SMALL = "llama-3.1-8b-fp8"


def fleet_doc(small_model: Any = SMALL, **small: Any) -> dict[str, Any]:
    """Two destinations of two pods: ``big`` on the router's model, ``small`` on its own
    (and ``small``'s other fields)."""
    return {
        "destinations": [
            {
                "id": "big",
                "base_url": "http://10.0.0.1:8000",
                "models": ["llama-70b"],
                "pods": [
                    {"id": f"b{i}", "base_url": f"http://10.0.0.{1 + i}:8000"} for i in (0, 1)
                ],
            },
            {
                "id": "small",
                "base_url": "http://10.0.1.1:8000",
                "models": ["llama-8b"],
                "ttft_model": small_model,
                **small,
                "pods": [
                    {"id": f"s{i}", "base_url": f"http://10.0.1.{1 + i}:8000"} for i in (0, 1)
                ],
            },
        ]
    }


def test_a_destination_names_its_own_model_and_the_router_s_is_the_default() -> None:
    fleet = parse_fleet(fleet_doc())
    models = ttft_models(fleet, Settings())
    assert models == {"big": get_model(DEFAULT_MODEL), "small": get_model(SMALL)}
    assert parse_fleet(fleet_to_dict(fleet)) == fleet  # the file round-trips
    assert ttft_models(fleet, Settings(ttft_model=SMALL))["big"] == get_model(SMALL)
    with pytest.raises(ConfigError, match=r"destinations\[1\]\.ttft_model: unknown TTFT model"):
        parse_fleet(fleet_doc("gpt-17"))
    with pytest.raises(ConfigError, match=r"destinations\[1\]\.ttft_model: expected"):
        parse_fleet(fleet_doc(8))


def test_each_destination_is_priced_with_its_own_model() -> None:
    """The same warm pod and queue in each destination: 150 ms of queued prefill cost
    an 8B pod more than a cold 4K-token prefill elsewhere (~77 ms: it spills), and a
    70B pod less than its cold prefill (~176 ms: it keeps the prefix)."""
    fleet = FleetState(parse_fleet(fleet_doc()))
    picker = cost_policy(Settings())(fleet, BlockIndex(10_000))
    assert isinstance(picker, Pipeline)
    prompt = bytes(range(256)) * 64  # 16 KB: 32 blocks, 4,096 tokens
    hashes = hash_prompt(prompt, None, 512, 1)
    request = RoutingRequest(hashes, prompt, 4096, "t", "m", None)
    for name, spills in (("big", False), ("small", True)):
        destination = fleet.fleet.destinations[0 if name == "big" else 1]
        warm, other = (fleet.slot_of(p.key) for p in destination.pods)
        picker.index.record(warm, hashes.blocks)
        fleet.load[warm].queued_prefill_ms = 150.0
        pick = picker.pick(request, fleet.candidates(destination))
        assert pick is not None
        assert (pick.slot, pick.action) == ((other, "spill") if spills else (warm, "hit")), name


def test_each_destination_s_queue_is_priced_by_its_model_and_drains_at_its_speed() -> None:
    fleet = FleetState(parse_fleet(fleet_doc()))
    monitor = FleetMonitor(fleet, BlockIndex(100), Settings())
    start = time.monotonic() + 0.01
    monitor.load.drain(start)
    for slot in range(len(fleet.pods)):
        monitor.load.sent(slot, 10_000)
    monitor.load.drain(start + 0.1)
    big, small = get_model(DEFAULT_MODEL), get_model(SMALL)
    for slot, pod in enumerate(fleet.pods):
        model = big if pod.destination == "big" else small
        assert fleet.load[slot].queued_prefill_ms == pytest.approx(
            model.prefill_work_ms(10_000) - 100
        )
    # The router's prefill_tokens_per_s, where set, is every pod's rate: each works
    # through its model's milliseconds that many times faster than the model says.
    fleet = FleetState(parse_fleet(fleet_doc()))
    monitor = FleetMonitor(fleet, BlockIndex(100), Settings(prefill_tokens_per_s=20_000))
    monitor.load.drain(start)
    for load in fleet.load:
        load.queued_prefill_ms = 1_000.0
    monitor.load.drain(start + 0.1)
    for slot, pod in enumerate(fleet.pods):
        speed = 20_000 / (big if pod.destination == "big" else small).prefill_tokens_per_s
        assert fleet.load[slot].queued_prefill_ms == pytest.approx(1_000 - 100 * speed)


def test_the_reported_estimate_is_the_destination_s() -> None:
    """The trace's speedup and the saved milliseconds come from the model of the
    destination the request went to."""
    p = make_processor(Config(parse_fleet(fleet_doc()), Settings(salt_secret=b"s")))
    system = "You are a helpful assistant. " * 200
    for model, ttft in (("llama-70b", get_model(DEFAULT_MODEL)), ("llama-8b", get_model(SMALL))):
        for turn in ("first", "second"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": turn}]
            body = msgspec.json.encode({"model": model, "messages": messages})
            ctx = p.on_headers({":path": "/v1/chat/completions", ":method": "POST"}, False)
            outcome = p.on_body(ctx, body)
        assert outcome.action == "hit" and outcome.saved_tokens > 1000
        n, c = outcome.prompt_tokens, outcome.saved_tokens
        assert outcome.speedup == ttft.ttft_ms(n) / ttft.ttft_ms(n - c, c), model
        assert outcome.saved_ms == ttft.ttft_ms(n) - ttft.ttft_ms(n - c, c), model


def test_a_configured_kv_size_bounds_the_index_until_the_engine_reports_one() -> None:
    from ace_extproc.routing.metrics_text import EngineStats

    fleet = parse_fleet(fleet_doc(kv_capacity_tokens=12_800))  # 100 blocks of 128 tokens
    assert parse_fleet(fleet_to_dict(fleet)) == fleet
    settings = Settings(salt_secret=b"s", index_blocks_per_pod=5_000)
    p = make_app(Config(fleet, settings))
    by_pod = {pod.key: p.index.capacity_of(slot) for slot, pod in enumerate(p.fleet.pods)}
    assert by_pod == {"big/b0": 5_000, "big/b1": 5_000, "small/s0": 100, "small/s1": 100}
    # A pod discovered later gets it too.
    slot = p.fleet.add_pod(Pod("small", "s2", "10.0.1.9", 8000))
    assert p.index.capacity_of(slot) == 100
    # The engine's own figure, once scraped, replaces the configured one.
    monitor = FleetMonitor(p.fleet, p.index, settings)
    monitor.apply(slot, EngineStats(engine="vllm", running=0, waiting=0, capacity_tokens=25_600))
    assert p.index.capacity_of(slot) == 200
    # Its slot, reused by another destination's new pod, keeps neither.
    p.fleet.free_slots_kept = 0
    p.fleet.remove_pod(slot)
    assert p.fleet.add_pod(Pod("big", "b2", "10.0.0.9", 8000)) == slot
    assert p.index.capacity_of(slot) == 5_000
    for bad in (-1, True, "lots", 1.5):
        with pytest.raises(ConfigError, match=r"destinations\[1\]\.kv_capacity_tokens"):
            parse_fleet(fleet_doc(kv_capacity_tokens=bad))
