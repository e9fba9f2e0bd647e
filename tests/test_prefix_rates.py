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
    assert rates.seen(8) == 0.0  # another prefix: its own count
    clock.now += 5.0  # five time constants later
    assert rates.seen(7) < 0.01 * last


def test_the_least_recently_asked_prefixes_are_forgotten_first() -> None:
    clock = Clock()
    rates = PrefixRates(remembered=2, clock=clock)
    rates.seen(1)
    rates.seen(2)
    rates.seen(1)  # 1 is now the most recent
    rates.seen(3)  # over the bound: 2 goes
    assert rates.seen(1) > 0.0
    assert rates.seen(2) == 0.0


def hot_setup(clock: Clock):
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(4)]))
    picker = policies.cost_policy(Settings())(fleet, BlockIndex(10_000))
    picker.rates.clock = clock
    return fleet, picker


@pytest.mark.parametrize(("per_s", "spills"), [(0.0, False), (1.0, False), (200.0, True)])
def test_a_hot_prefix_is_replicated_before_its_pod_queues_a_whole_cold_prefill(
    per_s: float, spills: bool
) -> None:
    """A warm pod queueing a third of a cold prefill keeps a prefix asked for once, or
    once a second; one asked for 200 times a second warms another pod, since the
    requests after it share the cold prefill that costs."""
    clock = Clock()
    fleet, picker = hot_setup(clock)
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
