"""Measuring a workload: prompt sizes as the engine counts them, context buckets,
best-case prefix reuse and the prefill load it puts on a fleet."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from ace_extproc.latency import DEFAULT_MODEL, get_model
from ace_extproc.request import CHAT_PATH
from ace_extproc.sim.tokenizer import render_chat

from .base import Request, Workload
from .text import BYTES_PER_TOKEN

# The report's TTFT-by-context buckets, as bench.fleetsim counts them: a prompt goes to
# the nearest nominal size on a log scale, 1K <= 2,048 < 4K <= 8,192 < 16K <= 24,576 < 32K.
BUCKETS = ("1K", "4K", "16K", "32K")
BUCKET_EDGES = (2_048, 8_192, 24_576)

_decode = msgspec.json.Decoder().decode


def engine_prompt(request: Request) -> str:
    """The prompt text the simulated engine tokenizes for this request."""
    body: dict[str, Any] = _decode(request.body)
    if request.path == CHAT_PATH:
        return render_chat(body["messages"], body.get("tools"))
    prompt = body["prompt"]
    return prompt if isinstance(prompt, str) else "".join(map(str, prompt))


def prompt_tokens(request: Request) -> int:
    """Prompt tokens on the simulated engine (4 bytes of rendered prompt a token)."""
    return -(-len(engine_prompt(request).encode()) // BYTES_PER_TOKEN)


def bucket(tokens: int) -> str:
    for name, edge in zip(BUCKETS, BUCKET_EDGES, strict=False):
        if tokens <= edge:
            return name
    return BUCKETS[-1]


def reused_bytes(prompts: list[str], block_bytes: int = 512) -> list[int]:
    """Per prompt, the bytes a single engine with an unbounded cache would reuse from
    the prompts before it, at ``block_bytes`` granularity (512: the router's blocks)."""
    seen: set[int] = set()
    out = []
    for text in prompts:
        data = text.encode()
        h = reused = 0
        for i in range(0, len(data) - block_bytes + 1, block_bytes):
            h = xxhash.xxh3_64_intdigest(data[i : i + block_bytes], h)
            if h in seen:
                reused += block_bytes
            else:
                seen.add(h)
        out.append(reused)
    return out


def best_case_reuse(prompts: list[str], block_bytes: int = 512) -> float:
    """Share of all prompt bytes that :func:`reused_bytes` finds reused."""
    total = sum(len(p.encode()) for p in prompts)
    return sum(reused_bytes(prompts, block_bytes)) / total if total else 0.0


@dataclass(slots=True)
class Summary:
    name: str
    requests: int
    sessions: int
    families: dict[str, int]
    duration_s: float
    rate: float
    prompt_tokens: dict[str, int]  # min, p50, mean, p90, max
    output_tokens_mean: float
    buckets: dict[str, int]
    best_case_reuse: float
    # Prefill seconds per second per pod of an 8-pod fleet (the default TTFT model),
    # over the busy part of the run (10th to 90th percentile of arrivals): with every
    # prompt cold, and with only what the best case cannot reuse prefilled.
    load_cold: float
    load_best: float
    events: int


def summarize(workload: Workload, pods: int = 8) -> Summary:
    reqs = workload.requests
    prompts = [engine_prompt(r) for r in reqs]
    sizes = [-(-len(p) // BYTES_PER_TOKEN) for p in prompts]
    tokens = sorted(sizes)
    families: dict[str, int] = {}
    buckets = dict.fromkeys(BUCKETS, 0)
    for r, p in zip(reqs, prompts, strict=True):
        families[r.family] = families.get(r.family, 0) + 1
        buckets[bucket(-(-len(p) // BYTES_PER_TOKEN))] += 1
    duration = reqs[-1].arrival_s - reqs[0].arrival_s if reqs else 0.0
    reused = [b // BYTES_PER_TOKEN for b in reused_bytes(prompts)]
    reuse = sum(reused) / sum(sizes) if sizes else 0.0
    model = get_model(DEFAULT_MODEL)
    lo, hi = len(reqs) // 10, len(reqs) * 9 // 10
    window = slice(lo, hi)
    cold_ms = sum(model.prefill_ms(n) for n in sizes[window])
    best_ms = sum(
        model.prefill_ms(n - c, c) for n, c in zip(sizes[window], reused[window], strict=True)
    )
    busy_s = reqs[hi].arrival_s - reqs[lo].arrival_s if hi < len(reqs) else 0.0
    span_ms = max(busy_s, 1e-9) * 1000 * pods
    return Summary(
        name=workload.name,
        requests=len(reqs),
        sessions=len({r.session for r in reqs}),
        families=families,
        duration_s=round(duration, 1),
        rate=round(len(reqs) / duration, 2) if duration else 0.0,
        prompt_tokens={
            "min": tokens[0] if tokens else 0,
            "p50": tokens[len(tokens) // 2] if tokens else 0,
            "mean": round(statistics.fmean(tokens)) if tokens else 0,
            "p90": tokens[int(len(tokens) * 0.9)] if tokens else 0,
            "max": tokens[-1] if tokens else 0,
        },
        output_tokens_mean=round(statistics.fmean(r.output_tokens for r in reqs), 1)
        if reqs
        else 0.0,
        buckets=buckets,
        best_case_reuse=round(reuse, 4),
        load_cold=round(cold_ms / span_ms, 3),
        load_best=round(best_ms / span_ms, 3),
        events=len(workload.events),
    )
