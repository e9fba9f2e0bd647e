"""Slots of departed pods are reused: the fleet's slots stay bounded however many pods
come and go, and nothing kept for a pod that left is handed to the pod taking its slot."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from ace_extproc.app import App
from ace_extproc.config import Config, Destination, Fleet, PassiveHealth, Pod, Settings, sim_fleet
from ace_extproc.observe import Observation, Observer
from ace_extproc.outcome import Outcome
from ace_extproc.routing import fleet as fleet_module
from ace_extproc.routing.fleet import FREE_SLOTS_KEPT, FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.routing.outlier import OutlierDetector
from tests.conftest import make_app, serving

HEADERS = {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json"}


def _fleet(n: int = 2) -> FleetState:
    pods = tuple(Pod("a", f"p{i}", f"10.0.0.{i + 1}", 8000) for i in range(n))
    return FleetState(Fleet((Destination("a", "vllm", "http://svc:8000", pods),)))


def _pod(i: int) -> Pod:
    return Pod("a", f"new-{i}", f"10.9.{i // 250}.{i % 250}", 8000)


def _churn(fs: FleetState, pods: int, start: int = 0) -> list[int]:
    """``pods`` new pods, each joining and then leaving; the slots they got."""
    slots = []
    for i in range(start, start + pods):
        slot = fs.add_pod(_pod(i))
        fs.remove_pod(slot)
        slots.append(slot)
    return slots


def test_slots_stay_bounded_as_pods_come_and_go() -> None:
    fs = _fleet(2)
    slots = _churn(fs, 1000)
    # Each departed pod's slot waits for it; past the reserve, the oldest wait ends.
    assert len(fs.pods) == len(fs.load) == len(fs.seeds) == 2 + FREE_SLOTS_KEPT + 1
    assert max(slots) == 2 + FREE_SLOTS_KEPT and fs.members == 0b11
    # The reused slots go round in the order their pods left.
    assert slots[FREE_SLOTS_KEPT + 1 : 2 * FREE_SLOTS_KEPT + 2] == slots[: FREE_SLOTS_KEPT + 1]


def test_a_pod_that_returns_gets_its_slot_back_while_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fleet_module, "FREE_SLOTS_KEPT", 2)
    fs = _fleet(2)
    events: list[tuple[int, str]] = []
    fs.on_change.append(lambda slot, change: events.append((slot, change)))
    pod0 = fs.pods[0]
    fs.drain(0)
    fs.remove_pod(0)
    assert fs.add_pod(pod0) == 0 and fs.is_drained(0)  # back, still drained
    assert events == [(0, "removed"), (0, "added")]

    fs.remove_pod(0)
    _churn(fs, 2)  # two others left after it: three wait, one more than kept
    events.clear()
    taken = fs.add_pod(_pod(99))
    assert taken == 0 and fs.pods[0] == _pod(99)  # the slot of the pod gone longest
    assert events == [(0, "retired"), (0, "added")]
    assert not fs.is_drained(0) and fs.is_available(0)  # the old pod's drain is not its
    assert fs.slot_of(pod0.key) is None  # the old pod is forgotten ...
    back = fs.add_pod(pod0)
    assert back not in (0, None) and not fs.is_drained(back)  # ... and comes back new


def test_the_version_moves_with_every_membership_change() -> None:
    fs = _fleet(2)
    seen = {fs.version}
    pod = fs.pods[1]
    fs.remove_pod(1)
    seen.add(fs.version)
    fs.add_pod(pod)
    seen.add(fs.version)
    fs.add_pod(pod)  # already in: no change
    seen.add(fs.version)
    assert len(seen) == 3


def test_the_observer_never_credits_a_gone_pod_to_its_successor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The member mask is the same before and after a slot changes hands; the address
    cache must notice all the same."""
    monkeypatch.setattr(fleet_module, "FREE_SLOTS_KEPT", 0)
    fs = _fleet(2)
    observer = Observer(fs, OutlierDetector(fs, PassiveHealth()))
    old = fs.pods[1]
    assert observer.slot_at(old.address) == 1
    fs.remove_pod(1)
    new = Pod("a", "other", "10.0.0.77", 8000)
    assert fs.add_pod(new) == 1 and fs.members == 0b11
    assert observer.slot_at(old.address) is None
    assert observer.slot_at(new.address) == 1


def _processor(monkeypatch: pytest.MonkeyPatch) -> App:
    monkeypatch.setattr(fleet_module, "FREE_SLOTS_KEPT", 0)
    fleet = sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(2)])
    return make_app(Config(fleet, Settings(salt_secret=b"s", metrics_listen="off")))


def _body(text: str) -> bytes:
    return (
        b'{"model":"sim-llama","messages":[{"role":"system","content":"'
        + text.encode() * 300
        + b'"}]}'
    )


def _route(proc: App, body: bytes, session: str | None = None) -> Outcome:
    headers = dict(HEADERS, **({"x-session-id": session} if session else {}))
    out = proc.processor.on_body(proc.processor.on_headers(headers, False), body)
    assert out.would_pick is not None, out.action
    return out


def _swap(proc: App, slot: int) -> Pod:
    """The pod in ``slot`` leaves (as discovery removes it) and a new one takes the slot."""
    fleet, index = proc.fleet, proc.index
    fleet.remove_pod(slot)
    index.drop_pod(slot)
    new = Pod(fleet.pods[slot].destination, "successor", "127.0.0.1", 9100)
    assert fleet.add_pod(new) == slot
    index.add_pod(slot)
    return new


def _series(proc: App, name: str) -> dict[str, float]:
    out = {}
    for line in generate_latest(proc.telemetry.registry).decode().splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_a_successor_inherits_nothing_of_the_pod_that_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc = _processor(monkeypatch)
    body = _body("shared system prompt ")
    first = _route(proc, body, session="s1")
    slot, key = first.slot, first.prefix_key
    gone = proc.fleet.pods[slot]
    proc.index.set_capacity(slot, 7)  # learned from the old engine's KV size
    assert proc.placements.get(key) is not None
    proc.observer.record(Observation(mode="prod", upstream=gone.address, status=200))
    assert any(
        f'pod="{gone.id}"' in k for k in _series(proc, "ace_pod_response_prompt_tokens_total")
    )
    picks_before = _series(proc, "ace_picks_total")
    decisions_before = _series(proc, "ace_decisions_total")
    assert any(f'pod="{gone.id}"' in labels for labels in picks_before)

    new = _swap(proc, slot)

    # The index: nothing held, and the bound is the default again, not the old engine's.
    assert proc.index.blocks_held(slot) == 0 and proc.index.capacity_of(slot) != 7
    # The admin API's placements: the prefix is not said to be on the successor.
    assert proc.placements.get(key) is None
    # Metrics: the gone pod's series end, its counts stay in the totals, and the
    # successor starts from nothing.
    picks = _series(proc, "ace_picks_total")
    assert not any(f'pod="{gone.id}"' in labels or f'pod="{new.id}"' in labels for labels in picks)
    assert _series(proc, "ace_decisions_total") == decisions_before
    assert not _series(proc, "ace_pod_response_prompt_tokens_total")  # the responses' too
    # The session whose home was the gone pod is placed as new, by its key, not sent
    # to the successor for being in its old slot.
    picker = proc.picker
    assert all(home != slot for home in picker._sessions.values())  # type: ignore[attr-defined]
    assert _route(proc, _body("a new prompt entirely "), session="s1").slot in (0, 1)
    after = _series(proc, "ace_picks_total")
    assert (
        sum(after.values())
        == sum(picks_before.values())
        - sum(v for k, v in picks_before.items() if f'pod="{gone.id}"' in k)
        + 1
    )


def test_retiring_a_slot_swaps_the_tallies_in_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape copies the tallies without a lock: the dict it holds must not change
    under it, and the tallies it holds must not be added to afterwards."""
    proc = _processor(monkeypatch)
    slot = _route(proc, _body("x ")).slot
    tallies = proc.telemetry._tallies
    held = {key: (t.count, t.prompt_tokens) for key, t in tallies.items()}
    _swap(proc, slot)
    assert proc.telemetry._tallies is not tallies
    assert {key: (t.count, t.prompt_tokens) for key, t in tallies.items()} == held
    _route(proc, _body("x "))
    assert {key: (t.count, t.prompt_tokens) for key, t in tallies.items()} == held


def test_a_probe_in_flight_when_the_slot_changes_hands_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old pod's failing /health, answered after a new pod took its slot, must not
    count against the new pod."""
    monkeypatch.setattr(fleet_module, "FREE_SLOTS_KEPT", 0)
    answer = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        await answer.wait()
        return web.Response(status=503)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        async with serving(app) as port:
            fs = FleetState(sim_fleet([f"127.0.0.1:{port}"]))
            settings = Settings(
                probe_interval_s=0, scrape_interval_s=0, unhealthy_after=1, probe_timeout_s=5
            )
            monitor = FleetMonitor(fs, BlockIndex(100), settings)
            await monitor.start()
            try:
                probe = asyncio.create_task(monitor._probe(0))
                await asyncio.sleep(0.05)  # the request is out
                fs.remove_pod(0)
                assert fs.add_pod(Pod(fs.pods[0].destination, "next", "127.0.0.1", port)) == 0
                answer.set()
                await probe
                assert fs.is_available(0) and not monitor.is_down(0)
                # Checked both ways: the same probe, with the pod still there, takes it out.
                answer.clear()
                probe = asyncio.create_task(monitor._probe(0))
                await asyncio.sleep(0.05)
                answer.set()
                await probe
                assert not fs.is_available(0)
            finally:
                await monitor.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
