"""How long each pod takes to answer a request, learned from the engine's own
request-latency histogram.

A request for a LoRA adapter that finds every slot of a pod held by adapters in use
waits until one of them has no request left (``lora.py``): about one answer's whole
time there, decode included. The TTFT model prices prefill, not decode, and a decode's
time grows with the answer's length and with the batch it runs in: on the real-engine
tier's CPU pods, answers took 2-13 s under load where the model's lone 180-token decode
is 225 ms, so new adapters were sent to full pods and waited 4-11 s for a slot.

vLLM and SGLang count each finished request's end-to-end latency, from its arrival to
its last token, in a histogram (``vllm:e2e_request_latency_seconds``,
``sglang:e2e_request_latency_seconds``); each scrape reads its ``_count`` and ``_sum``
(``metrics_text.EngineStats.answer_counters``). A pod's answer time moves toward the
mean of the answers finished since the last scrape by n / (n + ``WEIGHT_N``) of the
way, at most half (as the pace does, ``pace.py``): one answer's length is noise, a few
dozen are the pod's traffic. Answers of other routers' requests count as this one's.
An engine restart (its counters go back) starts the counting afresh and keeps what was
learned; a new process in the slot starts unlearned.
"""

from __future__ import annotations

# A window of n answers moves the learned time n / (n + WEIGHT_N) of the way, at most
# half.
WEIGHT_N = 16.0


class AnswerTimes:
    """Engine counters in, each pod's mean answer time (milliseconds) out."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # slot -> (count, sum in s)

    def observed(
        self, slot: int, count: float, total_s: float, learned_ms: float | None
    ) -> float | None:
        """A scrape's counters for the pod (``count`` answers so far, ``total_s`` their
        summed latency): ``learned_ms``, its answer time so far (None: none yet),
        moved toward the mean of the answers since the last scrape."""
        last = self._last.get(slot)
        self._last[slot] = (count, total_s)
        if last is None or count < last[0] or total_s < last[1]:
            return learned_ms  # the first scrape, or a restarted engine's counters
        new, spent_s = count - last[0], total_s - last[1]
        if new <= 0:
            return learned_ms
        mean_ms = spent_s * 1000 / new
        if learned_ms is None:
            return mean_ms
        return learned_ms + min(0.5, new / (new + WEIGHT_N)) * (mean_ms - learned_ms)

    def forget(self, slot: int) -> None:
        """A new process in the slot: its counters and answer time are its own."""
        self._last.pop(slot, None)
