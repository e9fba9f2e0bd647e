"""Load accounting: the one owner of each pod's in-flight count and queued prefill.

Between two scrapes a pod's figures would be stale by every request sent since, so
each pick adds its own (``sent``): one more in flight, and the prefill it queues ahead
of the next request there. An engine prefills its running requests' prompts in turn
(vLLM's chunked prefill shares each step's token budget among them), so a new request
waits behind them whether or not the engine reports a waiting queue.

The queue is kept in milliseconds of prefill, each request's compute priced by its
pod's TTFT model (``latency.py``), the same model that prices new work (without the
step's floor: a busy engine's step runs many prefills together): a prompt's cost grows
faster than its length (the attention term), so an 87K-token prompt queues ~2.6x the
time its token count at the linear rate says, and a count of tokens drained at a
flat rate called that pod free seconds before it was (issue 27's short requests
waited behind it). The queue drains in real time, scaled by how much faster than
their model the pods run (``prefill_tokens_per_s``: a simulated fleet on a fast
clock), before each pick (``drain``); each scrape corrects it (``observed``): an idle
engine has none left, except the picks it cannot count yet. A request shows in the
engine's gauges only once its API server has read and tokenized it: a real vLLM on an
idle machine read 0 running for 0.13-0.28 s after a 30K-token prompt was sent
(``bench/gauge_lag.py``), longer on a busy one, and a scrape in that gap wiped the
prompt's queued prefill, so a short request went to the pod about to prefill it (the
real-pod runs' third slowest request, 4.3 s behind a 25K-token document with the other
pod idle). So a pick stays counted until its modelled TTFT has passed, plus
``UNSEEN_MS`` for the hop there. The estimate is only as good as the model's
calibration: a scrape that finds requests waiting on a pod the estimate calls free is
counted, so an operator sees a fleet slower than its model
(``ace_pod_underpriced_waits_total``), and each pod's pace is learned from the TTFT
its engine reports (``pace.py``): far enough from 1, its queue drains at that pace.
The other replicas' placements count too (``routing/replicas.py``).

LoRA adapters are counted the same way (``lora.py``): a pick of adapter A marks A
loaded and in use on the pod; the answers Envoy reports to this router's requests for A
free it (``observe.py``), and each scrape of ``vllm:lora_requests_info`` says what is,
this router's open picks kept (vLLM names a request only from its first token). (The
in-flight count waits for the scrape: an answer reported after a scrape that no longer
counted its request would be taken off twice.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ace_extproc.config import Settings, ttft_models
from ace_extproc.latency import TTFTModel, get_model
from ace_extproc.routing.fleet import ADDED, FleetState
from ace_extproc.routing.metrics_text import LoraInfo
from ace_extproc.routing.pace import PaceLearner, priced
from ace_extproc.routing.plugins import adapter_load_ms

# The queued-prefill estimate drains at most this often.
DRAIN_EVERY_MS = 1.0
# Past its modelled TTFT, how long a pick may still be on its way to the engine's gauges
# (Envoy, the API server's queue, the engine's step), unseen by a scrape.
UNSEEN_MS = 100.0


class LoadAccounting:
    def __init__(
        self,
        fleet: FleetState,
        settings: Settings,
        *,
        active: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``active`` False: nothing is added or drained (no scrapes would correct it:
        without a monitor the estimate would only grow). ``clock``: seconds (the fleet
        simulation's own)."""
        self.fleet = fleet
        self.active = active
        self.clock = clock
        self._default = get_model(settings.ttft_model)
        self._models: dict[str, TTFTModel] = ttft_models(fleet.fleet, settings)
        # Milliseconds of the model's prefill a pod does per millisecond: 1, unless the
        # pods are set to prefill faster (or slower) than their model says.
        rate = settings.prefill_tokens_per_s
        self._speeds = {dest: model.speed(rate) for dest, model in self._models.items()}
        self._speed = self._default.speed(rate)
        # An adapter's load, as the ``lora`` scorer prices it: where it sets none, each
        # destination's model's.
        self._load_ms = adapter_load_ms(settings)
        self._drained_at = clock()
        self.pace = PaceLearner(settings.learn_pace)
        # The adapter slots each destination's pods show (they run one engine
        # configuration): what a pod that has shown none yet is taken to have.
        self._lora_slots: dict[str, int] = {}
        fleet.on_change.append(self._fleet_changed)

    def _fleet_changed(self, slot: int, change: str) -> None:
        if change == ADDED:  # a new process in the slot (its PodLoad is new): learn afresh
            self.pace.forget(slot)

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Count and drain on ``clock`` from now (the fleet simulation's, whose scrapes
        correct the estimate as the monitor's do)."""
        self.clock, self.active = clock, True
        self._drained_at = clock()

    def model_of(self, slot: int) -> TTFTModel:
        """The TTFT model that prices the pod's prefill (its destination's)."""
        return self._models.get(self.fleet.pods[slot].destination, self._default)

    def sent(self, slot: int, uncached: int, cached: int = 0, model: str | None = None) -> int:
        """A request went to ``slot`` with ``uncached`` prompt tokens past the ``cached``
        ones the pod holds warm: its prefill joins the pod's queue, and the adapter
        ``model`` names, if it names one there, is loaded there now. Returns the
        adapter's pick number, for its answer to free (``lora.py``); 0 for none."""
        lora_pick = 0
        if self.active:
            load = self.fleet.load[slot]
            load.inflight += 1
            ttft = self.model_of(slot)
            work = ttft.prefill_work_ms(uncached, cached)
            ahead = load.queued_prefill_ms
            load.queued_prefill_ms += work
            speed = self._model_speed_of(slot)
            now = self.clock()
            alone_ms = ttft.ttft_ms(uncached, cached) / speed
            seen_by = now + (alone_ms * load.pace + UNSEEN_MS) / 1000
            _on_their_way(load.unseen, now).append((seen_by, work))
            # Its TTFT as the model says (pace.py learns how far the engine's is from it).
            model_ms = alone_ms + ahead / speed
            predicted_ms: float | None = model_ms
            if model is not None and load.lora.max_lora:
                # Its adapter's load, where the pod has to (as LoraCost prices it), is
                # part of the TTFT the engine will report; a wait for a slot is not at
                # the pod's pace (pace.py), and such a request teaches none.
                if load.lora.waits_for_slot(model):
                    predicted_ms = None
                else:
                    load_ms = self._load_ms
                    if load_ms is None:
                        load_ms = ttft.adapter_load_ms
                    loading = load.lora.cost_ms(model, load_ms, 0.0) / speed
                    predicted_ms = model_ms + loading
                    if loading:
                        self.pace.stalled(slot, loading)
                lora_pick = load.lora.picked(model, seen_by)
            self.pace.predicted(slot, now, predicted_ms)
        return lora_pick

    def observed(
        self,
        slot: int,
        running: int,
        waiting: int,
        kv_usage: float | None,
        lora: LoraInfo | None = None,
        base_model: str | None = None,
        first_tokens: tuple[float, float] | None = None,
    ) -> None:
        """A scrape's figures for the pod: they replace the estimate's in-flight count
        (picks since are added on top). An idle engine has no prefill left: whatever the
        estimate still holds (a pod faster than its model, prompts more cached than
        believed) is dropped; a busy one keeps it, its running requests may still be
        prefilling; picks it may not count yet keep theirs. Requests waiting where the
        estimate has drained to nothing are counted (``underpriced``): the pod is
        slower than its model, or its prompts longer than the router counts them, and
        a request sent there now would wait though priced as starting at once.
        ``lora``: its adapter slots, where it runs LoRA; ``base_model``: the model it
        serves without an adapter; ``first_tokens``: its TTFT histogram's count and
        sum (seconds), which teach the pod's pace (``pace.py``)."""
        load = self.fleet.load[slot]
        if waiting and self.active and self._queued_now(slot) <= 0.0:
            load.underpriced += 1
        if first_tokens is not None and self.active:
            count, total_s = first_tokens
            idle = running == 0 and waiting == 0
            learned = self.pace.observed(slot, self.clock(), count, total_s, idle)
            load.pace_learned, load.pace = learned, priced(learned)
        load.running, load.waiting = running, waiting
        if kv_usage is not None:
            load.kv_usage = kv_usage
        load.inflight = running + waiting
        now = self.clock()
        destination = self.fleet.pods[slot].destination
        if lora is not None:
            load.lora.scraped(
                base_model, lora.max_lora, lora.in_use, now, lora.running, lora.deferred
            )
            self._lora_slots[destination] = load.lora.max_lora
        elif not load.lora.reported_slots:
            # vLLM shows its adapter series only after its first request: until then a
            # pod (new in the fleet, or restarted) has its destination's other pods'
            # slots, and the adapters of the picks since, not none (which would price
            # every adapter free there and send it the first burst of them all). One
            # that has answered and still shows none runs no LoRA.
            answered = first_tokens is not None and first_tokens[0] > 0
            slots = 0 if answered else self._lora_slots.get(destination, 0)
            load.lora.assume(base_model, slots)
        if running == 0 and waiting == 0:
            unseen = _on_their_way(load.unseen, now)
            # Picks on their way stay queued, at most as much as they added.
            load.inflight = len(unseen)
            load.queued_prefill_ms = min(load.queued_prefill_ms, sum(w for _, w in unseen))
            load.lora.idle(now)

    def _queued_now(self, slot: int) -> float:
        """The pod's queued prefill as ``drain`` would leave it now (not drained: the
        picks drain the fleet, at their own pace)."""
        elapsed_ms = max(0.0, (self.clock() - self._drained_at) * 1000)
        return max(0.0, self.fleet.load[slot].queued_prefill_ms - elapsed_ms * self._speed_of(slot))

    def _speed_of(self, slot: int) -> float:
        """Milliseconds of its model's prefill the pod does per millisecond, at its pace."""
        return self._model_speed_of(slot) / self.fleet.load[slot].pace

    def _model_speed_of(self, slot: int) -> float:
        """The same as the model (and ``prefill_tokens_per_s``) says."""
        return self._speeds.get(self.fleet.pods[slot].destination, self._speed)

    def drain(self, now: float | None = None) -> None:
        """Let the queued prefill drain for the time since it was last looked at;
        called before each pick."""
        if not self.active:
            return
        now = self.clock() if now is None else now
        elapsed_ms = (now - self._drained_at) * 1000
        # At most once a millisecond: at thousands of picks a second a loop over the
        # fleet per pick would cost more than the drain is worth. The time skipped is
        # drained by the next call, nothing is lost.
        if elapsed_ms < DRAIN_EVERY_MS:
            if elapsed_ms < 0:  # a clock not seen before: start from it
                self._drained_at = now
            return
        self._drained_at = now
        speeds, default = self._speeds, self._speed
        pods = self.fleet.pods
        for slot, load in enumerate(self.fleet.load):
            if load.queued_prefill_ms:
                done = elapsed_ms * speeds.get(pods[slot].destination, default) / load.pace
                load.queued_prefill_ms = max(0.0, load.queued_prefill_ms - done)


def _on_their_way(unseen: deque[tuple[float, float]], now: float) -> deque[tuple[float, float]]:
    """``unseen`` without the picks the engine must have counted by ``now``."""
    while unseen and unseen[0][0] <= now:
        unseen.popleft()
    return unseen
