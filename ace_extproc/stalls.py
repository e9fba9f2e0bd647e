"""A watchdog for the event loop: what held it, and for how long.

Every ext_proc message is answered on the one event loop. Envoy waits
``message_timeout`` (1 s by default) for an answer, then lets the request through
undecided (``failure_mode_allow``) or fails it, so a loop held up for a second shows
only as requests that went anywhere. The loop beats every ``interval_s``; a thread
checks the beat, and when it is ``threshold_s`` late (a quarter of Envoy's timeout by
default) logs what it finds: the loop thread's stack (the Python code holding it, or
only the loop's own frames when it is in C or waiting for the GIL), every other thread
running Python (one holding the GIL), the process's CPU time since the last beat
(near the stall's length: something computed; far under it: the process was starved
of CPU, or blocked in a system call), and the time garbage collection took in it.
Each stall is counted when it ends (``ace_event_loop_stalls_total``,
``ace_event_loop_stall_seconds_total``, the longest), so an operator can tell a
stalled sidecar from a slow network.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ace_extproc.logs import RateLimit

log = logging.getLogger("ace_extproc.stalls")

STACK_FRAMES = 12  # the innermost frames logged: enough to name the culprit


# Where an idle thread waits: a pool worker for work, a server for a connection.
_IDLE = frozenset({("threading.py", "wait"), ("queue.py", "get"), ("selectors.py", "select")})


def _idle(frame: FrameType) -> bool:
    code = frame.f_code
    return (code.co_filename.rsplit("/", 1)[-1], code.co_name) in _IDLE


class LoopWatchdog(Collector):
    def __init__(
        self,
        threshold_s: float = 0.25,
        interval_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.clock = clock
        self.last_beat = clock()
        self.cpu_at_beat = time.process_time()
        self.stalls = 0  # stalls over the threshold, ended
        self.stalled_s = 0.0  # their total length
        self.longest_s = 0.0
        self._loop_thread = threading.get_ident()
        self._in_stall = False
        self._stall_s = 0.0  # the stall under way: the latest the beat has been
        self._logs = RateLimit(6, 60.0, clock)
        self._gc_since_beat = 0.0  # seconds collecting garbage since the last beat
        self._gc_began = 0.0  # perf_counter at the start of a collection under way
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the loop's side -------------------------------------------------------------
    async def beat(self) -> None:
        """Until cancelled, on the loop to watch: its heartbeat."""
        self._loop_thread = threading.get_ident()
        while True:
            self.last_beat = self.clock()
            self.cpu_at_beat = time.process_time()
            self._gc_since_beat = 0.0
            await asyncio.sleep(self.interval_s)

    # -- the watching thread ---------------------------------------------------------
    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._watch, name="ace-loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began:
            self._gc_since_beat += time.perf_counter() - self._gc_began
            self._gc_began = 0.0

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def check(self) -> None:
        """One look at the beat: a stall begun is logged with the loop's stack, one
        ended is counted (its length is how late the beat came)."""
        late = self.clock() - self.last_beat - self.interval_s
        if late >= self.threshold_s:
            if not self._in_stall:
                self._in_stall = True
                if self._logs.allow("stall"):
                    log.warning(
                        "event loop held for %.0f ms so far (Envoy fails a request open "
                        "at its message_timeout), the process using %.0f ms of CPU since "
                        "its last beat, garbage collection %.0f ms; the loop thread is "
                        "at:\n%s",
                        late * 1000,
                        (time.process_time() - self.cpu_at_beat) * 1000,
                        self._gc_ms(),
                        self._stacks(),
                    )
            self._stall_s = late
        elif self._in_stall:
            self._in_stall = False
            self.stalls += 1
            self.stalled_s += self._stall_s
            self.longest_s = max(self.longest_s, self._stall_s)

    def _gc_ms(self) -> float:
        """Garbage collection since the last beat, a collection under way included."""
        began = self._gc_began
        under_way = time.perf_counter() - began if began else 0.0
        return (self._gc_since_beat + under_way) * 1000

    def _stacks(self) -> str:
        """The loop thread's stack, then any other thread's that is in Python code
        (idle threads wait in a known few places: not worth a line)."""
        frames = sys._current_frames()
        own = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        loop = frames.get(self._loop_thread)
        out = ["".join(traceback.format_stack(loop, limit=STACK_FRAMES)) if loop else "  ?\n"]
        for ident, frame in frames.items():
            if ident in (own, self._loop_thread) or _idle(frame):
                continue
            stack = "".join(traceback.format_stack(frame, limit=STACK_FRAMES))
            out.append(f"thread {names.get(ident, ident)}:\n{stack}")
        return "".join(out)

    # -- metrics ---------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "ace_event_loop_stalls",
            f"Times the event loop was held {self.threshold_s * 1000:.0f} ms or more "
            "(counted when they end).",
            value=self.stalls,
        )
        yield CounterMetricFamily(
            "ace_event_loop_stall_seconds",
            "The time those stalls held the loop.",
            value=self.stalled_s,
        )
        yield GaugeMetricFamily(
            "ace_event_loop_longest_stall_seconds",
            "The longest of them since the process started.",
            value=self.longest_s,
        )
