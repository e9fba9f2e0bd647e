"""The event loop's watchdog: a held loop is logged with the code holding it, and
counted once it ends; a loop that turns is not."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ace_extproc.stalls import LoopWatchdog


def hold_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # blocking, as a slow call on the loop would be


async def _run(watchdog: LoopWatchdog, body: float) -> None:
    beat = asyncio.create_task(watchdog.beat())
    watchdog.start()
    try:
        await asyncio.sleep(0.1)
        if body:
            hold_the_loop_for(body)
        await asyncio.sleep(0.2)  # the beat comes back; the stall is counted
    finally:
        beat.cancel()
        watchdog.stop()


def test_a_held_loop_is_logged_with_its_culprit_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watchdog = LoopWatchdog(threshold_s=0.1, interval_s=0.02)
    with caplog.at_level(logging.WARNING, logger="ace_extproc.stalls"):
        asyncio.run(_run(watchdog, 0.5))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "hold_the_loop_for" in warnings[0] and "time.sleep" in warnings[0]
    # Sleeping uses no CPU: the log tells a blocked loop from a computing one.
    cpu_ms = float(re.search(r"using (\d+) ms of CPU", warnings[0]).group(1))  # type: ignore[union-attr]
    assert cpu_ms < 100
    assert watchdog.stalls == 1
    assert 0.3 <= watchdog.longest_s <= 1.5  # held 0.5 s (a busy CI machine resumes late)
    assert watchdog.stalled_s == watchdog.longest_s


def test_a_turning_loop_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    watchdog = LoopWatchdog(threshold_s=0.25, interval_s=0.02)
    with caplog.at_level(logging.WARNING, logger="ace_extproc.stalls"):
        asyncio.run(_run(watchdog, 0.0))
    assert watchdog.stalls == 0 and not caplog.records


def test_stalls_are_exposed_as_metrics() -> None:
    clock = [100.0]
    watchdog = LoopWatchdog(threshold_s=0.25, interval_s=0.05, clock=lambda: clock[0])
    watchdog.last_beat = 100.0
    clock[0] = 100.8  # no beat for 0.8 s
    watchdog.check()
    watchdog.last_beat = clock[0] = 100.85  # it beat again
    watchdog.check()
    registry = CollectorRegistry()
    registry.register(watchdog)
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples["ace_event_loop_stalls_total"] == 1
    # Late by 0.75 s past the beat that was due 0.05 s after the last.
    assert samples["ace_event_loop_longest_stall_seconds"] == pytest.approx(0.75)
    assert samples["ace_event_loop_stall_seconds_total"] == pytest.approx(0.75)


def spin_in_python(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_the_log_names_other_threads_running_python_not_idle_ones() -> None:
    watchdog = LoopWatchdog()
    stop, idle = threading.Event(), threading.Event()
    busy = threading.Thread(target=spin_in_python, args=(stop,), name="busy-one")
    waiting = threading.Thread(target=idle.wait, name="idle-one")
    busy.start(), waiting.start()
    try:
        time.sleep(0.05)
        stacks = watchdog._stacks()
    finally:
        stop.set(), idle.set()
        busy.join(), waiting.join()
    assert "thread busy-one:" in stacks and "spin_in_python" in stacks
    assert "idle-one" not in stacks


def test_garbage_collection_in_a_stall_is_timed() -> None:
    watchdog = LoopWatchdog()
    watchdog.start()
    try:
        garbage = [[i] for i in range(200_000)]
        for item in garbage:
            item.append(item)  # cycles: only the collector frees them
        del garbage, item
        gc.collect()
    finally:
        watchdog.stop()
    assert watchdog._gc_ms() > 0 and watchdog._on_gc not in gc.callbacks


def test_the_liveness_probe_follows_the_watchdog_s_heartbeat() -> None:
    from ace_extproc.probes import STALE_S, Probes

    now = [100.0]
    watchdog = LoopWatchdog(clock=lambda: now[0])
    probes = Probes(clock=lambda: now[0], heartbeat=watchdog)
    now[0] += STALE_S - 1
    assert probes.alive()
    now[0] += 2  # no beat for longer than STALE_S: the loop is stuck
    assert not probes.alive()
    watchdog.last_beat = now[0]  # it beat again
    assert probes.alive()
