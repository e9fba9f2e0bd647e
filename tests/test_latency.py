"""The calibrated TTFT model's per-decision estimate."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ace_extproc.latency import MODELS


@given(
    name=st.sampled_from(sorted(MODELS)),
    tokens=st.integers(1, 2_000_000),
    share=st.floats(0.0, 1.0),
)
def test_gain_is_cold_over_warm_ttft_bit_for_bit(name: str, tokens: int, share: float) -> None:
    """``gain`` inlines ``ttft_ms`` for the decision path: the same doubles."""
    model = MODELS[name]
    cached = min(int(tokens * share), tokens - 1)
    cold = model.ttft_ms(tokens)
    warm = model.ttft_ms(tokens - cached, cached) if cached else cold
    assert model.gain(tokens, cached) == (cold / warm, cold - warm)
    assert (model.gain(tokens, cached)[0] > 1.0) == (cold > warm)
