"""What a run produced (one record per served request) and its summary figures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Context buckets by prompt tokens, named after the suite's nominal sizes; each upper
# edge sits between two nominal sizes so a "4K" prompt of 4,300 tokens stays "4K".
BUCKETS: tuple[tuple[str, float], ...] = (
    ("1K", 2 * 1024),  # <= 2,048 tokens
    ("4K", 8 * 1024),  # <= 8,192
    ("16K", 24 * 1024),  # <= 24,576
    ("32K", math.inf),  # larger
)


@dataclass
class RequestRecord:
    arrival_s: float  # simulated seconds from the start of the run
    pod: int  # slot of the pod that served it
    family: str
    session: str
    prompt_tokens: int  # as the engine counts them (4 bytes a token)
    cached_tokens: int  # the engine's prefix-cache hit at admission (usage.cached_tokens)
    queue_s: float  # from reaching the pod to its first prefill step
    ttft_s: float  # first token - arrival
    finish_s: float  # simulated time of its last token (absolute, like arrival_s)
    output_tokens: int
    action: str = ""  # the router's trace action: hit, miss, bypass_<reason>, ...
    would_pick: int = -1  # the router's decision (slot), in any mode; -1 for none
    estimated_saved_tokens: int = 0  # the router's estimate for its pick, in any mode


@dataclass
class RunResult:
    workload: str
    pods: int
    records: list[RequestRecord]
    busy_s: list[float]  # per pod: simulated time spent computing steps
    evictions: list[int]  # per pod: cached blocks evicted
    duration_s: float  # simulated: the last event (the last token of the run)
    wall_s: float  # real seconds the simulation took
    bypassed: int = 0  # sent by the fallback route (no pod pinned by the router)
    rejected: int = 0  # refused: by the router (401) or the engine (bad body, too large)
    rerouted: int = 0  # routed again because their pod left before admitting them
    replicas: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    # per pod: time it was in the fleet (None: all of the run, for every pod)
    present_s: list[float] | None = None
    # per pod: compute in its steps (busy time less the step floor's idle part)
    work_s: list[float] | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated linearly (numpy's default);
    0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bucket(prompt_tokens: int) -> str:
    for name, edge in BUCKETS:
        if prompt_tokens <= edge:
            return name
    return BUCKETS[-1][0]


def _ttft_stats(ttfts_s: Sequence[float]) -> dict[str, float]:
    ms = [t * 1000 for t in ttfts_s]
    return {
        "count": len(ms),
        "mean_ms": sum(ms) / len(ms) if ms else 0.0,
        "p50_ms": percentile(ms, 50),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
    }


def summarize(result: RunResult) -> dict[str, Any]:
    """The run's figures. Ratios over nothing and percentiles of nothing are 0.0."""
    records = result.records
    n = len(records)
    hits = sum(1 for r in records if r.cached_tokens > 0)
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    output = sum(r.output_tokens for r in records)
    overall = _ttft_stats([r.ttft_s for r in records])
    by_bucket: dict[str, list[float]] = {name: [] for name, _ in BUCKETS}
    for r in records:
        by_bucket[bucket(r.prompt_tokens)].append(r.ttft_s)
    # Imbalance compares how busy each pod was while it was in the fleet: a pod that
    # joined two thirds of the way through is not "idle" for the time before.
    present = result.present_s or [result.duration_s] * len(result.busy_s)
    busy = [b / p for b, p in zip(result.busy_s, present, strict=True) if p > 0]
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    # The same over compute alone: a floor-bound step (one decode token) is busy time
    # but little load; this is how unevenly the pods' compute was used.
    work_s = result.work_s or result.busy_s
    work = [w / p for w, p in zip(work_s, present, strict=True) if p > 0]
    mean_work = sum(work) / len(work) if work else 0.0
    duration = result.duration_s
    return {
        "workload": result.workload,
        "pods": result.pods,
        "requests": n,
        "hits": hits,
        "misses": n - hits,
        "hit_ratio": hits / n if n else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_saved_ratio": cached / prompt if prompt else 0.0,
        "ttft_mean_ms": overall["mean_ms"],
        "ttft_p50_ms": overall["p50_ms"],
        "ttft_p95_ms": overall["p95_ms"],
        "ttft_p99_ms": overall["p99_ms"],
        "ttft_by_bucket": {name: _ttft_stats(v) for name, v in by_bucket.items()},
        "queue_p95_ms": percentile([r.queue_s * 1000 for r in records], 95),
        "throughput_rps": n / duration if duration > 0 else 0.0,
        "throughput_tok_s": output / duration if duration > 0 else 0.0,
        "imbalance": max(busy) / mean_busy if mean_busy > 0 else 0.0,
        "work_imbalance": max(work) / mean_work if mean_work > 0 else 0.0,
        # The engines' compute over the run, all pods (their steps less the floor's idle
        # part): what a placement costs in accelerator time; prefill a router saves is
        # compute no pod spends.
        "compute_s": sum(work_s),
        "evictions": sum(result.evictions),
        "bypassed": result.bypassed,
        "rejected": result.rejected,
        "rerouted": result.rerouted,
        "duration_s": duration,
        "wall_s": result.wall_s,
    }
