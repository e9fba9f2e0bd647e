"""Passive health: pods taken out for failing the requests they serve, as Envoy's
outlier detection does it, from the responses Envoy's access log reports.

A pod whose own answers fail ``consecutive_5xx`` times in a row (any 5xx), or
``consecutive_gateway_failure`` times (502, 503, 504, or Envoy unable to reach it or
reset by it) is *ejected*: it takes no new requests for ``base_ejection_time_s``
times the number of times it has been ejected (backing off a pod that keeps
failing, up to ``max_ejection_time_s``), then comes back on its own. Any answer
below 500 resets its counts. Its index is kept: an ejected pod was answering, so it
did not restart (a restart shows in its scraped counters, ``monitor.py``).

Clients can make an engine fail (a body nested 10,000 deep is a 500 from vLLM's own
JSON parser), so no client can empty a destination: at most
``max_ejection_percent`` of its pods are out at once (at least one, as in Envoy),
and the requests the router already knew to be malformed do not count
(``observe.py``). The active checks (``monitor.py``'s probes) are apart from this:
a pod they mark down is down whatever its answers say.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ace_extproc.config import PassiveHealth
from ace_extproc.routing.fleet import ADDED, REMOVED, RETIRED, FleetState

log = logging.getLogger("ace_extproc.outlier")

# Statuses that say the pod (or whatever is in front of it) could not serve.
GATEWAY_FAILURES = frozenset({502, 503, 504})

Scheduler = Callable[[float, Callable[[], None]], object]


@dataclass(slots=True)
class _PodRecord:
    in_a_row_5xx: int = 0
    in_a_row_gateway: int = 0
    ejections: int = 0  # the backoff multiplier
    back_at: float = 0.0  # when it last came back (the multiplier decays from then)
    epoch: int = 0  # bumped on every ejection and membership change: stale timers do nothing


class OutlierDetector:
    def __init__(
        self,
        fleet: FleetState,
        settings: PassiveHealth,
        clock: Callable[[], float] = time.monotonic,
        schedule: Scheduler | None = None,
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self._clock = clock
        self._schedule = schedule  # default: the running event loop's call_later
        self._records: dict[int, _PodRecord] = {}
        self.ejections_total = 0
        fleet.on_change.append(self._membership)

    def success(self, slot: int) -> None:
        record = self._records.get(slot)
        if record is not None:
            record.in_a_row_5xx = record.in_a_row_gateway = 0

    def failure(self, slot: int, status: int) -> None:
        """A failed answer from the pod: its ``status`` (>= 500), or 0 where Envoy
        could not reach it or was reset (a gateway failure)."""
        record = self._records.setdefault(slot, _PodRecord())
        if status == 0 or status in GATEWAY_FAILURES:
            record.in_a_row_gateway += 1
        else:
            record.in_a_row_gateway = 0
        record.in_a_row_5xx += 1
        s = self.settings
        if (
            record.in_a_row_5xx >= s.consecutive_5xx
            or record.in_a_row_gateway >= s.consecutive_gateway_failure
        ):
            self._eject(slot, record)

    def _eject(self, slot: int, record: _PodRecord) -> None:
        fleet = self.fleet
        if fleet.is_ejected(slot) or not fleet.is_member(slot):
            return
        if not self._room(slot):
            return  # the cap: the counts stay, so the next failure asks again
        now = self._clock()
        s = self.settings
        if record.ejections and now - record.back_at > s.max_ejection_time_s:
            record.ejections = 0  # well long enough since: a first offence again
        record.ejections += 1
        record.in_a_row_5xx = record.in_a_row_gateway = 0
        record.epoch += 1
        seconds = min(s.base_ejection_time_s * record.ejections, s.max_ejection_time_s)
        seconds = max(seconds, s.base_ejection_time_s)
        fleet.set_ejected(slot, True)
        self.ejections_total += 1
        log.warning(
            "pod %s taken out for %.0f s: its requests failed (ejection %d)",
            fleet.pods[slot].key,
            seconds,
            record.ejections,
        )
        epoch = record.epoch
        self._after(seconds, lambda: self._return(slot, epoch))

    def _room(self, slot: int) -> bool:
        """Whether one more of ``slot``'s destination's pods may be out."""
        fleet = self.fleet
        dest = fleet.pods[slot].destination
        pods = [s for s, p in enumerate(fleet.pods) if p.destination == dest and fleet.is_member(s)]
        out = sum(1 for s in pods if fleet.is_ejected(s))
        cap = max(1, len(pods) * self.settings.max_ejection_percent // 100)
        return out < cap

    def _return(self, slot: int, epoch: int) -> None:
        record = self._records.get(slot)
        if record is None or record.epoch != epoch or not self.fleet.is_ejected(slot):
            return
        record.back_at = self._clock()
        self.fleet.set_ejected(slot, False)
        log.info("pod %s is back after its ejection; its index was kept", self.fleet.pods[slot].key)

    def _after(self, seconds: float, then: Callable[[], None]) -> None:
        if self._schedule is not None:
            self._schedule(seconds, then)
        else:
            asyncio.get_running_loop().call_later(seconds, then)

    def _membership(self, slot: int, change: str) -> None:
        """A pod that left, or another in its slot, starts with a clean record."""
        if change in (ADDED, REMOVED, RETIRED):
            record = self._records.pop(slot, None)
            if record is not None and self.fleet.is_ejected(slot):
                self.fleet.set_ejected(slot, False)
