"""Shadow mode proves itself on the simulated fleet: what it predicts prod would
reuse, prod then measures, within the stated tolerance (bench.shadow)."""

from __future__ import annotations

from bench import workloads
from bench.fleetsim import SimSettings
from bench.shadow import TOLERANCE, compare


def test_shadow_predicts_what_prod_then_measures_on_the_same_replay() -> None:
    row = compare(workloads.get("seed800", limit=400), pods=8, settings=SimSettings())
    # Shadow changed nothing: default routing reused far less than prod then did.
    assert row["measured_gain"] > 0.2
    assert row["predicted_gain"] > 0.2
    assert abs(row["relative_error"]) <= TOLERANCE, row
