"""Precise routing's new request-path cost: the body to the engine's token ids
(render the model's chat template, tokenize), then its block keys and the precise
index's match, per request at 1K/4K/16K/32K prompt tokens.

    python -m bench.tokenize_cost [--model DIR] [--iterations 20]

Cold: a conversation's first request (every piece tokenized). Warm: its next turn
(the earlier messages' pieces from the cache, a new answer and question tokenized).
The model is the tiny engine model's tokenizer (``make engines``) where present, else
a BPE tokenizer trained for the tests. A diagnostic beside the end-to-end figures
(``bench.overhead``); writes bench/results/tokenize_cost.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.tokens import ModelTokens, block_keys, chain_seed
from ace_extproc.vllm_pods import BLOCK_SIZE, EnginesMissing, engines_dir

SIZES = (1024, 4096, 16384, 32768)
CHAT = "/v1/chat/completions"


def model_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        tiny = engines_dir() / "tiny"
        if (tiny / "tokenizer.json").exists():
            return tiny
    except EnginesMissing:
        pass
    from tests.model_files import write_model_files

    return write_model_files(Path(tempfile.mkdtemp()) / "model")


def document(rng: random.Random, tokens: ModelTokens, target: int) -> str:
    """Python-like text of about ``target`` tokens under this tokenizer."""
    words = ["def", "return", "self", "value", "items", "for", "in", "if", "None", "data"]
    text = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(target))
    ids = tokens.encode(text)
    return text[: int(len(text) * target / max(1, len(ids)))]


def measure(tokens: ModelTokens, size: int, iterations: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    index = PreciseIndex()
    index.add_pod(0)
    index.set_live(0, True)
    cold: list[float] = []
    warm: list[float] = []
    counted = 0
    for i in range(iterations):
        doc = document(rng, tokens, size)
        first = [{"role": "system", "content": f"Session {i}."}, {"role": "user", "content": doc}]
        second = [
            *first,
            {"role": "assistant", "content": "An answer of some length. " * 8},
            {"role": "user", "content": f"Follow-up {i}: and then?"},
        ]
        for messages, out in ((first, cold), (second, warm)):
            body = json.dumps({"model": "tiny", "messages": messages}).encode()
            started = time.perf_counter_ns()
            ids = tokens.token_ids(CHAT, body)
            assert ids is not None
            keys = block_keys(ids, BLOCK_SIZE, chain_seed("salt"))
            index.match(keys, 1)
            out.append((time.perf_counter_ns() - started) / 1e6)
            index.speculate(0, keys)
            counted = len(ids)
    return {
        "tokens": counted,
        "cold_ms_p50": statistics.median(cold),
        "warm_ms_p50": statistics.median(warm),
        "cold_ms_max": max(cold),
        "warm_ms_max": max(warm),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: the tiny engine model)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--out", default="bench/results/tokenize_cost.json")
    args = ap.parse_args()
    directory = model_dir(args.model)
    tokens = ModelTokens(directory)
    rows = {size: measure(tokens, size, args.iterations, size) for size in SIZES}
    print(f"model {directory}; block size {BLOCK_SIZE}; ms per request, median (max)")
    print(f"{'tokens':>8} {'cold':>16} {'warm':>16}")
    for r in rows.values():
        print(
            f"{r['tokens']:>8} {r['cold_ms_p50']:>8.2f} ({r['cold_ms_max']:>5.1f})"
            f" {r['warm_ms_p50']:>8.3f} ({r['warm_ms_max']:>5.2f})"
        )
    Path(args.out).write_text(
        json.dumps({"model": str(directory), "iterations": args.iterations, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
