"""Load accounting: the one owner of each pod's in-flight count and queued prefill.

Between two scrapes a pod's figures would be stale by every request sent since, so
each pick adds its own (``sent``): one more in flight, and the prefill it queues ahead
of the next request there. An engine prefills its running requests' prompts in turn
(vLLM's chunked prefill shares each step's token budget among them), so a new request
waits behind them whether or not the engine reports a waiting queue. The estimate
drains at the pods' prefill rate (``drain``, before each pick), and each scrape
corrects it (``observed``): an idle engine has none left. The other replicas'
placements count too (``routing/replicas.py``). The simulation keeps these figures
exact, so there the accounting is off.
"""

from __future__ import annotations

import time

from ace_extproc.config import Settings, ttft_models
from ace_extproc.latency import get_model
from ace_extproc.routing.fleet import FleetState

# The queued-prefill estimate drains at most this often.
DRAIN_EVERY_MS = 1.0


class DrainRate:
    """Prefill drained at ``tokens_per_s``, in whole tokens. ``drain`` runs before every
    pick, so the intervals are short: the fraction of a token is carried to the next
    call, or at a few thousand picks a second most of the drain would be rounded away."""

    __slots__ = ("carry", "ms_per_token")

    def __init__(self, tokens_per_s: float) -> None:
        self.ms_per_token = 1000.0 / tokens_per_s
        self.carry = 0.0

    def tokens(self, elapsed_ms: float) -> int:
        due = elapsed_ms / self.ms_per_token + self.carry
        whole = int(due + 1e-9)  # 2,499.9999 tokens of float error is 2,500
        self.carry = max(0.0, due - whole)
        return whole


class LoadAccounting:
    def __init__(self, fleet: FleetState, settings: Settings, *, active: bool = True) -> None:
        """``active`` False: nothing is added or drained (no scrapes would correct it:
        without a monitor the estimate would only grow)."""
        self.fleet = fleet
        self.active = active
        # How fast the prefill this replica sent drains: the pods' prefill rate (the
        # setting, else their destination's TTFT model).
        rate = settings.prefill_tokens_per_s or get_model(settings.ttft_model).prefill_tokens_per_s
        self._drain = DrainRate(rate)
        self._drain_by_destination: dict[str, DrainRate] = {}  # those of another model
        if not settings.prefill_tokens_per_s:
            for dest, model in ttft_models(fleet.fleet, settings).items():
                if model.prefill_tokens_per_s != rate:
                    self._drain_by_destination[dest] = DrainRate(model.prefill_tokens_per_s)
        self._drained_at = time.monotonic()

    def sent(self, slot: int, prefill_tokens: int) -> None:
        """A request went to ``slot`` with ``prefill_tokens`` it does not hold warm."""
        if self.active:
            load = self.fleet.load[slot]
            load.inflight += 1
            load.queued_prefill_tokens += prefill_tokens

    def observed(self, slot: int, running: int, waiting: int, kv_usage: float | None) -> None:
        """A scrape's figures for the pod: they replace the estimate's in-flight count
        (picks since are added on top). An idle engine has no prefill left: whatever the
        estimate still holds (a pod faster than the drain rate, prompts more cached than
        believed) is dropped; a busy one keeps it, its running requests may still be
        prefilling."""
        load = self.fleet.load[slot]
        load.running, load.waiting = running, waiting
        if kv_usage is not None:
            load.kv_usage = kv_usage
        load.inflight = running + waiting
        if running == 0 and waiting == 0:
            load.queued_prefill_tokens = 0

    def drain(self, now: float | None = None) -> None:
        """Let the queued prefill drain at the pods' prefill rate since it was last
        looked at; called before each pick."""
        if not self.active:
            return
        now = time.monotonic() if now is None else now
        elapsed_ms = (now - self._drained_at) * 1000
        # At most once a millisecond (~25 tokens at the model's rate): at thousands of
        # picks a second a loop over the fleet per pick would cost more than the drain
        # is worth. The time skipped is drained by the next call, nothing is lost.
        # (Less a nanosecond: a millisecond measured between two float clock readings
        # can come out a hair short, and the drain would then wait another whole one.)
        if elapsed_ms < DRAIN_EVERY_MS - 1e-6:
            if elapsed_ms < 0:  # a clock not seen before: start from it
                self._drained_at = now
            return
        self._drained_at = now
        done = self._drain.tokens(elapsed_ms)
        if not self._drain_by_destination:  # every pod at the router's rate
            for load in self.fleet.load:
                if load.queued_prefill_tokens:
                    load.queued_prefill_tokens = max(0, load.queued_prefill_tokens - done)
            return
        done_by = {d: rate.tokens(elapsed_ms) for d, rate in self._drain_by_destination.items()}
        pods = self.fleet.pods
        for slot, load in enumerate(self.fleet.load):
            if load.queued_prefill_tokens:
                drained = done_by.get(pods[slot].destination, done)
                load.queued_prefill_tokens = max(0, load.queued_prefill_tokens - drained)
