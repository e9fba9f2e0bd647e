"""Draining a pod in FleetState: out of ``available`` (what pickers read) until undrained,
whatever its health does, and an undrain never brings back a pod that is down."""

import pytest

from ace_extproc.config import Pod, sim_fleet
from ace_extproc.routing.fleet import FleetState


@pytest.fixture
def fleet() -> FleetState:
    return FleetState(sim_fleet([f"127.0.0.1:{9001 + i}" for i in range(3)]))


def test_a_drained_pod_is_out_of_available_and_candidates(fleet: FleetState) -> None:
    dest = fleet.fleet.destinations[0]
    assert fleet.available == 0b111
    assert fleet.drain(1) is True
    assert fleet.available == 0b101 and fleet.candidates(dest) == 0b101
    assert fleet.is_drained(1) and fleet.is_healthy(1) and not fleet.is_available(1)
    assert fleet.drain(1) is False  # already drained: nothing changes
    assert fleet.undrain(1) is True
    assert fleet.available == 0b111 and not fleet.is_drained(1)
    assert fleet.undrain(1) is False


def test_health_changes_do_not_undrain(fleet: FleetState) -> None:
    fleet.drain(0)
    fleet.set_available(0, False)
    fleet.set_available(0, True)  # healthy again: still drained
    assert not fleet.is_available(0) and fleet.is_healthy(0) and fleet.is_drained(0)


def test_undrain_does_not_bring_back_a_pod_that_is_down(fleet: FleetState) -> None:
    fleet.set_available(2, False)
    fleet.drain(2)
    fleet.undrain(2)
    assert not fleet.is_available(2) and not fleet.is_healthy(2)
    fleet.set_available(2, True)
    assert fleet.is_available(2)


def test_drain_survives_the_pod_leaving_and_rejoining(fleet: FleetState) -> None:
    pod = fleet.pods[1]
    fleet.drain(1)
    fleet.remove_pod(1)
    assert not fleet.is_available(1)
    fleet.undrain(1)  # a pod that left stays out
    assert not fleet.is_available(1)
    fleet.drain(1)
    assert fleet.add_pod(pod) == 1
    assert fleet.is_member(1) and fleet.is_healthy(1) and not fleet.is_available(1)
    fleet.undrain(1)
    assert fleet.is_available(1)


def test_a_new_pod_joins_undrained_and_healthy(fleet: FleetState) -> None:
    fleet.drain(0)
    slot = fleet.add_pod(Pod("sim", "pod-9", "127.0.0.1", 9009))
    assert slot == 3 and fleet.is_available(slot) and fleet.available == 0b1110


@pytest.mark.parametrize("verdict", ["set_available", "set_ejected"])
def test_health_cannot_undrain_and_undrain_cannot_overrule_it(
    fleet: FleetState, verdict: str
) -> None:
    """The health checks' verdict (the monitor's set_available) and passive health's
    (the outlier detector's set_ejected) are each their own: neither undrains."""
    out = (
        (lambda: fleet.set_available(0, False))
        if verdict == "set_available"
        else (lambda: fleet.set_ejected(0, True))
    )
    back = (
        (lambda: fleet.set_available(0, True))
        if verdict == "set_available"
        else (lambda: fleet.set_ejected(0, False))
    )
    fleet.drain(0)
    out()
    assert not fleet.is_healthy(0)
    fleet.undrain(0)
    assert not fleet.is_available(0)  # down: health still keeps it out
    fleet.drain(0)
    back()
    assert fleet.is_healthy(0)
    assert not fleet.is_available(0)  # back, but drained
    fleet.undrain(0)
    assert fleet.available == 0b111


def test_the_two_health_verdicts_do_not_lift_each_other(fleet: FleetState) -> None:
    fleet.set_available(1, False)
    fleet.set_ejected(1, True)
    fleet.set_available(1, True)  # the probes pass again: still ejected
    assert not fleet.is_available(1) and fleet.is_ejected(1)
    fleet.set_ejected(1, False)
    assert fleet.is_available(1)
