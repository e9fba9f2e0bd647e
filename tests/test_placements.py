"""The placement diagnostic (``bench.placements``): what each variant's picks found
and left, per pod, on the same requests."""

from __future__ import annotations

import json
import random

import pytest

from bench.placements import diagnose, main, report
from bench.workloads.base import Request, Workload


def documents(n: int = 24) -> Workload:
    """``n`` documents behind one shared system prompt of 4 of the router's blocks
    (under a tenth of each prompt: it does not steer), each asked about twice, no
    session ids. The prompt's tokens include its last, partial block, which the router's
    blocks leave out: the events' depth of the shared prompt, a share of the tokens,
    then reads 3.99 of the router's blocks (as on a Mooncake-format trace)."""
    rng = random.Random(0)
    block = 512  # bytes: the router's block (128 tokens)
    system = ("You answer questions on documents. " * 60)[: 4 * block]
    requests = []
    for d in range(n):
        doc = "".join(rng.choice("abcdefgh ") for _ in range(60 * block))
        for q in range(2):
            question = f"Question {q} on document {d}?"
            body = json.dumps({"model": "m", "prompt": system + doc + question, "max_tokens": 8})
            requests.append(
                Request(d * 1.0 + q * 0.5, "/v1/completions", body.encode(), 8, "doc", f"d{d}q{q}")
            )
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("documents", "", requests)


def test_new_documents_spread_over_the_pods_with_events_as_without() -> None:
    """Each document's first question is placed as new by its own first block: spread
    over the pods whether the router's depths are its record's or the events' (which
    read the shared prompt's 4 blocks as 3.99; truncated, every document was keyed by
    the shared prompt's last block and piled onto one pod)."""
    workload = documents()
    placed = {}
    for variant in ("approximate", "precise@0ms"):
        found = diagnose(workload, "default", variant, pods=4)
        new = placed[variant] = [p["new"] for p in found["pods"]]
        assert sum(new) == found["actions"]["miss"] == 24, variant
        assert max(new) <= 12 and sum(1 for n in new if n) >= 3, (variant, new)
        # The second questions find their document where the first went; all that is
        # left behind is the shared prompt, on pods that had it before the chosen one.
        assert found["actions"]["hit"] == 24 and found["left"] < 0.01
        assert 0.5 < found["best_held"] < 0.55  # the repeats, and the shared prompt
        assert abs(sum(p["tokens"] for p in found["pods"]) - 1.0) < 1e-9
    assert placed["precise@0ms"] == placed["approximate"]  # the same keys, the same pods
    text = report("documents", "default", {"approximate": found})
    assert "approximate" in text and "per pod" in text


def test_unknown_variants_and_workloads_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", "seed800", "--variants", "precise@7ms"]) == 2
    assert "unknown variant" in capsys.readouterr().err
    assert main(["--workload", "no-such-workload"]) == 2
