"""Each pod's pace: how much slower (or faster) than its TTFT model it really runs,
learned from the TTFT the engine itself reports.

The queued-prefill estimate (``load.py``) and the prefill and queue prices
(``pipeline.py``) are in milliseconds of the pod's TTFT model. A pod slower than its
model (another GPU generation in the pool, a throttled or shared host, a CPU build on a
busy machine) drains its queue later than the estimate does, so the router calls it
free while it is still prefilling, and sends it short requests that then wait (issue
27's 7.7-12.3 s waits, the real-engine tier's flaky test on a machine 3-4x slower than
its model). A fixed rate (``router.prefill_tokens_per_s``) can be set by an operator
who knows; this learns it, per pod, from what the engines already publish.

Each pick predicts its TTFT there as the model says: the pod's queue, its own prefill,
its adapter's load and the API server's share (``predicted``). vLLM and SGLang count
every first token in a histogram (``vllm:time_to_first_token_seconds``,
``sglang:time_to_first_token_seconds``: from arrival to first token, queue included);
each scrape reads its ``_count`` and ``_sum`` (``observed``). The new first tokens are
matched with the oldest predictions still open (first tokens come out roughly in the
order requests went in; a window's means, not single requests, are compared), and the
learned pace moves toward the ratio of the two means, in log space, by a step that
grows with the requests in the window. It learns whatever makes the pod's requests
slower than the model says: compute, a batch's decode steps, tokens the router counts
short (without the model's tokenizer).

Routing uses the pace once it leaves the model's own error (``BAND``): inside it, pods
are priced as the model says. Pods that run as modelled learn paces a little off 1
and each other (a busy pod's decode steps, the noise of a few dozen requests), and
pricing by those differences only reorders pods the model calls equal, which it then
breaks by the requests in flight (in the simulation, conv-burst's short requests waited
longer at the median).

Means, not sums: a window may hold first tokens of requests this replica did not send
(another replica, another gateway); they are taken as like its own. A pod that serves
much other traffic of another shape teaches a pace partly theirs. Predictions that
never get a first token (a rejected or cancelled request) expire, and an idle pod has
none left to come. An engine restart (its counters go back) starts the counting afresh
and keeps the pace: the hardware is the same.

A request that waits for a LoRA adapter's slot (every slot's adapter in use) teaches
nothing: its wait lasts until another adapter's requests have all finished, which the
model prices as one answer's decode but which is as long as those requests' answers,
not the pod's pace. A window that holds one is matched and passed over (when such
waits taught the pace, simulated pods 3x slower than their model learned paces up to 7
on a LoRA workload, and its TTFT p99 was 1.35x the fixed pace's; now 2.8, and 0.97x).
An adapter's load stalls the engine's whole step, so every request open on the pod gets
its first token that much later than predicted: each load a pick causes moves the open
predictions with it (``stalled``; unmoved, pods that run as modelled learned paces up to
1.55 on a LoRA workload, past the band). A request whose first token came before the
stall but is not yet matched is moved too: the window's mean errs by a fraction of a load.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# The pace stays within these: a pod more than 8x off its model has the wrong model
# named, or prompts the router counts far short (no tokenizer: the real-engine tier's
# CPU pods reached the bound on a busy machine), and its alert (AcePodOffItsModel) says
# so; a bound keeps one bad window from pricing a pod out of the fleet.
MIN_PACE, MAX_PACE = 0.125, 8.0
# Within this factor of 1 a learned pace is the model's own error (the CPU pods' fit is
# within 10% RMS, the GPU models are fitted to public figures, and the decode steps of
# a busy batch are left out): routing prices such a pod as the model says. Pods that run
# as modelled learn paces up to 1.25 in the fleet simulation under load (bench.pace_sim);
# with a band of 1.25, hot-prefix's short requests waited longer at the median.
BAND = 1.5
# A window's ratio counts at most this much toward the pace (its log), and a window of
# n first tokens moves it by n / (n + WEIGHT_N) of the way, at most half: one request's
# TTFT is noisy (its place in a batch), a few dozen are not.
MAX_STEP = 2.0
WEIGHT_N = 16.0
# A prediction older than this without a first token is dropped (a request rejected,
# cancelled, or lost): it would otherwise be matched with a later request's first token.
EXPIRE_S = 120.0
# The most open predictions kept per pod (a pod whose scrapes fail keeps none longer).
MAX_OPEN = 4096


@dataclass(slots=True)
class PodPace:
    """One pod's learning: its open predictions and the engine's counters last read."""

    # (sent at, the model's ms, ``stalled_ms`` then; the ms None where it waits on what
    # the model cannot see)
    open: deque[tuple[float, float | None, float]] = field(default_factory=deque)
    stalled_ms: float = 0.0  # the engine's stalls so far (adapter loads), summed
    count: float | None = None  # the engine's first tokens so far, at the last scrape
    total_s: float = 0.0  # and their TTFT, summed
    learned: float = 1.0


def _stalled(entry: tuple[float, float | None, float], stalled_ms: float) -> float | None:
    """An open prediction's ms with the pod's stalls since it was made."""
    _, model_ms, stalled_then = entry
    return None if model_ms is None else model_ms + stalled_ms - stalled_then


def priced(learned: float) -> float:
    """The pace routing uses for a pod that learned ``learned``: 1 within ``BAND``."""
    return learned if not 1 / BAND < learned < BAND else 1.0


class PaceLearner:
    """Predictions in, engine counters in, each pod's learned pace out."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pods: dict[int, PodPace] = {}

    def predicted(self, slot: int, now: float, model_ms: float | None) -> None:
        """A request went to ``slot`` at ``now``; its first token is due ``model_ms``
        later as the pod's model says (real milliseconds, at the model's pace), or, with
        ``None``, after a wait the model does not know (an adapter slot's)."""
        if not self.enabled:
            return
        pod = self._pods.get(slot)
        if pod is None:
            pod = self._pods[slot] = PodPace()
        pod.open.append((now, model_ms, pod.stalled_ms))
        if len(pod.open) > MAX_OPEN:
            pod.open.popleft()

    def stalled(self, slot: int, model_ms: float) -> None:
        """The pod's engine will stall a step for ``model_ms`` (a LoRA adapter's load):
        every request open there gets its first token that much later (each open
        prediction takes the stalls since it was made when it is matched)."""
        pod = self._pods.get(slot)
        if pod is not None and self.enabled:
            pod.stalled_ms += model_ms

    def open_predictions(self, slot: int) -> list[float | None]:
        """The pod's open predictions, oldest first, the stalls since each included."""
        pod = self._pods.get(slot)
        if pod is None:
            return []
        return [_stalled(entry, pod.stalled_ms) for entry in pod.open]

    def observed(self, slot: int, now: float, count: float, total_s: float, idle: bool) -> float:
        """A scrape's TTFT counters for the pod (``count`` first tokens so far, ``total_s``
        their summed TTFT): its learned pace, moved by what the new first tokens say.
        ``idle``: the engine reports nothing running or waiting."""
        pod = self._pods.get(slot)
        if pod is None:
            pod = self._pods[slot] = PodPace()
        last, last_total = pod.count, pod.total_s
        pod.count, pod.total_s = count, total_s
        if last is None or count < last or total_s < last_total:
            # The first scrape, or a restarted engine: what is open was for the old one.
            if last is not None:
                pod.open.clear()
            return pod.learned
        new, spent_s = count - last, total_s - last_total
        openings = pod.open
        while openings and openings[0][0] < now - EXPIRE_S:
            openings.popleft()
        matched, predicted_ms, unknown = 0, 0.0, False
        while matched < new and openings:
            model_ms = _stalled(openings.popleft(), pod.stalled_ms)
            if model_ms is None:
                unknown = True
            else:
                predicted_ms += model_ms
            matched += 1
        if idle:
            # Nothing running or waiting: what is still open either reached the engine
            # and ended without a first token, or has not reached it yet (sent after
            # the scrape began): keep only those sent within the last second.
            while openings and openings[0][0] < now - 1.0:
                openings.popleft()
        if unknown or not (self.enabled and matched and predicted_ms > 0 and spent_s > 0):
            return pod.learned
        ratio = (spent_s * 1000 / new) / (predicted_ms / matched)
        step = max(-MAX_STEP, min(MAX_STEP, math.log(ratio / pod.learned)))
        weight = min(0.5, matched / (matched + WEIGHT_N))
        pod.learned = max(MIN_PACE, min(MAX_PACE, pod.learned * math.exp(weight * step)))
        return pod.learned

    def forget(self, slot: int) -> None:
        """The slot's pod is gone (or replaced): its predictions and counters go too."""
        self._pods.pop(slot, None)
