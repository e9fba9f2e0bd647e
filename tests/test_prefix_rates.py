"""How often each prefix is asked for, and what that does to the price of warming a pod."""

import pytest

from ace_extproc.config import Settings, sim_fleet
from ace_extproc.latency import get_model
from ace_extproc.routing import BlockIndex, FleetState, policies
from ace_extproc.routing.prefix_rates import PrefixRates
from tests.test_pipeline import PROMPT, request


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_steady_stream_reads_as_its_rate_and_decays_when_it_stops() -> None:
    clock = Clock()
    rates = PrefixRates(time_constant_s=1.0, clock=clock)
    assert rates.seen(7) == 0.0  # the first request: none before it
    for _ in range(200):  # 50 a second for 4 s
        clock.now += 0.02
        last = rates.seen(7)
    assert last == pytest.approx(50.0, rel=0.05)
    # A prefix that turns hot reads as hot from its first requests, not a second later.
    clock.now += 100
    for _ in range(10):  # 50 a second for 0.2 s
        clock.now += 0.02
        early = rates.seen(9)
    assert early == pytest.approx(50.0, rel=0.15)
    assert rates.seen(8) == 0.0  # another prefix: its own count
    clock.now += 5.0  # five time constants later
    assert rates.seen(7) < 0.01 * last


def test_the_least_recently_asked_prefixes_are_forgotten_first() -> None:
    clock = Clock()
    rates = PrefixRates(remembered=2, clock=clock)
    for key in (1, 2, 1, 3):  # 1 asked for again after 2; then 3, over the bound: 2 goes
        clock.now += 0.1
        rates.seen(key)
    clock.now += 0.1
    assert rates.seen(1) > 0.0
    assert rates.seen(2) == 0.0


def hot_setup(clock: Clock, speedup: float = 1.0):
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(4)]))
    model = get_model(Settings().ttft_model)
    faster = {"prefill_tokens_per_s": speedup * model.prefill_tokens_per_s} if speedup != 1 else {}
    picker = policies.cost_policy(Settings(**faster))(fleet, BlockIndex(10_000))
    picker.rates.clock = clock
    return fleet, picker


@pytest.mark.parametrize(
    ("per_s", "speedup", "spills"),
    [(0.0, 1, False), (1.0, 1, False), (200.0, 1, True), (200.0, 10, False)],
)
def test_a_hot_prefix_is_replicated_before_its_pod_queues_a_whole_cold_prefill(
    per_s: float, speedup: float, spills: bool
) -> None:
    """A warm pod queueing a third of a cold prefill keeps a prefix asked for once, or
    once a second; one asked for 200 times a second warms another pod, since the
    requests after it share the cold prefill that costs. Not where the pods prefill ten
    times faster than their model (``prefill_tokens_per_s``): the queue, in the model's
    milliseconds, is gone ten times sooner, and fewer requests come meanwhile."""
    clock = Clock()
    fleet, picker = hot_setup(clock, speedup)
    first = picker.pick(request(), fleet.available)
    assert first is not None
    for _ in range(round(per_s * 2)):  # the prefix's recent requests, over 2 s
        clock.now += 1 / per_s
        picker.rates.seen(request().hashes.blocks[-1])
    clock.now += 0.001
    cold = get_model(Settings().ttft_model).prefill_ms(len(PROMPT) // 4, 0)
    fleet.load[first.slot].queued_prefill_ms = cold / 3
    again = picker.pick(request(), fleet.available)
    assert again is not None
    assert (again.slot != first.slot) is spills
    assert again.action == ("spill" if spills else "hit")
