"""The cost pipeline's pick in one C call: ``native.pick`` (``_pick.c``) against
``Pipeline._choose``, the reference.

Its contract: for any fleet, index, loads, sessions and settings the default pipeline
runs with, the same pick (pod, depth held, action, fallbacks) and the index left
exactly alike (every pod's blocks in the same recency order, the same roots); bad
arguments raise, never crash.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc.config import Destination, Fleet, Pod, Settings
from ace_extproc.latency import get_model
from ace_extproc.prefix import hash_prompt
from ace_extproc.routing import BlockIndex, FleetState, RoutingRequest
from ace_extproc.routing.fleet import PodLoad
from ace_extproc.routing.pipeline import EstimatedTTFT, NotSaturated, Pipeline
from ace_extproc.routing.policies import cost_policy
from tests.conftest import load_speedups

speedups = load_speedups()

BLOCK = 64


def fleet_of(pods: int, rng: random.Random) -> FleetState:
    members = tuple(
        Pod("d", f"pod-{i}", f"10.0.{i // 200}.{i % 200}", 8000, rng.choice([1.0, 1.0, 0.5, 3.0]))
        for i in range(pods)
    )
    return FleetState(Fleet((Destination("d", "vllm", members[0].base_url, members),)))


def pair(fleet: FleetState, capacity: int, **options: Any) -> tuple[Pipeline, Pipeline]:
    """Two pipelines on one fleet, each with its own C index: one picking in one C
    call, one on the reference (the C calls step by step, with the Python between)."""
    factory = cost_policy(Settings(), **options)
    fused, reference = (factory(fleet, BlockIndex(capacity)) for _ in range(2))
    assert isinstance(fused, Pipeline) and isinstance(reference, Pipeline)
    assert fused._fused
    reference._fused = False
    return fused, reference


def index_state(index: BlockIndex) -> Any:
    lrus, capacities, _ = index.room_view()
    return {slot: list(lru) for slot, lru in lrus.items()}, dict(index.roots), capacities


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    pods=st.sampled_from([1, 3, 8, 64, 65, 130]),
    min_match=st.sampled_from([0.0, 0.1, 0.5]),
    place_sessions=st.booleans(),
    capacity=st.sampled_from([3, 40, 10_000]),
)
def test_the_fused_pick_is_the_reference_pick(
    seed: int, pods: int, min_match: float, place_sessions: bool, capacity: int
) -> None:
    rng = random.Random(seed)
    fleet = fleet_of(pods, rng)
    fused, reference = pair(fleet, capacity, min_match=min_match, place_sessions=place_sessions)
    for slot in rng.sample(range(pods), min(pods, 3)):  # some pods' own KV sizes known
        size = rng.choice([2, 20, 500])
        fused.index.set_capacity(slot, size)
        reference.index.set_capacity(slot, size)
    shared = [rng.randbytes(BLOCK * rng.choice([1, 4, 12])) for _ in range(4)]
    actions = set()
    for i in range(80):
        prompt = rng.choice(shared)[: rng.choice([10, BLOCK * 2, 10**6])]
        prompt += rng.randbytes(rng.choice([0, 0, 30, BLOCK * 3]))
        session = rng.choice([None, None, f"s{rng.randrange(6)}"])
        request = RoutingRequest(
            hash_prompt(prompt, None, BLOCK, 7),
            prompt,
            max(1, len(prompt) // 4) * rng.choice([1, 50]),
            rng.choice(["t", "u"]),
            "m",
            session,
        )
        for _ in range(rng.randrange(3)):  # queues, and now and then a full KV cache
            load = fleet.load[rng.randrange(pods)]
            load.queued_prefill_tokens = rng.choice([0, 500, 200_000])
            load.kv_usage = rng.choice([0.0, 0.5, 0.97, 1.0])
        candidates = fleet.available
        if pods > 1 and rng.random() < 0.5:
            candidates &= ~(1 << rng.randrange(pods))
        a = fused.pick(request, candidates)
        b = reference.pick(request, candidates)
        assert a == b, f"request {i}"
        assert a is not None and (candidates >> a.slot) & 1
        assert a.slot not in a.fallbacks and len(a.fallbacks) <= 2
        assert all((candidates >> slot) & 1 for slot in a.fallbacks)
        assert index_state(fused.index) == index_state(reference.index), f"request {i}"
        actions.add(a.action)
    assert fused._sessions == reference._sessions


def test_every_pod_saturated_leaves_them_all_candidates() -> None:
    """The saturation filter is ignored when it would leave nobody, as the reference's
    ``keep(...) or candidates`` does; otherwise a full pod is passed over however warm."""
    fleet = fleet_of(3, random.Random(0))
    fused, reference = pair(fleet, 1000)
    prompt = b"x" * BLOCK * 8
    request = RoutingRequest(hash_prompt(prompt, None, BLOCK, 1), prompt, 2048, "t", "m")
    first = fused.pick(request, fleet.available)
    assert first is not None and first == reference.pick(request, fleet.available)
    fleet.load[first.slot].kv_usage = 0.99
    spilled = fused.pick(request, fleet.available)
    assert spilled is not None and spilled.slot != first.slot
    assert spilled == reference.pick(request, fleet.available)
    for load in fleet.load:
        load.kv_usage = 1.0
    back = fused.pick(request, fleet.available)
    assert back is not None and back.action == "hit"
    assert back == reference.pick(request, fleet.available)


def test_the_fused_pick_runs_only_where_it_is_the_same_pipeline() -> None:
    fleet = fleet_of(2, random.Random(0))
    settings = Settings()
    assert cost_policy(settings)(fleet, BlockIndex(10))._fused  # type: ignore[attr-defined]
    # The reference index's dicts, another policy's options, other filters: step by step.
    assert not cost_policy(settings)(fleet, BlockIndex(10, pure=True))._fused  # type: ignore[attr-defined]
    assert not cost_policy(settings, balance_new=True)(fleet, BlockIndex(10))._fused  # type: ignore[attr-defined]
    scorer = EstimatedTTFT(get_model(settings.ttft_model), 128.0)
    two = Pipeline(fleet, BlockIndex(10), [NotSaturated(), NotSaturated(0.5)], scorer)
    assert not two._fused
    assert Pipeline(fleet, BlockIndex(10), [NotSaturated(0.8)], scorer)._max_kv_usage == 0.8


def arguments() -> list[Any]:
    fleet = fleet_of(2, random.Random(0))
    index = BlockIndex(10)
    for slot in range(2):
        index.add_pod(slot)
    params = cost_policy(Settings())(fleet, index).params  # type: ignore[attr-defined]
    return [
        [1, 2, 3],  # blocks
        (0, 1),  # slots
        index.room_view(),
        index.roots,
        fleet.load,
        fleet.seeds,
        params,
        2,  # fallbacks
        0.97,  # max kv usage
        100,  # tokens
        5,  # route key
        -1,  # home
        0.1,  # min match
        True,  # steer
    ]


@pytest.mark.parametrize(
    ("position", "value", "error"),
    [
        (0, (1, 2, 3), TypeError),  # blocks: a list
        (0, ["x"], TypeError),  # a hash is an int
        (0, [-1], OverflowError),
        (1, (), TypeError),  # no candidates
        (1, [0, 1], TypeError),
        (1, (0, 2), IndexError),  # a slot with no load
        (1, ("0",), TypeError),
        (2, ({}, {}), TypeError),  # rooms
        (3, [], TypeError),  # roots
        (4, [PodLoad()], IndexError),  # slot 1 has no load
        (4, [object(), object()], AttributeError),
        (5, [(1, 1.0)], IndexError),  # slot 1 has no seed
        (5, [1, 2], TypeError),
        (6, (1.0, 2.0), TypeError),  # params
        (7, -1, ValueError),  # fallbacks
        (8, "high", TypeError),
        (10, -1, OverflowError),  # route key: 64 bits
        (10, 2**64, OverflowError),
    ],
)
def test_bad_arguments_raise(position: int, value: Any, error: type[Exception]) -> None:
    speedups.pick(*arguments())  # the unchanged arguments are fine
    args = arguments()  # a fresh index: two equal pods, so seeds are read too
    args[position] = value
    with pytest.raises(error):
        speedups.pick(*args)
    with pytest.raises(TypeError):
        speedups.pick(*args[:-1])


def test_a_lru_missing_for_a_holder_raises() -> None:
    args = arguments()
    lrus, capacities, default = args[2]
    args[3][1] = 0b11  # both hold the first block
    args[2] = ({0: lrus[0]}, capacities, default)
    with pytest.raises(KeyError):
        speedups.pick(*args)
    args[2] = ({0: lrus[0], 1: {}}, capacities, default)  # a dict, not a BlockLRU
    with pytest.raises(TypeError):
        speedups.pick(*args)
