"""bench/ttft_fit.py: the TTFT model's least-squares fit recovers known coefficients."""

from __future__ import annotations

import pytest

from ace_extproc.latency import TTFTModel
from bench.ttft_fit import Point, fit

LENGTHS = (256, 1024, 2048, 4096, 8192, 16384)


def points(model: TTFTModel, noise: float = 0.0) -> list[Point]:
    out = []
    for i, n in enumerate(LENGTHS):
        cached = (n - 1) // 32 * 32
        wobble = 1 + (noise if i % 2 else -noise)
        out.append(Point(n, 0, model.ttft_ms(n) * wobble))
        out.append(Point(n - cached, cached, model.ttft_ms(n - cached, cached) * wobble))
    return out


def test_recovers_the_coefficients_of_noiseless_points() -> None:
    truth = TTFTModel("t", 12.0, 0.03, 2e-6, 6.0)
    got = fit(points(truth))
    assert got.t0_ms == pytest.approx(12.0, rel=0.02)
    assert got.a_ms == pytest.approx(0.03, rel=0.02)
    assert got.b_ms == pytest.approx(2e-6, rel=0.05)
    assert got.t_step_ms == pytest.approx(6.0, abs=0.25)
    assert got.rel_rmse < 0.01


def test_recovers_the_cost_of_every_prompt_token_from_warm_points() -> None:
    """Warm TTFT that grows with the cached context (the server tokenizes and hashes the
    whole prompt) is the p term, not a larger attention term."""
    truth = TTFTModel("t", 8.0, 0.002, 5e-6, 1.0, token_ms=0.002)
    got = fit(points(truth))
    assert got.token_ms == pytest.approx(0.002, rel=0.05)
    assert got.b_ms == pytest.approx(5e-6, rel=0.05)
    warm = (16384 - 1) // 32 * 32
    assert got.predict(16384 - warm, warm) == pytest.approx(
        truth.ttft_ms(16384 - warm, warm), rel=0.02
    )


def test_noisy_points_fit_within_the_noise_and_coefficients_stay_non_negative() -> None:
    truth = TTFTModel("t", 30.0, 0.02, 0.0, 5.0)  # no attention term: b must not go negative
    got = fit(points(truth, noise=0.05))
    assert min(got.t0_ms, got.a_ms, got.b_ms, got.t_step_ms, got.token_ms) >= 0.0
    assert got.rel_rmse < 0.06
    for n in LENGTHS:
        assert got.predict(n) == pytest.approx(truth.ttft_ms(n), rel=0.1)


def test_too_few_points_is_an_error() -> None:
    with pytest.raises(ValueError):
        fit([Point(1, 0, 1.0)] * 4)
