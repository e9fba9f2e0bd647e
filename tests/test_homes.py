"""Where stored Responses-API responses live (routing/homes.py), and reading a stored
response's id from the answer as it passes (response_id.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from ace_extproc.config import Pod, sim_fleet
from ace_extproc.response_id import HEAD_BYTES, StoredId
from ace_extproc.routing import FleetState
from ace_extproc.routing.homes import (
    AWAITED_FOR_S,
    LOST,
    PINNED,
    UNAVAILABLE,
    UNKNOWN,
    ResponseHomes,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def homes(capacity: int = 100, ttl_s: float = 0.0) -> tuple[ResponseHomes, FleetState, Clock]:
    fleet = FleetState(sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(3)]))
    clock = Clock()
    return ResponseHomes(fleet, capacity, ttl_s, clock), fleet, clock


def test_answers_sent_to_be_stored_are_awaited_until_noted_or_ended() -> None:
    h, fleet, clock = homes()
    assert not h.awaits("acme")
    h.expect("acme")
    h.expect("acme")
    assert h.awaits("acme") and not h.awaits("globex")
    h.remember("acme", "resp_1", fleet.pods[0].key)  # one noted
    assert h.awaits("acme")
    h.settle("acme")  # one ended without an id (an error, a stream cut short)
    assert not h.awaits("acme")
    h.settle("acme")  # more settled than awaited (another replica's): harmless
    h.expect("acme")
    assert h.found == {PINNED: 0, UNKNOWN: 0, LOST: 0, UNAVAILABLE: 0}  # peeks uncounted
    clock.now += AWAITED_FOR_S + 1  # never observed: not awaited forever
    assert not h.awaits("acme")


def test_a_turn_waits_for_its_previous_response_only_while_one_is_awaited() -> None:
    h, fleet, _ = homes()  # its clock stands still: only being noted or settled ends a wait

    async def main() -> None:
        await asyncio.wait_for(h.noted("acme", "resp_1", 60), 1)  # nothing awaited
        h.expect("acme")
        waiting = asyncio.create_task(h.noted("acme", "resp_1", 60))
        await asyncio.sleep(0.01)
        h.remember("acme", "resp_0", fleet.pods[0].key)
        h.expect("acme")  # another answer: still awaited, so still waiting
        await asyncio.sleep(0.01)
        assert not waiting.done()
        h.remember("acme", "resp_1", fleet.pods[1].key)
        await asyncio.wait_for(waiting, 1)
        assert h.peek("acme", "resp_1").slot == 1

    asyncio.run(main())


def test_a_stored_response_pins_its_tenant_s_turns_to_its_pod() -> None:
    h, fleet, _ = homes()
    h.remember("acme", "resp_1", fleet.pods[2].key)
    found = h.find("acme", "resp_1")
    assert (found.result, found.slot, found.pod) == (PINNED, 2, fleet.pods[2].key)
    # Another tenant naming the same id is not pinned there: unknown to it.
    assert h.find("globex", "resp_1").result == UNKNOWN
    assert h.find("acme", "resp_2").result == UNKNOWN
    assert h.found == {PINNED: 1, UNKNOWN: 2, LOST: 0, UNAVAILABLE: 0}


def test_memory_is_bounded_least_recently_used_first() -> None:
    h, fleet, _ = homes(capacity=3)
    pod = fleet.pods[0].key
    for i in range(3):
        h.remember("t", f"resp_{i}", pod)
    assert h.find("t", "resp_0").result == PINNED  # used: now the most recent
    h.remember("t", "resp_3", pod)
    assert len(h) == 3
    assert h.find("t", "resp_1").result == UNKNOWN  # the least recently used went
    assert all(h.find("t", f"resp_{i}").result == PINNED for i in (0, 2, 3))
    none, _, _ = homes(capacity=0)
    none.remember("t", "resp_0", pod)
    assert len(none) == 0 and none.find("t", "resp_0").result == UNKNOWN


def test_a_ttl_forgets_old_responses() -> None:
    h, fleet, clock = homes(ttl_s=60)
    h.remember("t", "resp_1", fleet.pods[0].key)
    clock.now += 59
    assert h.find("t", "resp_1").result == PINNED
    clock.now += 2
    assert h.find("t", "resp_1").result == UNKNOWN and len(h) == 0


def test_a_pod_out_of_service_is_unavailable_and_a_drained_one_still_serves() -> None:
    h, fleet, _ = homes()
    h.remember("t", "resp_1", fleet.pods[1].key)
    fleet.drain(1)  # a drain stops new conversations, not this one's
    assert h.find("t", "resp_1").result == PINNED
    fleet.set_available(1, False)
    down = h.find("t", "resp_1")
    assert down.result == UNAVAILABLE and "health checks" in down.why
    fleet.set_available(1, True)
    fleet.set_ejected(1, True)
    assert h.find("t", "resp_1").result == UNAVAILABLE
    fleet.set_ejected(1, False)
    assert h.find("t", "resp_1").result == PINNED


def test_a_pod_back_in_service_waits_for_its_scrape_to_say_whether_it_restarted() -> None:
    """Back from failing health checks, a pod may be a new process: until its next
    scrape says, a continuation there is unavailable (503, it may pass), never sent to
    an engine that would answer a bare 404. Then pinned, or lost if it restarted."""
    h, fleet, clock = homes()
    h.remember("t", "resp_1", fleet.pods[1].key)
    h.remember("t", "resp_2", fleet.pods[2].key)
    for slot in (1, 2):
        h.back(slot)
    waiting = h.find("t", "resp_1")
    assert waiting.result == UNAVAILABLE and "restarted" in waiting.why
    h.checked(1)  # the same process
    assert h.find("t", "resp_1").result == PINNED
    clock.now += 1
    h.restarted(2)  # a new one
    h.checked(2)
    assert h.find("t", "resp_2").result == LOST


def test_a_pod_that_left_rejoined_restarted_or_was_replaced_has_lost_the_state() -> None:
    h, fleet, clock = homes()
    for slot in range(3):
        h.remember("t", f"resp_{slot}", fleet.pods[slot].key)
    fleet.remove_pod(0)
    left = h.find("t", "resp_0")
    assert left.result == LOST and "left the fleet" in left.why
    clock.now += 1
    fleet.add_pod(fleet.pods[0])  # back: a new process as far as anyone knows
    back = h.find("t", "resp_0")
    assert back.result == LOST and "restarted" in back.why
    h.remember("t", "resp_0b", fleet.pods[0].key)  # what it stores from now on is its own
    assert h.find("t", "resp_0b").result == PINNED
    clock.now += 1
    h.restarted(1)  # the monitor saw its counters go back
    assert h.find("t", "resp_1").result == LOST
    # Replaced: its slot taken by another pod once enough have left.
    fleet.free_slots_kept = 0
    fleet.remove_pod(2)
    fleet.add_pod(Pod("sim", "new", "127.0.0.1", 9000))
    fleet.add_pod(Pod("sim", "newer", "127.0.0.1", 9001))
    gone = h.find("t", "resp_2")
    assert gone.result == LOST and gone.pod == "sim/pod-2"


def test_an_unknown_pod_s_response_is_lost() -> None:
    """Learned from a replica that knows a pod this one does not (any more)."""
    h, _, _ = homes()
    h.remember("t", "resp_1", "sim/elsewhere")
    assert h.find("t", "resp_1").result == LOST


# ------------------------------------------------------------------ the id, as it passes


def feed(data: bytes, step: int) -> str | None:
    reader = StoredId()
    for start in range(0, len(data), step):
        reader.feed(data[start : start + step])
    return reader.result()


def event(kind: str, data: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@pytest.mark.parametrize("step", [1, 7, 1000, 10**6])
def test_the_id_of_a_json_answer(step: int) -> None:
    answer = {"id": "resp_abc", "object": "response", "output": [{"text": "x" * 100_000}]}
    assert feed(json.dumps(answer).encode(), step) == "resp_abc"
    # Not in front: the whole answer is read, if it fits what is held.
    late = {"object": "response", "id": "resp_late"}
    assert feed(json.dumps(late).encode(), step) == "resp_late"
    too_late = {"object": "response", "output": "y" * HEAD_BYTES, "id": "resp_x"}
    assert feed(json.dumps(too_late).encode(), step) is None
    assert feed(b'{"id": "resp_\\u00e9"}', step) == "resp_\u00e9"  # escapes decoded


@pytest.mark.parametrize("step", [1, 5, 64, 10**6])
def test_the_id_of_a_stream_once_it_has_completed(step: int) -> None:
    created = event(
        "response.created",
        {
            "response": {"id": "resp_s", "output": []},
            "sequence_number": 0,
            "type": "response.created",
        },
    )
    # Generated text that says so does not end the stream.
    tricky = 'the "response.completed"\nevent: response.completed'
    delta = event(
        "response.output_text.delta", {"delta": tricky, "type": "response.output_text.delta"}
    )
    cut_short = created + delta * 3
    assert feed(cut_short, step) is None  # vLLM stores a stream only at its end
    done = event("response.completed", {"response": {"id": "resp_s"}, "type": "response.completed"})
    assert feed(cut_short + done, step) == "resp_s"
    crlf = (created + done).replace(b"\n", b"\r\n")
    assert feed(crlf, step) == "resp_s"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b'{"error": {"message": "Response with id \'resp_1\' not found."}}',
        b"not json",
        b"data: [DONE]\n\n",
        b"event: response.in_progress\ndata: {}\n\nevent: response.completed\ndata: {}\n\n",
        b"data: {not json}\n\n",
    ],
)
def test_no_id_where_the_answer_has_none(data: bytes) -> None:
    assert feed(data, 3) is None


def test_the_id_is_ready_as_soon_as_the_engine_has_stored_the_response() -> None:
    """A JSON answer is stored before it is sent: its leading id is enough. A stream is
    stored just before its terminal event: not before that has passed."""
    json_answer = StoredId()
    json_answer.feed(b'{"id": "resp_1", "output": [')
    assert json_answer.ready() == "resp_1"
    stream = StoredId()
    stream.feed(
        event("response.created", {"response": {"id": "resp_2"}, "type": "response.created"})
    )
    assert stream.ready() is None
    stream.feed(b"event: response.completed\ndata: {")
    assert stream.ready() == "resp_2"
