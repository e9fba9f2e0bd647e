"""The calibrated time-to-first-token model shared by the router's estimates,
the simulated engine and the fleet simulation.

With ``n`` uncached prompt tokens and ``c`` cached prefix tokens::

    TTFT_ms = t0 + max(t_step, a*n + b*n*(c + n/2))

``a`` is the per-token cost of the prefill, ``b`` the attention term that grows
with the context each new token attends to, ``t_step`` the floor of one engine
step.  The GPU models' coefficients are fitted to public H100 figures (see
``shared/reference/engines.md`` and docs/routing.md); they are estimates, not
measurements of any particular fleet.  ``vllm-cpu-tiny`` is measured, on the
real-engine tier's CPU pods (``bench/calibrate_vllm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TTFTModel:
    name: str
    t0_ms: float
    a_ms: float
    b_ms: float
    t_step_ms: float

    def prefill_ms(self, uncached: int, cached: int = 0) -> float:
        """Compute time of a prefill of ``uncached`` tokens after ``cached`` warm ones."""
        n = max(uncached, 0)
        return max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (cached + n / 2))

    def ttft_ms(self, uncached: int, cached: int = 0) -> float:
        """TTFT of one request alone on an idle engine."""
        return self.t0_ms + self.prefill_ms(uncached, cached)

    def gain(self, tokens: int, cached: int) -> tuple[float, float]:
        """What ``cached`` warm tokens of a ``tokens``-token prompt are worth alone on an
        idle engine: the cold TTFT over the warm one, and cold less warm (ms). The same
        arithmetic as ``ttft_ms``, inline: it runs on every decision."""
        n = max(tokens, 0)
        cold = self.t0_ms + max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (0 + n / 2))
        if not cached:
            return 1.0, 0.0
        n = max(tokens - cached, 0)
        warm = self.t0_ms + max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (cached + n / 2))
        return cold / warm, cold - warm

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
        # 2-core machines. Fitted by `python -m bench.calibrate_vllm` on 2026-12-05 (idle
        # pod, 256 to 16k tokens, medians of 9 runs, bench/results/calibrate-vllm.json):
        # cold TTFT within ~20%. Warm TTFT there grows with the cached context (6 ms at
        # 256 tokens, 41 ms at 16k: the server tokenizes the whole prompt, the step reads
        # the whole context), which this form cannot say; it gives 9-11 ms (docs/simulator.md).
        TTFTModel("vllm-cpu-tiny", 8.76, 0.00200, 5.07e-6, 0.0),
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
