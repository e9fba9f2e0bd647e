"""The calibrated time-to-first-token model shared by the router's estimates,
the simulated engine and the fleet simulation.

With ``n`` uncached prompt tokens and ``c`` cached prefix tokens::

    TTFT_ms = t0 + p*(n + c) + max(t_step, a*n + b*n*(c + n/2))

``a`` is the per-token cost of the prefill, ``b`` the attention term that grows
with the context each new token attends to, ``t_step`` the floor of one engine
step, ``p`` what every prompt token costs cached or not (the server tokenizes and
hashes the whole prompt): nothing measurable on the GPU models, most of a warm
16k-token request's time on the CPU pods.  The GPU models' coefficients are fitted
to public H100 figures (see
``shared/reference/engines.md`` and docs/routing.md); they are estimates, not
measurements of any particular fleet.  ``vllm-cpu-tiny`` is measured, on the
real-engine tier's CPU pods (``bench/calibrate_vllm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Decode steps of a typical answer: a few hundred tokens. How long a request holds its
# pod after its first token (its LoRA adapter's slot in use) is this many of the
# model's steps: an estimate, the router does not know the answer's length.
DECODE_STEPS = 180
# Milliseconds to load a LoRA adapter into a GPU slot: an estimate, not a measurement. A
# rank-16 adapter on the attention projections of a 70B model is ~65 MB of fp16 (the
# MLP's too: ~400 MB); read from local disk at 1-2 GB/s, parsed and copied to the GPU,
# that is tens to a few hundred ms (less from vLLM's CPU cache, --max-cpu-loras).
DEFAULT_LOAD_MS = 100.0


@dataclass(frozen=True, slots=True)
class TTFTModel:
    name: str
    t0_ms: float
    a_ms: float
    b_ms: float
    t_step_ms: float
    token_ms: float = 0.0  # p: a prompt token's cost, cached or not (the API server's)
    # Loading a LoRA adapter into a slot: the whole engine step waits for it (lora.py).
    adapter_load_ms: float = DEFAULT_LOAD_MS

    def prefill_ms(self, uncached: int, cached: int = 0) -> float:
        """Compute time of a prefill of ``uncached`` tokens after ``cached`` warm ones."""
        n = max(uncached, 0)
        return max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (cached + n / 2))

    def prefill_work_ms(self, uncached: int, cached: int = 0) -> float:
        """The compute of that prefill, without the step's floor: what it adds to a
        busy engine, whose step runs many requests' prefills together."""
        n = max(uncached, 0)
        return self.a_ms * n + self.b_ms * n * (cached + n / 2)

    def ttft_ms(self, uncached: int, cached: int = 0) -> float:
        """TTFT of one request alone on an idle engine."""
        return self.server_ms(uncached + cached) + self.prefill_ms(uncached, cached)

    def decode_ms(self) -> float:
        """A typical answer's decode (``DECODE_STEPS`` of the engine's step)."""
        return DECODE_STEPS * self.t_step_ms

    def server_ms(self, tokens: int) -> float:
        """The fixed part and the per-token part of a ``tokens``-token prompt, before the
        engine: its own time, whatever it holds warm."""
        return self.t0_ms + self.token_ms * max(tokens, 0)

    def gain(self, tokens: int, cached: int) -> tuple[float, float]:
        """What ``cached`` warm tokens of a ``tokens``-token prompt are worth alone on an
        idle engine: the cold TTFT over the warm one, and cold less warm (ms). The same
        arithmetic as ``ttft_ms``, inline: it runs on every decision."""
        n = max(tokens, 0)
        server = self.t0_ms + self.token_ms * n
        cold = server + max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (0 + n / 2))
        if not cached:
            return 1.0, 0.0
        n = max(tokens - cached, 0)
        warm = server + max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (cached + n / 2))
        return cold / warm, cold - warm

    def speed(self, prefill_tokens_per_s: float) -> float:
        """Milliseconds of this model's prefill pods that prefill ``prefill_tokens_per_s``
        do in a millisecond: 1 where that is 0 (they run as the model says)."""
        return prefill_tokens_per_s / self.prefill_tokens_per_s if prefill_tokens_per_s else 1.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """A pod's prefill rate in uncached tokens a second, the attention term aside."""
        return 1000.0 / self.a_ms


MODELS: dict[str, TTFTModel] = {
    m.name: m
    for m in (
        TTFTModel("llama-3.3-70b-fp8-tp2", 10.0, 0.0718, 2.9e-6, 18.6),
        TTFTModel("llama-3.3-70b-fp8-tp4", 10.0, 0.040, 1.45e-6, 11.0),
        TTFTModel("llama-3.1-8b-fp8", 5.0, 0.0163, 1.17e-6, 4.6),
        # The real-engine tier's pods: vLLM's CPU build serving the tiny model on these
        # 2-core machines. Fitted by `python -m bench.calibrate_vllm` on 2026-12-05 (an idle
        # pod, 256 to 16k tokens, medians of 9 runs; t_step its decode step alone;
        # bench/results/calibrate-vllm.json): cold and warm TTFT within 10% RMS. The
        # attention term dominates past 4k tokens (the layers are tiny), and p, the
        # server's tokenizing, is most of a long warm request's time. Its rank-8 adapters
        # (30 KB) load in about a millisecond (docs/engines.md, "LoRA adapters").
        TTFTModel(
            "vllm-cpu-tiny", 8.85, 0.00427, 3.80e-6, 1.25, token_ms=0.00205, adapter_load_ms=1.0
        ),
    )
}
DEFAULT_MODEL = "llama-3.3-70b-fp8-tp4"


def get_model(name: str) -> TTFTModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown TTFT model {name!r}; known: {', '.join(sorted(MODELS))}"
        ) from None
