"""Passive health as Envoy's outlier detection does it (routing/outlier.py): the
thresholds, the cap on how many of a destination's pods may be out, the backoff,
and the index kept when an ejected pod comes back."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ace_extproc.config import ConfigError, PassiveHealth, Pod, parse_settings, sim_fleet
from ace_extproc.routing import FleetState
from ace_extproc.routing.outlier import OutlierDetector


class Clock:
    """A clock and a scheduler the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def schedule(self, delay: float, then: Callable[[], None]) -> None:
        self.timers.append((self.now + delay, then))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, then in sorted(due, key=lambda t: t[0]):
            then()


def detector(pods: int = 4, **health: float) -> tuple[OutlierDetector, Clock]:
    clock = Clock()
    fleet = FleetState(sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(pods)]))
    settings = PassiveHealth(**health)  # type: ignore[arg-type]
    return OutlierDetector(fleet, settings, clock=lambda: clock.now, schedule=clock.schedule), clock


def test_five_5xx_in_a_row_take_a_pod_out_and_any_answer_resets_the_count() -> None:
    d, _ = detector()
    for _ in range(4):
        d.failure(0, 500)
    d.success(0)
    for _ in range(4):
        d.failure(0, 500)
    assert d.fleet.is_available(0)
    d.failure(0, 500)
    assert not d.fleet.is_available(0) and d.fleet.is_ejected(0)


def test_gateway_failures_count_on_their_own() -> None:
    d, _ = detector(consecutive_5xx=100, consecutive_gateway_failure=3)
    d.failure(1, 503)
    d.failure(1, 0)  # unreachable
    d.failure(1, 500)  # not a gateway failure: that count starts again
    d.failure(1, 502)
    d.failure(1, 504)
    assert d.fleet.is_available(1)
    d.failure(1, 0)
    assert not d.fleet.is_available(1)


def test_no_more_than_the_cap_are_out_whatever_clients_make_them_answer() -> None:
    """A storm of requests that make every engine fail (a client's doing) takes out at
    most 10% of a destination's pods, and always at least one may go."""
    d, _ = detector(pods=4)
    for _ in range(50):
        for slot in range(4):
            d.failure(slot, 500)
    assert bin(d.fleet.ejected).count("1") == 1 and bin(d.fleet.available).count("1") == 3
    big, _ = detector(pods=20)
    for _ in range(10):
        for slot in range(20):
            big.failure(slot, 500)
    assert bin(big.fleet.ejected).count("1") == 2


def test_an_ejected_pod_comes_back_with_its_index_and_backs_off_if_it_fails_again() -> None:
    d, clock = detector(base_ejection_time_s=30, max_ejection_time_s=300)
    for _ in range(5):
        d.failure(2, 503)
    clock.advance(29)
    assert d.fleet.is_ejected(2)
    clock.advance(1)
    assert d.fleet.is_available(2)  # back on its own, nothing else touched
    for _ in range(5):
        d.failure(2, 503)
    clock.advance(30)
    assert d.fleet.is_ejected(2)  # twice: out for 60 s
    clock.advance(30)
    assert d.fleet.is_available(2)
    clock.advance(301)  # well long enough since: a first offence again
    for _ in range(5):
        d.failure(2, 503)
    clock.advance(30)
    assert d.fleet.is_available(2)


def test_the_backoff_stops_at_the_longest_ejection() -> None:
    d, clock = detector(base_ejection_time_s=30, max_ejection_time_s=50)
    for _ in range(3):
        for _ in range(5):
            d.failure(0, 500)
        clock.advance(50)
        assert d.fleet.is_available(0)


def test_a_pod_that_leaves_and_comes_back_starts_clean() -> None:
    d, clock = detector()
    for _ in range(5):
        d.failure(3, 500)
    pod = d.fleet.pods[3]
    d.fleet.remove_pod(3)
    assert not d.fleet.is_ejected(3)
    d.fleet.add_pod(Pod(pod.destination, pod.id, pod.host, pod.port))
    assert d.fleet.is_available(3)
    clock.advance(30)  # its old timer finds nothing to do
    for _ in range(4):
        d.failure(3, 500)
    assert d.fleet.is_available(3)


def test_the_settings_are_read_and_checked() -> None:
    s = parse_settings({"passive_health": {"consecutive_5xx": 3, "base_ejection_time_s": 5}})
    assert s.passive_health == PassiveHealth(consecutive_5xx=3, base_ejection_time_s=5.0)
    for bad in ({"consecutive_5xx": 0}, {"max_ejection_percent": 101}, {"consecutive_5x": 3}):
        with pytest.raises(ConfigError, match="passive_health"):
            parse_settings({"passive_health": bad})
