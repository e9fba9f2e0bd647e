"""The cost pipeline's pricing: ``native.price`` (``_price.c``) against
``pipeline.price_pure``, the reference.

Its contract: for any candidates, depths, rooms, loads, constants and ``keep``, the
same ``(near, deepest, order)`` bit for bit, ties in price broken by slot (the C one
finds the ``keep`` cheapest without sorting, the reference sorts); bad arguments
raise, never crash.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc.latency import get_model
from ace_extproc.routing.fleet import PodLoad
from ace_extproc.routing.pipeline import PriceParams, price_pure
from tests.conftest import load_speedups

speedups = load_speedups()

MODEL = get_model("llama-3.3-70b-fp8-tp4")
PARAMS = PriceParams(128.0, MODEL.a_ms, MODEL.b_ms, MODEL.t_step_ms, 2.56, 0.10, 5.0)


def both(*args: Any, keep: int | None = None) -> Any:
    """Both prices for ``args``; ``keep`` defaults to every candidate."""
    keep = len(args[0]) if keep is None else keep
    expected = price_pure(*args, keep)
    assert speedups.price(*args, keep) == expected
    return expected


def rooms(held: dict[int, int], capacities: dict[int, int], default: int = 100) -> Any:
    lrus = {slot: dict.fromkeys(range(count)) for slot, count in held.items()}
    return lrus, capacities, default


def test_the_warm_pod_is_the_near_best_and_cold_ones_follow_by_slot() -> None:
    load = [PodLoad() for _ in range(4)]
    near, deepest, order = both((0, 1, 2, 3), {2: 30}, rooms({}, {}), load, 32, 4096, PARAMS)
    assert (near, deepest) == (1 << 2, 30)
    assert order == (2, 0, 1, 3)  # equal prices: by slot, as Python's tuple sort


def test_a_queue_longer_than_the_prefill_saved_moves_the_request_on() -> None:
    load = [PodLoad(), PodLoad(queued_prefill_tokens=200_000)]
    near, deepest, order = both((0, 1), {1: 32}, rooms({}, {}), load, 32, 4096, PARAMS)
    assert (near, deepest, order) == (1 << 0, 0, (0, 1))


def test_a_full_pod_pays_for_what_it_would_evict() -> None:
    load = [PodLoad(), PodLoad()]
    # Slot 0 is full (100 of 100): its 32 new blocks would evict 32 others.
    near, _, order = both((0, 1), {}, rooms({0: 100}, {}), load, 32, 4096, PARAMS)
    assert (near, order) == (1 << 1, (1, 0))
    # Without the charge both cost the same.
    free = PARAMS._replace(evict_ms=0.0)
    assert both((0, 1), {}, rooms({0: 100}, {}), load, 32, 4096, free)[0] == 0b11


def test_a_pod_without_an_lru_holds_nothing() -> None:
    load = [PodLoad(), PodLoad()]
    lrus: dict[int, Any] = {0: None}  # as price_pure reads it: no LRU, nothing held
    assert both((0, 1), {}, (lrus, {}, 100), load, 32, 4096, PARAMS)[0] == 0b11


def test_slots_past_a_machine_word() -> None:
    load = [PodLoad() for _ in range(200)]
    slots = (3, 64, 70, 130, 199)
    near, deepest, order = both(slots, {64: 5, 199: 5, 3: 4}, rooms({}, {}), load, 8, 1024, PARAMS)
    assert (near, deepest) == ((1 << 64) | (1 << 199), 5)
    assert set(order) == set(slots)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    pods=st.integers(1, 80),
    n=st.integers(0, 600),
    tokens=st.integers(1, 80_000),
    tpb=st.sampled_from([0.5, 1.0, 64.0, 128.0, 131.3]),
    evict=st.sampled_from([0.0, 0.001, 2.56, 40.0]),
    slack=st.tuples(st.sampled_from([0.0, 0.1, 1.0]), st.sampled_from([0.0, 5.0, 1e6])),
)
def test_native_prices_as_the_reference(
    data: st.DataObject,
    pods: int,
    n: int,
    tokens: int,
    tpb: float,
    evict: float,
    slack: tuple[float, float],
) -> None:
    slots = tuple(data.draw(st.sets(st.integers(0, pods - 1), min_size=1), label="slots"))
    depth = st.integers(0, n)
    depths = data.draw(st.dictionaries(st.integers(0, pods - 1), depth), label="depths")
    held = data.draw(st.dictionaries(st.integers(0, pods - 1), st.integers(0, 40)))
    capacities = data.draw(st.dictionaries(st.integers(0, pods - 1), st.integers(1, 60)))
    queued = data.draw(st.lists(st.integers(-5, 300_000), min_size=pods, max_size=pods))
    load = [PodLoad(queued_prefill_tokens=q) for q in queued]
    params = PARAMS._replace(
        tokens_per_block=tpb, evict_ms=evict, slack_ratio=slack[0], slack_ms=slack[1]
    )
    args = (slots, depths, rooms(held, capacities, 30), load, n, tokens, params)
    near, deepest, order = both(*args)
    assert sorted(order) == sorted(slots)
    keep = data.draw(st.integers(1, len(slots) + 2), label="keep")
    assert both(*args, keep=keep) == (near, deepest, order[:keep])
    assert near and (near & sum(1 << s for s in slots)) == near
    assert all(depths.get(slot, 0) == deepest for slot in slots if (near >> slot) & 1)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (((), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 3), TypeError),  # no candidates
        (([0], {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 3), TypeError),  # not a tuple
        (((0,), [], rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 3), TypeError),
        (((0,), {}, ({}, {}), [PodLoad()], 1, 1, PARAMS, 3), TypeError),
        (((0,), {}, rooms({}, {}), (PodLoad(),), 1, 1, PARAMS, 3), TypeError),
        (((0,), {}, rooms({}, {}), [PodLoad()], 1, 1, (1.0, 2.0), 3), TypeError),
        (((0,), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS._replace(a_ms="x"), 3), TypeError),
        (((1,), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 3), IndexError),  # no load
        ((("0",), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 3), TypeError),
        (((0,), {0: "deep"}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 3), TypeError),
        (((0,), {}, rooms({}, {}), [object()], 1, 1, PARAMS, 3), AttributeError),
        (
            ((0,), {}, rooms({}, {}), [PodLoad(queued_prefill_tokens=None)], 1, 1, PARAMS, 3),
            TypeError,
        ),  # type: ignore[arg-type]
        (((0,), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, None), TypeError),
        (((0,), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS, 0), ValueError),  # keep none
        (((0,), {}, rooms({}, {}), [PodLoad()], 1, 1, PARAMS), TypeError),  # keep missing
    ],
)
def test_bad_arguments_raise(args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        speedups.price(*args)


@pytest.mark.parametrize("pods", [8, 100])
def test_the_pipeline_picks_alike_on_the_c_calls_and_on_python(
    pods: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same requests through two pipelines, one on the C calls and structures
    (price; the BlockLRU's match and record) and one on their Python references (the
    index's dicts): the same pick every time, on a fleet
    small enough for one machine word of slots and on one past it, with queues, full
    pods and sessions in play."""
    import random

    from ace_extproc.config import Settings, sim_fleet
    from ace_extproc.prefix import hash_prompt
    from ace_extproc.routing import BlockIndex, FleetState, RoutingRequest, pipeline
    from ace_extproc.routing.policies import cost_policy

    def build(pure: bool) -> tuple[FleetState, Any]:
        fleet = FleetState(sim_fleet([f"10.0.{i // 250}.{i % 250}:8000" for i in range(pods)]))
        return fleet, cost_policy(Settings())(fleet, BlockIndex(40, pure=pure))

    fast_fleet, fast = build(pure=False)
    slow_fleet, slow = build(pure=True)
    rng = random.Random(pods)
    systems = [rng.randbytes(2048) for _ in range(5)]
    picks = []
    for i in range(600):
        data = rng.choice(systems) + rng.randbytes(rng.choice([0, 512, 4096]))
        session = rng.choice([None, f"s{rng.randrange(40)}"])
        request = RoutingRequest(
            hash_prompt(data, None, 512, 7), data, len(data) // 4, "t", "m", session
        )
        queued = {rng.randrange(pods): rng.randrange(200_000) for _ in range(3)}
        for fleet in (fast_fleet, slow_fleet):
            for slot, tokens in queued.items():
                fleet.load[slot].queued_prefill_tokens = tokens
        candidates = fast_fleet.available & ~(1 << rng.randrange(pods))
        a = fast.pick(request, candidates)
        with monkeypatch.context() as m:
            m.setattr(pipeline, "price", pipeline.price_pure)
            b = slow.pick(request, candidates)
        assert a == b, f"request {i}"
        picks.append(a.slot)
    assert len(set(picks)) > 3  # the requests went to many pods, not one


@settings(max_examples=100, deadline=None)
@given(
    depths=st.dictionaries(st.integers(0, 7), st.integers(0, 32)),
    queued=st.lists(st.integers(0, 100_000), min_size=8, max_size=8),
    tokens=st.integers(1, 40_000),
)
def test_price_is_the_scorers_price(depths: dict[int, int], queued: list[int], tokens: int) -> None:
    """Without the eviction charge, ``price`` orders the pods as ``EstimatedTTFT``, the
    pipeline's scorer, prices them one by one (the same formula, in one call)."""
    from ace_extproc.config import sim_fleet
    from ace_extproc.prefix import hash_prompt
    from ace_extproc.routing import FleetState, RoutingRequest
    from ace_extproc.routing.pipeline import EstimatedTTFT

    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(8)]))
    for slot, q in enumerate(queued):
        fleet.load[slot].queued_prefill_tokens = q
    request = RoutingRequest(hash_prompt(b"x" * 512, None, 512, 1), b"", tokens, "t", "m")
    scorer = EstimatedTTFT(MODEL, 128.0)
    scored = sorted((scorer(request, slot, depths.get(slot, 0), fleet), slot) for slot in range(8))
    params = PARAMS._replace(evict_ms=0.0)
    _, _, order = both(tuple(range(8)), depths, rooms({}, {}), fleet.load, 32, tokens, params)
    assert order == tuple(slot for _, slot in scored)
