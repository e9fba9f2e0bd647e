"""Live runs: one workload replayed over real HTTP through each router, each in front of
its own fresh simulated engine pods, or of the same real vLLM servers; hit ratios come
from what the engines report.

    python -m bench.live --workload seed800 [--limit N] [--rate R] [--seed S] [--pods 4]
                         [--routers ace,envoy_rr,sglang,vllm,smg] [--time-scale 0.01]
                         [--concurrency 16] [--speed 0] [--no-stream] [--records FILE]
                         [--engine sim|vllm] [--kv-blocks N] [--max-body-bytes B]

Engines. ``--engine sim`` (the default): each router gets new simulated pod processes on
new ports. ``--engine vllm``: real vLLM servers (``make engines``; ``vllm_pods.py``)
start once, and each router runs in front of the same servers, their prefix caches
emptied before it (``/reset_prefix_cache``), so every router starts cold on identical
engines. ``--kv-blocks`` sizes their KV cache (32-token blocks; small forces eviction);
``--max-body-bytes`` leaves out requests longer than their context. With real engines
the table also carries the fleet simulation's prediction for the same shape (same
workload, pods, block size, KV blocks, the calibrated ``vllm-cpu-tiny`` TTFT model; the
policy of bench/baselines that each router follows), to hold the simulation to them.

Routers, each started in front of cold pods:
  ace       Envoy + ace-extproc, as ``ace-extproc up`` runs them (``Stack``; buffered, prod)
  ace_xN    the same with N ace-extproc servers behind Envoy (each request to the less
            busy of two), each learning only from what it routes; ace_xN_shared:
            sharing placements through a redis-server the stack starts
            (``router.share_url``)
  envoy_rr  Envoy alone, the default cluster balanced ROUND_ROBIN (no ext_proc)
  sglang    the SGLang Model Gateway, ``--policy cache_aware`` (``--peer-policy``)
  vllm      the vLLM Router, ``--policy cache_aware``
  smg       the Shepherd Model Gateway (the SGLang router's successor), ``cache_aware``
  gie_lora  GIE's LoRA-affinity filter before its default scorers (bench/baselines), run
            as ace-extproc's policy (``router.policy: module:Class``): GIE's endpoint
            picker is Go and does not run here, its algorithm does
  ace_fixed_pace  ace with ``router.learn_pace: false``: every pod priced as its TTFT
            model says, however slow it runs (an A/B of the learned pace)
  ace_scrape_1s  ace reading each pod's ``/metrics`` every second, not every 0.1 s
            (what the scrapes cost engines that share the router's cores)
  ace_scrape_fixed  ace reading each pod's ``/metrics`` every 0.1 s however slowly it
            answers (``scrape_max_engine_share: 0``, the default before 2026-12-07)
A peer that is not installed is skipped, with the reason in the table and the JSON. A
router named twice runs twice, its second turn reported as ``NAME#2`` (``--routers
ace,ace_precise,ace``): an A/A check of how far two turns of one router differ.

Replay. At most ``--concurrency`` requests are in flight, taken in arrival order (closed
loop). With ``--speed S`` > 0 a request is also held until its arrival time divided by S
(an open loop once the concurrency limit is not reached). Always, a request waits until the
previous request of its session has completed, so a conversation's turns stay in order.
Every router gets the same bytes: the workload's bodies with streaming switched on
(``"stream": true, "stream_options": {"include_usage": true}``); ``--no-stream`` sends them
exactly as the workload holds them.

Per request: HTTP status, latency (request sent to last byte), TTFT (request sent to the
first SSE ``data:`` event, which carries the first generated token; streaming only), the
engine's own ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` (from
the final chunk when streaming), and where the pods are simulated, the engine's TTFT on its
simulated clock (``sim_ttft_ms``, next to the usage). Per router: requests, errors, hit
ratio (share of answered requests with any cached token), cached share (cached / prompt
tokens, engine-reported), latency and TTFT p50/p99, the engines' simulated TTFT p50/p99,
requests per pod, and, as a cross-check, the pods' own /metrics counters
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, and
``vllm:prompt_tokens_cached_total`` / ``vllm:prompt_tokens_total``) summed over the pods,
as the difference between just before and just after the replay.

Time. ``--time-scale`` multiplies the pods' simulated durations (0.01: 100x faster); the
routers' own costs are not scaled, so at small scales latencies are mostly gateway and
machine time; the engines' simulated TTFT (``engine_ttft_ms``: from a request reaching
its pod to its first token, on the pods' clock, queueing included) is what each router's
placement gave, at any scale, and with the cached share the figure to compare. Fleet events
of a workload (pods leaving or joining) are not replayed: every pod serves from the start.
``--clear-cache-at S[,S...]`` empties a pod's prefix cache S seconds into each router's
replay (pods in turn; vLLM's ``/reset_prefix_cache?reset_running_requests=true``), as a
restart would, without telling the router: the drift an index of where requests were
sent cannot see, and KV events report (``AllBlocksCleared``).
``--foreign-load TOKENS@SECONDS`` sends a new prompt of about TOKENS tokens straight to
the first pod every SECONDS seconds of each router's replay, past the router, as a second
gateway in front of that pod would: its blocks evict the router's there, which an index
of where the router sent requests cannot see, and KV events report (``BlockRemoved``).
Its requests are left out of the figures (the engines' counters less their usage).

Writes ``bench/results/live-<workload>.json`` (``--out``), per-request records with
``--records FILE`` (JSON lines), and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import aiohttp
import msgspec
import uvloop
import yaml

from ace_extproc import config as config_mod
from ace_extproc import vllm_pods
from ace_extproc.sim.app import POD_HEADER, TTFT_FIELD
from ace_extproc.stack import TRACE_HEADER, Stack, StackError, StackOptions
from ace_extproc.vllm_pods import EnginesMissing, Pods, VllmOptions, reset_prefix_cache
from bench import peers
from bench.ceiling import ceiling
from bench.overhead import cpu_s, free_ports, metric_sums, percentile
from bench.workloads.base import Workload

# Another router's algorithm from bench/baselines, run as ace-extproc's policy.
POLICY_ROUTERS = {"gie_lora": "bench.baselines.gie_lora:GIELoraPicker"}
# ace-extproc with router settings changed: an A/B of one setting, the rest the same.
SETTINGS_ROUTERS: dict[str, dict[str, Any]] = {
    "ace_fixed_pace": {"learn_pace": False},  # every pod priced as its TTFT model says
    # each pod's /metrics read every second, not every 0.1 s: what the scrapes cost the
    # engines' API servers where they share the router's cores (the CPU pods here)
    "ace_scrape_1s": {"scrape_interval_s": 1.0, "scrape_max_engine_share": 0.0},
    # every 0.1 s however slowly a pod answers: the default before the share bound
    "ace_scrape_fixed": {"scrape_max_engine_share": 0.0},
}
ROUTERS = ("ace", "ace_precise", "envoy_rr", *peers.PEERS, *POLICY_ROUTERS, *SETTINGS_ROUTERS)
# Also accepted: ace_xN (N ace-extproc servers behind one Envoy, each learning only from
# what it routes), ace_xN_shared (the same sharing placements through a redis-server),
# and ace_precise_xN (N servers, each following the pods' KV events).
_ACE = re.compile(r"ace(_precise)?(?:_x([2-9]|[1-9][0-9])(_shared)?)?")


@dataclass(frozen=True, slots=True)
class AceVariant:
    servers: int = 1
    shared: bool = False  # placements shared through Redis
    precise: bool = False  # the pods publish KV events, which the router follows


def ace_variant(name: str) -> AceVariant | None:
    """How an ace router name runs ace-extproc, else None (a peer)."""
    if name in POLICY_ROUTERS or name in SETTINGS_ROUTERS:
        return AceVariant()
    m = _ACE.fullmatch(name)
    if m is None:
        return None
    return AceVariant(int(m.group(2) or 1), m.group(3) is not None, m.group(1) is not None)


COUNTERS = {
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prompt_tokens_cached_total": "prompt_tokens_cached",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:request_success_total": "requests",  # real vLLM only: who served what
}
# The policy of bench/baselines that each router follows: the fleet simulation's
# prediction for it (real engines only).
SIMULATED_AS = {
    "ace": "ace",
    "ace_precise": "ace",
    "ace_fixed_pace": "ace",
    "ace_scrape_1s": "ace",
    "ace_scrape_fixed": "ace",
    "envoy_rr": "round_robin",
    "sglang": "sglang_cache_aware",
    "vllm": "vllm_cache_aware",
    "smg": "sglang_cache_aware",
    "gie_lora": "gie_lora",
}
SERVED_BY_HEADER = "x-ace-served-by"
REQUEST_ID_HEADER = "x-request-id"
SALT_SECRET = "bench-live"  # ace-extproc's cache_salt secret: fixed, so runs are alike


@dataclass(frozen=True, slots=True)
class LiveOptions:
    pods: int = 4
    time_scale: float = 0.01
    concurrency: int = 16
    speed: float = 0.0  # 0: arrival times ignored (closed loop)
    stream: bool = True
    peer_policy: str = "cache_aware"
    sim_args: tuple[str, ...] = ()
    request_timeout_s: float = 300.0
    router: tuple[tuple[str, object], ...] = ()  # ace-extproc's `router:` settings
    seed: int = 0  # the workload generator's
    engine: str = "sim"  # or "vllm": real servers (vllm_pods.py)
    kv_blocks: int | None = None  # real servers' KV cache in blocks (None: 1 GiB)
    engine_nice: int = 0  # real servers' niceness (vllm_pods.VllmOptions.niceness)
    engine_cores: Literal["split", "pinned", "shared"] = "pinned"  # VllmOptions.cores
    clear_cache_at: tuple[float, ...] = ()  # seconds into the replay (``clear_caches``)
    foreign_load: tuple[int, float] | None = None  # (tokens, every s): ``foreign_load``


@dataclass(frozen=True, slots=True)
class Prepared:
    """A workload request as it goes on the wire."""

    path: str
    body: bytes
    headers: dict[str, str]
    session: str
    family: str
    arrival_s: float


@dataclass(frozen=True, slots=True)
class Record:
    index: int  # position in the workload
    session: str
    family: str
    sent_s: float  # from the start of the replay
    status: int  # 0: no HTTP answer
    error: str | None
    latency_ms: float
    ttft_ms: float | None
    engine_ttft_ms: float | None  # the simulated engine's, on its clock (sim_ttft_ms)
    prompt_tokens: int | None
    cached_tokens: int | None
    pod: str | None  # x-sim-pod of the answer, else ace-extproc's x-ace-served-by
    trace: str | None = None  # ace-extproc's x-ace-trace-prefix-kv-cache: its decision
    request_id: str | None = None  # Envoy's x-request-id, which its access log carries
    # ace-extproc's stacks: Envoy's hold, the request's last byte in to its first byte to
    # the pod (ext_proc's answer, route, connection), from its access log; else None.
    hold_ms: float | None = None


# ------------------------------------------------------------------ inputs


def with_usage_stream(body: bytes) -> bytes:
    """``body`` with streaming and the final usage chunk switched on; other keys and their
    order kept. A body that is not a JSON object goes unchanged."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    if not isinstance(doc, dict):
        return body
    options = doc.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    doc["stream"] = True
    doc["stream_options"] = {**options, "include_usage": True}
    return msgspec.json.encode(doc)


def prepare(workload: Workload, stream: bool) -> list[Prepared]:
    out = []
    for r in workload.requests:
        headers = {"content-type": "application/json", **r.headers}
        body = with_usage_stream(r.body) if stream else r.body
        out.append(Prepared(r.path, body, headers, r.session, r.family, r.arrival_s))
    return out


def previous_in_session(sessions: Sequence[str]) -> list[int | None]:
    """For each request, the index of the previous request of its session (or None)."""
    last: dict[str, int] = {}
    out: list[int | None] = []
    for i, s in enumerate(sessions):
        out.append(last.get(s))
        last[s] = i
    return out


# ------------------------------------------------------------------ the client


class Usage(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    engine_ttft_ms: float | None  # the simulated engine's sim_ttft_ms; None from others


def _usage(raw: bytes) -> Usage | None:
    """What an answer or an SSE chunk says of its usage, if it has usage."""
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    use = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(use, dict) or not isinstance(use.get("prompt_tokens"), int):
        return None
    details = use.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    ttft = doc.get(TTFT_FIELD)
    ttft = float(ttft) if isinstance(ttft, int | float) and not isinstance(ttft, bool) else None
    return Usage(use["prompt_tokens"], cached if isinstance(cached, int) else 0, ttft)


async def send(
    http: aiohttp.ClientSession, base_url: str, req: Prepared, index: int, t0: float
) -> Record:
    clock = time.perf_counter
    sent = clock()
    status, ttft, use, pod, trace, error, request_id = 0, None, None, None, None, None, None
    try:
        async with http.post(base_url + req.path, data=req.body, headers=req.headers) as resp:
            # The sim names its pod; ace-extproc names the one it pinned (real engines).
            pod = resp.headers.get(POD_HEADER) or resp.headers.get(SERVED_BY_HEADER)
            request_id = resp.headers.get(REQUEST_ID_HEADER)
            status, trace = resp.status, resp.headers.get(TRACE_HEADER)
            if resp.content_type == "text/event-stream":
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    if ttft is None:
                        ttft = clock() - sent
                    if b'"usage"' in line:
                        use = _usage(line[5:]) or use
            else:
                use = _usage(await resp.read())
    except (TimeoutError, aiohttp.ClientError) as exc:
        error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    latency = clock() - sent
    if error is None and status != 200:
        error = f"HTTP {status}"
    elif error is None and use is None:
        error = "no usage in the answer"
    return Record(
        index=index,
        session=req.session,
        family=req.family,
        sent_s=round(sent - t0, 6),
        status=status,
        error=error,
        latency_ms=round(latency * 1e3, 3),
        ttft_ms=None if ttft is None else round(ttft * 1e3, 3),
        engine_ttft_ms=use.engine_ttft_ms if use else None,
        prompt_tokens=use.prompt_tokens if use else None,
        cached_tokens=use.cached_tokens if use else None,
        pod=pod,
        trace=trace,
        request_id=request_id,
    )


async def replay(
    base_url: str, requests: Sequence[Prepared], options: LiveOptions
) -> tuple[list[Record], float]:
    """Send every request (see the module doc for the order); the records in workload
    order, and the wall time of the replay in seconds."""
    prev = previous_in_session([r.session for r in requests])
    done = [asyncio.Event() for _ in requests]
    records: list[Record | None] = [None] * len(requests)
    slots = asyncio.Semaphore(options.concurrency)
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=options.concurrency)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        start = loop.time()

        async def one(i: int) -> None:
            try:
                if options.speed > 0:
                    await asyncio.sleep(start + requests[i].arrival_s / options.speed - loop.time())
                before = prev[i]
                if before is not None:
                    await done[before].wait()
                async with slots:
                    records[i] = await send(http, base_url, requests[i], i, t0)
            finally:
                done[i].set()

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        wall = time.perf_counter() - t0
    return [r for r in records if r is not None], wall


async def clear_caches(pod_urls: Sequence[str], at: Sequence[float]) -> list[dict[str, Any]]:
    """Empty a pod's prefix cache at each of ``at`` (seconds into the replay), the k-th
    clear on pod k modulo their number, its running requests preempted (they prefill
    again): what a restart does to a pod's cache, without the minute a restart takes.
    The router is not told; a pod that publishes KV events says ``AllBlocksCleared``.
    Appends each clear as it is done: ``{"at_s", "pod", "success"}``."""
    done: list[dict[str, Any]] = []
    if not at or not pod_urls:
        return done
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for k, offset in enumerate(sorted(at)):
            await asyncio.sleep(max(0.0, start + offset - loop.time()))
            pod = k % len(pod_urls)
            success = await reset_prefix_cache(http, pod_urls[pod], running=True)
            done.append({"at_s": round(loop.time() - start, 2), "pod": pod, "success": success})
    return done


def _foreign_text(k: int, tokens: int) -> str:
    """The k-th foreign prompt: its own from its first characters, never cached (its
    words are about four tokens each for the tiny model's tokenizer, three or four for
    a real one: the engine's usage says how many it was)."""
    words = [f"w{(k * 7919 + i * 104729) % 99991}" for i in range(tokens // 4)]
    return f"foreign request {k}: " + " ".join(words)


async def foreign_load(
    pod_url: str, model: str, tokens: int, every_s: float, stop: asyncio.Event
) -> list[dict[str, Any]]:
    """Send a new prompt of about ``tokens`` tokens to ``pod_url`` every ``every_s``
    seconds, one at a time (as one client: the next waits for the answer, so a slow pod
    is not buried under a backlog), until ``stop`` is set; then each answer:
    ``{"at_s", "status", "prompt_tokens", "cached_tokens"}``."""
    done: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout = aiohttp.ClientTimeout(total=300)

    async def one(http: aiohttp.ClientSession, k: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": _foreign_text(k, tokens)}],
            "max_tokens": 1,
        }
        at, status, use = round(loop.time() - start, 2), 0, None
        try:
            async with http.post(f"{pod_url}/v1/chat/completions", json=body) as resp:
                status, use = resp.status, _usage(await resp.read())
        except (TimeoutError, aiohttp.ClientError):
            pass
        done.append(
            {
                "at_s": at,
                "status": status,
                "prompt_tokens": use.prompt_tokens if use else 0,
                "cached_tokens": use.cached_tokens if use else 0,
            }
        )

    async with aiohttp.ClientSession(timeout=timeout) as http:
        k = 0
        while not stop.is_set():
            await one(http, k)
            k += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), start + k * every_s - loop.time())
    return done


def without_foreign(per_pod: list[dict[str, float]], foreign: Sequence[dict[str, Any]]) -> None:
    """The first pod's counter deltas less the foreign load's answered requests."""
    ok = [f for f in foreign if f["status"] == 200]
    prompt = sum(f["prompt_tokens"] for f in ok)
    cached = sum(f["cached_tokens"] for f in ok)
    pod = per_pod[0]
    for key, value in (
        ("requests", len(ok)),
        ("prompt_tokens", prompt),
        ("prompt_tokens_cached", cached),
        ("prefix_cache_queries", prompt),
        ("prefix_cache_hits", cached),
    ):
        if key in pod:
            pod[key] -= value


async def _stop_clearing(task: asyncio.Task[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The clears done by the end of the replay (any later ones are not made)."""
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return []
    return task.result()


def _foreign_summary(foreign: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [f for f in foreign if f["status"] == 200]
    return {
        "sent": len(foreign),
        "ok": len(ok),
        "prompt_tokens": sum(f["prompt_tokens"] for f in ok),
    }


# ------------------------------------------------------------------ engine counters


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS of one Prometheus exposition, summed over their label sets."""
    sums = metric_sums(text, tuple(COUNTERS))
    return {key: sums[name] for name, key in COUNTERS.items()}


async def scrape(pod_urls: Sequence[str]) -> list[dict[str, float]]:
    """COUNTERS of each pod."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for url in pod_urls:
            async with http.get(f"{url}/metrics") as resp:
                resp.raise_for_status()
                out.append(parse_counters(await resp.text()))
    return out


GUESS_SERIES = {
    'ace_precise_guess_picks_total{agreement="same"}': "same",
    'ace_precise_guess_picks_total{agreement="differs"}': "differs",
    'ace_precise_guess_blocks_total{side="guess_only"}': "guess_only_blocks",
    'ace_precise_guess_blocks_total{side="events_only"}': "events_only_blocks",
    # What became of the picks recorded ahead of the events, what a queued pick doomed,
    # and the requests keyed token-exact or routed approximately.
    'ace_precise_speculative_total{result="confirmed"}': "speculative_confirmed",
    'ace_precise_speculative_total{result="expired"}': "speculative_expired",
    "ace_precise_doomed_blocks_total": "doomed_blocks",
    'ace_precise_requests_total{result="keyed"}': "keyed",
    'ace_precise_requests_total{result="deferred"}': "deferred",
    'ace_precise_requests_total{result="unkeyed"}': "unkeyed",
}


async def _text(url: str) -> str:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as resp:
        resp.raise_for_status()
        return await resp.text()


def _series(router_metrics: str) -> dict[str, float]:
    """Each series of ace-extproc's own exposition (``name{labels}``) and its value."""
    out = {}
    for line in router_metrics.splitlines():
        series, _, value = line.rpartition(" ")
        if series and not line.startswith("#"):
            out[series] = float(value)
    return out


def _per_pod(router_metrics: str, family: str) -> dict[str, float]:
    """One of the router's per-pod series: pod id -> value."""
    out = {}
    for series, value in _series(router_metrics).items():
        if series.startswith(family + "{"):
            pod = re.search(r'pod="([^"]*)"', series)
            if pod is not None:
                out[pod.group(1)] = value
    return out


def paces(router_metrics: str) -> dict[str, float]:
    """Each pod's pace as the router learned it by the end (``ace_pod_prefill_pace``,
    ``routing/pace.py``): pod id -> times its TTFT model's time."""
    return {
        pod: round(value, 3)
        for pod, value in _per_pod(router_metrics, "ace_pod_prefill_pace").items()
    }


def scrape_gaps(before: str, after: str, wall_s: float) -> dict[str, float]:
    """Each pod's mean seconds between scrapes over the replay, from the router's
    ``ace_pod_scrapes_total`` before and after it: pod id -> seconds."""
    first = _per_pod(before, "ace_pod_scrapes_total")
    last = _per_pod(after, "ace_pod_scrapes_total")
    return {
        pod: round(wall_s / (n - first.get(pod, 0.0)), 3)
        for pod, n in last.items()
        if n > first.get(pod, 0.0)
    }


def read_cost(summary: dict[str, Any]) -> tuple[float, float] | None:
    """Ours' reads of the pods over the replay (its wall over each pod's mean scrape gap,
    summed) and its router's CPU over them, ms a read; None where the run lacks either."""
    gaps, cpu = summary.get("scrape_gap_s"), (summary.get("cpu_ms_per_request") or {})
    if not gaps or "router" not in cpu or not summary.get("wall_s"):
        return None
    reads = sum(summary["wall_s"] / gap for gap in gaps.values() if gap > 0)
    return (reads, cpu["router"] * summary["requests"] / reads) if reads else None


def mean_ms(before: str, after: str, histogram: str) -> float | None:
    """A histogram's mean over the replay, in ms, from the router's /metrics before and
    after it (all label sets); None where nothing was observed."""
    names = (f"{histogram}_sum", f"{histogram}_count")
    (s0, n0), (s1, n1) = (metric_sums(text, names).values() for text in (before, after))
    return round((s1 - s0) / (n1 - n0) * 1e3, 3) if n1 > n0 else None


def guess(router_metrics: str) -> dict[str, float]:
    """How far a precise router's approximate index was from the pods' events
    (``precise_routing.py``), from its /metrics: the first replica's alone."""
    series = _series(router_metrics)
    return {key: series.get(name, 0.0) for name, key in GUESS_SERIES.items()}


def undecided(router_metrics: str, envoy_stats: str) -> dict[str, int]:
    """Requests that went on without a decision, and why: the router's bypasses by
    reason (its first replica's /metrics), and Envoy's ext_proc streams that failed
    open (the sidecar too slow, ``message_timeouts``, or gone: ``failure_mode_allowed``),
    with the times the sidecar's event loop was held 250 ms or more (``stalls.py``; the
    sidecar's log has the stack that held it) and the longest, in milliseconds."""
    out: dict[str, int] = {}
    for series, value in _series(router_metrics).items():
        if series.startswith('ace_bypasses_total{reason="'):
            out["bypass_" + series.split('"')[1]] = int(value)
        elif series == "ace_event_loop_stalls_total":
            out["loop_stalls"] = int(value)
        elif series == "ace_event_loop_longest_stall_seconds":
            out["loop_longest_stall_ms"] = round(value * 1000)
    for line in envoy_stats.splitlines():
        name, _, count = line.partition(": ")
        for stat in ("message_timeouts", "failure_mode_allowed", "streams_failed"):
            # The routing filter's (stat_prefix "ace"), not the observe filter's.
            if name.endswith(f".ext_proc.ace.{stat}") and count.strip().isdigit():
                out[f"envoy_{stat}"] = out.get(f"envoy_{stat}", 0) + int(count)
    return {k: v for k, v in sorted(out.items()) if v}


def process_cpu(stack: Any) -> dict[str, float]:
    """CPU seconds used so far by the stack's processes, by group: ``envoy`` (the one
    before ace-extproc), ``pods`` (simulated ones), ``router`` (every ace-extproc server
    and its Redis, or a peer router). On the real-engine tier the engines share the
    machine's cores with them: a router that burns CPU slows the engines it routes to."""
    out: dict[str, float] = {}
    for name, proc in getattr(stack, "procs", {}).items():
        group = "envoy" if name == "envoy" else "pods" if name.startswith("pod-") else "router"
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[group] = out.get(group, 0.0) + cpu_s(proc.pid)
    return out


def counter_deltas(
    before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]
) -> list[dict[str, float]]:
    return [{k: a[k] - b[k] for k in a} for b, a in zip(before, after, strict=True)]


# ------------------------------------------------------------------ aggregation


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": round(percentile(values, 0.50), 3), "p99": round(percentile(values, 0.99), 3)}


def _families(ok: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Answered requests, hit ratio and cached share per request family."""
    out: dict[str, dict[str, Any]] = {}
    for family in sorted({r.family for r in ok}):
        rs = [r for r in ok if r.family == family]
        prompt = sum(r.prompt_tokens or 0 for r in rs)
        out[family] = {
            "requests": len(rs),
            "hit_ratio": _ratio(sum(1 for r in rs if r.cached_tokens), len(rs)),
            "cached_share": _ratio(sum(r.cached_tokens or 0 for r in rs), prompt),
        }
    return out


def summarize(
    records: Sequence[Record], per_pod: Sequence[dict[str, float]] | None, wall_s: float
) -> dict[str, Any]:
    """One router's figures from its records and each pod's counter deltas."""
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    pods = Counter(r.pod or "?" for r in ok)
    if "?" in pods and per_pod and any(p["requests"] for p in per_pod):
        # No pod header (real engines): who served what, by the engines' own count.
        pods = Counter({f"pod-{i}": int(p["requests"]) for i, p in enumerate(per_pod)})
    engine = None
    if per_pod is not None:
        engine = {k: sum(p[k] for p in per_pod) for k in COUNTERS.values()}
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": dict(Counter(r.error for r in records if r.error).most_common()),
        "hit_ratio": _ratio(sum(1 for r in ok if r.cached_tokens), len(ok)),
        "cached_share": _ratio(cached, prompt),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "latency_ms": _quantiles([r.latency_ms for r in ok]),
        "ttft_ms": _quantiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "engine_ttft_ms": _quantiles(
            [r.engine_ttft_ms for r in ok if r.engine_ttft_ms is not None]
        ),
        "wall_s": round(wall_s, 3),
        "rps": round(len(ok) / wall_s, 1) if wall_s > 0 else None,
        "pods": dict(sorted(pods.items())),
        "busiest_pod_share": _ratio(max(pods.values(), default=0), sum(pods.values())),
        "stayed_share": stayed_share(records),
        "families": _families(ok),
        "engine": None,
    }
    if engine is not None:
        out["engine"] = {
            **{k: int(v) for k, v in engine.items()},
            "hit_share": _ratio(engine["prefix_cache_hits"], engine["prefix_cache_queries"]),
            "cached_share": _ratio(engine["prompt_tokens_cached"], engine["prompt_tokens"]),
        }
    return out


def envoy_holds(log: str) -> dict[str, float]:
    """Envoy's routing hold in ms by request id, from its JSON access-log lines
    (``envoy_config.ACCESS_LOG_FIELDS``). Envoy's own log lines, and entries without a
    hold (no pod reached: "-"), are skipped."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        hold, rid = entry.get("routing_hold_us"), entry.get("request_id")
        if isinstance(hold, int | float) and not isinstance(hold, bool) and isinstance(rid, str):
            out[rid] = hold / 1e3
    return out


def hold_summary(records: Sequence[Record]) -> dict[str, Any]:
    """Quantiles of Envoy's routing hold and of the TTFT without it, over the answered
    requests that have both: the share of the TTFT routing took."""
    both = [
        (r.ttft_ms, r.hold_ms)
        for r in records
        if r.error is None and r.ttft_ms is not None and r.hold_ms is not None
    ]
    return {
        "hold_ms": _quantiles([hold for _, hold in both]),
        "ttft_less_hold_ms": _quantiles([ttft - hold for ttft, hold in both]),
        "held": len(both),
    }


def stayed_share(records: Sequence[Record]) -> float | None:
    """Of the answered requests that follow an answered one of their session, the share
    served by the same pod: where replicas disagree on a conversation's pod, its turns
    move (and miss the cache)."""
    ordered = sorted(records, key=lambda r: r.index)
    served = [r.error is None and bool(r.pod) for r in ordered]
    prev = previous_in_session([r.session for r in ordered])
    pairs = [
        (r, ordered[p])
        for i, (r, p) in enumerate(zip(ordered, prev, strict=True))
        if p is not None and served[i] and served[p]
    ]
    return _ratio(sum(1 for r, q in pairs if r.pod == q.pod), len(pairs))


# ------------------------------------------------------------------ one router


@dataclass
class RouterRun:
    name: str
    summary: dict[str, Any] | None = None
    records: list[Record] = field(default_factory=list)
    skipped: str | None = None  # not installed here
    failed: str | None = None  # could not start or broke down


async def _start(
    name: str, stack: Stack, ports: list[int], options: LiveOptions, real: Pods | None
) -> list[str]:
    """Start router ``name`` (and for simulated engines, its pods); returns [router base
    URL, *pod URLs]."""
    listen, admin = f"127.0.0.1:{ports[-3]}", f"127.0.0.1:{ports[-2]}"
    if isinstance(stack, peers.PeerStack):
        if real is None:
            config = await stack.start_pods(options.pods)
        else:
            assert stack.options.fleet_path is not None
            config = config_mod.load(stack.options.fleet_path)
        pod_urls = [p.base_url for p in config.fleet.pods]
        if name == "envoy_rr":
            url = await stack.start_plain_envoy(config, listen, admin)
        else:
            port, metrics = ports[-3], ports[-2]
            url = await stack.start_peer(name, port, metrics, pod_urls, options.peer_policy)
        return [url, *pod_urls]
    await stack.start()
    assert stack.config is not None
    return [stack.url, *(p.base_url for p in stack.config.fleet.pods)]


def _real_fleet(
    pods: Pods, options: LiveOptions, precise: bool = False, router: dict[str, object] | None = None
) -> str:
    """A fleet.yaml naming the real servers, for ace-extproc and plain Envoy; with
    ``precise``, their tokenizer and KV event publishers too; ``router``: its settings."""
    path = Path(tempfile.mkdtemp(prefix="bench-live-")) / "fleet.yaml"
    events = [f"tcp://{pods.host}:{port}" for port in pods.kv_events_ports] if precise else []
    doc = vllm_pods.fleet_doc(
        pods.urls,
        dict(options.router) if router is None else router,
        tokenizer=pods.options.model if precise else "",
        kv_events=events,
    )
    path.write_text(yaml.safe_dump(doc))
    return str(path)


async def run_router(
    name: str, requests: Sequence[Prepared], options: LiveOptions, real: Pods | None = None
) -> RouterRun:
    """One router's replay, in front of new simulated pods or of the ``real`` servers
    (their prefix caches emptied first)."""
    run = RouterRun(name)
    if name in peers.PEERS:
        run.skipped = peers.unavailable(name)
        if run.skipped:
            return run
    ports = free_ports(options.pods + 3)
    stack_options = StackOptions(
        pods=options.pods,
        first_pod_port=ports[0],
        listen=f"127.0.0.1:{ports[-3]}",
        admin=f"127.0.0.1:{ports[-2]}",
        ext_proc=f"127.0.0.1:{ports[-1]}",
        time_scale=options.time_scale,
        sim_args=list(options.sim_args),
        router=dict(options.router),
        env={"ACE_SALT_SECRET": SALT_SECRET},
    )
    if name in POLICY_ROUTERS:
        stack_options.router["policy"] = POLICY_ROUTERS[name]
    stack_options.router.update(SETTINGS_ROUTERS.get(name, {}))
    variant = ace_variant(name)
    if real is not None:
        await real.reset_prefix_caches()
        precise = variant is not None and variant.precise
        stack_options.fleet_path = _real_fleet(real, options, precise, stack_options.router)
    if variant is not None:
        stack_options.ext_proc_replicas, stack_options.share = variant.servers, variant.shared
        stack_options.precise = variant.precise and real is None
        stack_options.metrics = f"127.0.0.1:{free_ports(1)[0]}"
    stack = Stack(stack_options) if variant is not None else peers.PeerStack(stack_options)
    clears: asyncio.Task[list[dict[str, Any]]] | None = None
    foreign: asyncio.Task[list[dict[str, Any]]] | None = None
    stop_foreign = asyncio.Event()
    try:
        url, *pod_urls = await _start(name, stack, ports, options, real)
        before = await scrape(pod_urls)
        router_before = (
            "" if variant is None else await _text(f"http://{stack_options.metrics}/metrics")
        )
        cpu_before = process_cpu(stack)
        clears = asyncio.create_task(clear_caches(pod_urls, options.clear_cache_at))
        if options.foreign_load is not None:
            model = json.loads(requests[0].body).get("model", "") if requests else ""
            foreign = asyncio.create_task(
                foreign_load(pod_urls[0], model, *options.foreign_load, stop_foreign)
            )
        run.records, wall = await replay(url, requests, options)
        cpu_after = process_cpu(stack)
        cleared = await _stop_clearing(clears)
        stop_foreign.set()
        foreigners = await foreign if foreign is not None else []
        after = await scrape(pod_urls)
        dead = stack.dead()
        if real is not None:
            dead += [f"vllm-{i}" for i in range(len(real.ports)) if not real.running(i)]
        if dead:
            run.failed = f"{', '.join(dead)} exited during the replay"
        per_pod = counter_deltas(before, after)
        if foreign is not None:
            without_foreign(per_pod, foreigners)
        run.summary = summarize(run.records, per_pod, wall)
        if options.clear_cache_at:
            run.summary["cache_clears"] = cleared
        if foreign is not None:
            run.summary["foreign_load"] = _foreign_summary(foreigners)
        run.summary["cpu_ms_per_request"] = {
            group: round((cpu_after[group] - cpu_before[group]) * 1000 / len(requests), 2)
            for group in cpu_before
            if group in cpu_after and requests
        }
        if variant is not None:
            router_text = await _text(f"http://{stack_options.metrics}/metrics")
            envoy_text = await _text(f"http://{stack_options.admin}/stats?filter=ext_proc")
            run.summary["undecided"] = undecided(router_text, envoy_text)
            run.summary["pace"] = paces(router_text)
            run.summary["scrape_gap_s"] = scrape_gaps(router_before, router_text, wall)
            # Where Envoy's hold goes: the decision in process, the rest gRPC and Envoy.
            run.summary["decision_mean_ms"] = mean_ms(
                router_before, router_text, "ace_decision_seconds"
            )
            if variant.precise:
                run.summary["guess"] = guess(router_text)
            await stack.stop_process("envoy")  # which flushes its access log
            holds = envoy_holds((stack.workdir / "envoy.log").read_text(errors="replace"))
            run.records = [replace(r, hold_ms=holds.get(r.request_id or "")) for r in run.records]
            run.summary.update(hold_summary(run.records))
    except (StackError, aiohttp.ClientError, OSError) as exc:
        run.failed = str(exc)
    finally:
        for task in (clears, foreign):
            if task is not None and not task.done():
                task.cancel()
        await stack.stop()
    return run


async def run_all(
    workload: Workload,
    routers: Sequence[str],
    options: LiveOptions,
    progress: Callable[[str], None] = lambda _: None,
) -> list[RouterRun]:
    requests = prepare(workload, options.stream)
    if options.engine != "vllm":
        if workload.max_loras and "--enable-lora" not in options.sim_args:
            # The simulated pods serve the workload's adapters as the real ones do.
            flags = ("--enable-lora", "--max-loras", str(workload.max_loras), "--lora-modules")
            sim_args = (*options.sim_args, *flags, *(f"{n}=-" for n in _adapter_names(workload)))
            options = replace(options, sim_args=sim_args)
        return await _each(requests, routers, options, progress, None)
    # Every server publishes KV events (a port each): ace_precise follows them, the
    # other routers ignore them.
    workdir = Path(tempfile.mkdtemp(prefix="bench-live-vllm-"))
    lora = _adapters(workload, workdir)
    vllm = VllmOptions.find(
        kv_blocks=options.kv_blocks,
        dev_mode=True,
        kv_events=True,
        niceness=options.engine_nice,
        cores=options.engine_cores,
        **lora,
    )
    progress(f"starting {options.pods} vLLM servers (logs in {workdir})")
    ports = free_ports(2 * options.pods)
    async with Pods(
        vllm, ports[: options.pods], workdir, kv_events_ports=ports[options.pods :]
    ) as real:
        return await _each(requests, routers, options, progress, real)


def _adapter_names(workload: Workload) -> list[str]:
    """The adapters a LoRA workload's requests name (as their ``model``)."""
    return sorted({msgspec.json.decode(r.body).get("model", "") for r in workload.requests})


def _adapters(workload: Workload, workdir: Path) -> dict[str, Any]:
    """A LoRA workload's engine options: every adapter its requests name, made locally
    with random weights (``vllm_pods.make_adapters``), and its ``--max-loras``."""
    if not workload.max_loras:
        return {}
    names = _adapter_names(workload)
    made = vllm_pods.make_adapters(workdir / "adapters", len(names))
    modules = tuple(vllm_pods.LoraModule(n, m.path) for n, m in zip(names, made, strict=True))
    return {"lora_modules": modules, "max_loras": workload.max_loras}


async def _each(
    requests: Sequence[Prepared],
    routers: Sequence[str],
    options: LiveOptions,
    progress: Callable[[str], None],
    real: Pods | None,
) -> list[RouterRun]:
    runs: list[RouterRun] = []
    for name in routers:
        progress(f"{name}: starting the router" + ("" if real else f" and {options.pods} pods"))
        started = time.monotonic()
        run = await run_router(name, requests, options, real)
        if turn := sum(r.name.partition("#")[0] == name for r in runs):
            run.name = f"{name}#{turn + 1}"  # a repeat: its records and summary apart
        what = run.skipped or run.failed or f"{len(run.records)} requests"
        progress(f"{name}: {what} ({time.monotonic() - started:.1f} s)")
        runs.append(run)
    return runs


# ------------------------------------------------------------------ the simulation's view


def predict(workload: Workload, routers: Sequence[str], options: LiveOptions) -> dict[str, Any]:
    """The fleet simulation's figures for each router on the real engines' shape."""
    from bench.baselines import POLICIES
    from bench.fleetsim import simulate
    from bench.fleetsim.settings import cpu_vllm

    settings = cpu_vllm(options.kv_blocks)
    out: dict[str, Any] = {}
    for name in routers:
        policy = SIMULATED_AS.get(name)
        if policy is None:
            continue
        result = simulate(
            workload, POLICIES[policy], pods=options.pods, settings=settings, progress=False
        )
        prompt = sum(r.prompt_tokens for r in result.records)
        cached = sum(r.cached_tokens for r in result.records)
        out[name] = {
            "policy": policy,
            "cached_share": _ratio(cached, prompt),
            "ttft_ms": _quantiles([r.ttft_s * 1e3 for r in result.records]),
        }
    return out


# ------------------------------------------------------------------ report


def _pct(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{100 * value:>8.1f}"


def _ms(q: dict[str, float] | None, key: str) -> str:
    return f"{'-':>9}" if q is None else f"{q[key]:>9.1f}"


def format_table(runs: Sequence[RouterRun], predicted: dict[str, Any] | None = None) -> str:
    w = max([10, *(len(run.name) + 1 for run in runs)])
    head = (
        f"{'router':<{w}}{'reqs':>6}{'errors':>7}{'hit%':>8}{'cached%':>8}{'engine%':>8}"
        f"{'lat p50':>9}{'p99':>9}{'ttft p50':>9}{'p99':>9}{'sim p50':>9}{'p99':>9}"
        f"{'req/s':>8}{'busiest':>8}{'stayed':>8}"
    )
    lines = [head]
    for run in runs:
        s = run.summary
        if s is None:
            reason = f"skipped: {run.skipped}" if run.skipped else f"FAILED: {run.failed}"
            lines.append(f"{run.name:<{w}}{reason}")
            continue
        engine = s["engine"]["hit_share"] if s["engine"] else None
        lines.append(
            f"{run.name:<{w}}{s['requests']:>6}{s['errors']:>7}{_pct(s['hit_ratio'])}"
            f"{_pct(s['cached_share'])}{_pct(engine)}"
            f"{_ms(s['latency_ms'], 'p50')}{_ms(s['latency_ms'], 'p99')}"
            f"{_ms(s['ttft_ms'], 'p50')}{_ms(s['ttft_ms'], 'p99')}"
            f"{_ms(s.get('engine_ttft_ms'), 'p50')}{_ms(s.get('engine_ttft_ms'), 'p99')}"
            f"{s['rps'] or 0:>8.1f}{_pct(s['busiest_pod_share'])}"
            f"{_pct(s.get('stayed_share'))}"
        )
        if run.failed:
            lines.append(f"{'':<{w}}FAILED: {run.failed}")
    if predicted:
        lines.append("\nthe fleet simulation's prediction for the same shape (bench.fleetsim)")
        lines.append(
            f"{'router':<{w}}{'as':>20}{'cached%':>8}{'sim%':>8}{'ttft p50':>9}{'p99':>9}"
            f"{'sim p50':>9}{'p99':>9}"
        )
        for run in runs:
            p = predicted.get(run.name)
            if p is None or run.summary is None:
                continue
            s = run.summary
            lines.append(
                f"{run.name:<{w}}{p['policy']:>20}{_pct(s['cached_share'])}"
                f"{_pct(p['cached_share'])}{_ms(s['ttft_ms'], 'p50')}{_ms(s['ttft_ms'], 'p99')}"
                f"{_ms(p['ttft_ms'], 'p50')}{_ms(p['ttft_ms'], 'p99')}"
            )
    lines.append(
        "hit%: answered requests with any cached token; cached%: cached / prompt tokens "
        "(engine usage); engine%: pods' prefix_cache_hits / queries (/metrics); "
        "ms; sim: TTFT on the simulated pods' clock; busiest: the busiest pod's share of "
        "requests; stayed: a conversation's next turn on its previous turn's pod"
    )
    guessed = [run for run in runs if run.summary and run.summary.get("guess")]
    if guessed:
        lines.append(
            "\nprecise routers' approximate index against the events (first replica): keyed "
            "requests whose deepest pods it guessed alike; blocks only it / only the events held"
        )
        for run in guessed:
            g = run.summary["guess"] if run.summary else {}
            picks = g["same"] + g["differs"]
            lines.append(
                f"{run.name:<{w}}{_pct(g['same'] / picks if picks else None)}"
                f"{g['guess_only_blocks']:>12.0f}{g['events_only_blocks']:>12.0f}"
            )
    for key, title in (
        ("cpu_ms_per_request", "CPU a request on this machine, ms (the engines share its cores)"),
        ("undecided", "requests that went on undecided (router bypasses; Envoy failing open)"),
        ("scrape_gap_s", "seconds between the router's scrapes of each pod, mean over the replay"),
    ):
        shown = [run for run in runs if run.summary and run.summary.get(key)]
        if shown:
            lines.append("\n" + title)
        for run in shown:
            named = run.summary[key] if run.summary else {}
            lines.append(f"{run.name:<{w}}" + ", ".join(f"{k} {v:g}" for k, v in named.items()))
    costs = [(run.name, c) for run in runs if run.summary and (c := read_cost(run.summary))]
    if costs:
        lines.append("\nreads of the pods over the replay; the router's CPU over them, ms a read")
    for name, (reads, ms) in costs:
        lines.append(f"{name:<{w}}{reads:.0f} reads, {ms:.2f} ms (all its CPU: a bound)")
    held = [run for run in runs if run.summary and run.summary.get("hold_ms")]
    if held:
        lines.append("\nEnvoy's hold for the ext_proc's answer, and the TTFT without it, ms")
    for run in held:
        assert run.summary is not None
        hold, rest = run.summary["hold_ms"], run.summary["ttft_less_hold_ms"]
        decision = run.summary.get("decision_mean_ms")
        lines.append(
            f"{run.name:<{w}}hold p50 {hold['p50']:g}, p99 {hold['p99']:g}"
            + ("" if decision is None else f" (the decision in process: {decision:g} mean)")
            + f"; TTFT less it p50 {rest['p50']:g}, p99 {rest['p99']:g}"
        )
    families = sorted({f for run in runs if run.summary for f in run.summary["families"]})
    if len(families) > 1:
        lines.append("\ncached% by family (requests)")
        lines.append(f"{'router':<{w}}" + "".join(f"{f[:14]:>16}" for f in families))
        for run in runs:
            if run.summary is None:
                continue
            cells = []
            for f in families:
                x = run.summary["families"].get(f)
                share = None if x is None else x["cached_share"]
                text = "-" if x is None else f"{_pct(share).strip()} ({x['requests']})"
                cells.append(f"{text:>16}")
            lines.append(f"{run.name:<{w}}" + "".join(cells))
    return "\n".join(lines)


def result_doc(
    workload: Workload,
    runs: Sequence[RouterRun],
    options: LiveOptions,
    command: str,
    wall_s: float,
    predicted: dict[str, Any] | None = None,
    left_out: int = 0,
) -> dict[str, Any]:
    bound = ceiling(workload.requests)
    routers: dict[str, Any] = {}
    for run in runs:
        entry: dict[str, Any] = dict(run.summary or {})
        if run.skipped:
            entry["skipped"] = run.skipped
        if run.failed:
            entry["failed"] = run.failed
        if run.name in peers.PEERS:
            entry["peer"] = {
                "package": peers.DISTRIBUTIONS[run.name],
                "version": peers.version(run.name),
                "policy": options.peer_policy,
            }
        if predicted and run.name in predicted:
            entry["simulated"] = predicted[run.name]
        routers[run.name] = entry
    return {
        "command": command,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "requests": len(workload.requests),
            "sessions": len({r.session for r in workload.requests}),
            "fleet_events_ignored": len(workload.events),
            "left_out_over_max_body_bytes": left_out,
            # The most any router could serve from cache (bench/ceiling.py).
            "cached_share_ceiling": round(bound.share, 4),
        },
        "options": asdict(options),
        "replay": (
            f"closed loop, at most {options.concurrency} in flight"
            + (f", arrivals / {options.speed}" if options.speed > 0 else "")
            + ", session turns in order, "
            + ("streamed with include_usage" if options.stream else "bodies as in the workload")
        ),
        "wall_s": round(wall_s, 1),
        "routers": routers,
    }


def write_records(path: Path, runs: Sequence[RouterRun]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for run in runs:
            for r in run.records:
                f.write(json.dumps({"router": run.name, **asdict(r)}) + "\n")


# ------------------------------------------------------------------ CLI


def load_workload(name: str, limit: int | None, rate: float | None, seed: int = 0) -> Workload:
    """``bench.workloads.get(name, limit=..., rate=..., seed=...)``, cut to ``limit``
    requests."""
    from bench import workloads

    get: Callable[..., Workload] | None = getattr(workloads, "get", None)
    if get is None:
        raise ValueError("bench.workloads.get is not available (the workload generators)")
    kwargs: dict[str, Any] = {"seed": seed} if seed else {}
    if limit is not None:
        kwargs["limit"] = limit
    if rate is not None:
        kwargs["rate"] = rate
    workload = get(name, **kwargs)
    if limit is not None and len(workload.requests) > limit:
        workload.requests = workload.requests[:limit]
    return workload


def _routers(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in ROUTERS and ace_variant(x) is None]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected some of {','.join(ROUTERS)}, ace_xN, ace_xN_shared or "
            f"ace_precise_xN, got {text!r}"
        )
    return names


def _seconds(text: str) -> tuple[float, ...]:
    try:
        times = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        times = ()
    if not times or any(t < 0 for t in times):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, comma-separated, got {text!r}")
    return times


def _foreign(text: str) -> tuple[int, float]:
    tokens, sep, every = text.partition("@")
    try:
        parsed = int(tokens), float(every)
    except ValueError:
        parsed = (0, 0.0)
    if not sep or parsed[0] <= 0 or parsed[1] <= 0:
        raise argparse.ArgumentTypeError(f"expected TOKENS@SECONDS, both > 0, got {text!r}")
    return parsed


def _router_setting(item: str, ap: argparse.ArgumentParser) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        ap.error(f"--router-setting {item!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.live", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--workload", required=True, help="a name bench.workloads.get knows")
    ap.add_argument("--limit", type=int, help="at most this many requests")
    ap.add_argument("--rate", type=float, help="passed to the workload generator (requests/s)")
    ap.add_argument(
        "--seed", type=int, default=0, help="the workload generator's seed (as bench.report)"
    )
    ap.add_argument("--pods", type=int, default=4, help="pods per router (default 4)")
    ap.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="simulated pods, or real vLLM servers shared by the routers (make engines)",
    )
    ap.add_argument("--kv-blocks", type=int, help="real servers' KV cache, 32-token blocks")
    ap.add_argument(
        "--max-body-bytes", type=int, help="leave out requests with longer bodies (context)"
    )
    ap.add_argument("--routers", type=_routers, default=list(ROUTERS), help=",".join(ROUTERS))
    ap.add_argument("--time-scale", type=float, default=0.01, help="pods' clock (default 0.01)")
    ap.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    ap.add_argument(
        "--speed", type=float, default=0.0, help="hold requests to arrival_s / SPEED (0: don't)"
    )
    ap.add_argument("--no-stream", action="store_true", help="send the bodies unchanged")
    ap.add_argument("--peer-policy", default="cache_aware", help="peers' --policy")
    ap.add_argument("--sim-args", default="", help="extra `ace-extproc sim` flags, one string")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--out", help="default: bench/results/live-<workload>.json")
    ap.add_argument("--records", help="write per-request records here (JSON lines)")
    ap.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        help="run the real vLLM servers at this niceness (their session's autogroup too), "
        "so the router and Envoy get the CPU first, as beside GPU engines (default 0: "
        "the OS starves every process for seconds at a time while they prefill)",
    )
    ap.add_argument(
        "--engine-cores",
        choices=("pinned", "split", "shared"),
        default="pinned",
        help="real vLLM servers: each with every process on a share of the cores of its "
        "own, as each pod has its own accelerator and host in production (default); "
        "`split`: only their compute threads (before 2026-12-07 evening: a pod busy-polling "
        "its worker stalled the other pod for seconds); `shared`: all on every core "
        "(before 2026-12-07: two pods busy at once ran 2-10x slower a token)",
    )
    ap.add_argument(
        "--clear-cache-at",
        type=_seconds,
        default=(),
        metavar="S[,S...]",
        help="empty a pod's prefix cache this many seconds into each router's replay, "
        "pods in turn, its running requests preempted (a restart's effect on the cache); "
        "the router is not told",
    )
    ap.add_argument(
        "--foreign-load",
        type=_foreign,
        metavar="TOKENS@SECONDS",
        help="send a new prompt of about TOKENS tokens straight to the first pod every "
        "SECONDS seconds of each router's replay, past the router (a second gateway's "
        "traffic: it evicts the router's blocks there); left out of the figures",
    )
    ap.add_argument(
        "--router-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an ace-extproc `router:` setting for the ace run (YAML value); repeatable",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    if args.pods < 1 or args.concurrency < 1 or args.time_scale < 0 or args.speed < 0:
        ap.error("pods and concurrency must be >= 1; time-scale and speed >= 0")
    options = LiveOptions(
        pods=args.pods,
        time_scale=args.time_scale,
        concurrency=args.concurrency,
        speed=args.speed,
        stream=not args.no_stream,
        peer_policy=args.peer_policy,
        sim_args=tuple(shlex.split(args.sim_args)),
        request_timeout_s=args.request_timeout,
        router=tuple(_router_setting(item, ap) for item in args.router_setting),
        seed=args.seed,
        engine=args.engine,
        kv_blocks=args.kv_blocks,
        engine_nice=args.engine_nice,
        engine_cores=args.engine_cores,
        clear_cache_at=args.clear_cache_at,
        foreign_load=args.foreign_load,
    )
    try:
        workload = load_workload(args.workload, args.limit, args.rate, options.seed)
        if options.engine == "vllm":
            VllmOptions.find()  # before anything starts: is there an engine to run?
    except (ValueError, KeyError, OSError, EnginesMissing) as exc:
        print(f"error: workload {args.workload!r}: {exc}", file=sys.stderr)
        return 2
    left_out = 0
    if args.max_body_bytes:
        kept = [r for r in workload.requests if len(r.body) <= args.max_body_bytes]
        left_out = len(workload.requests) - len(kept)
        workload.requests = kept

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if workload.events:
        progress(f"note: {len(workload.events)} fleet events of {workload.name} are not replayed")
    started = time.monotonic()
    runs = uvloop.run(run_all(workload, args.routers, options, progress))
    wall = time.monotonic() - started
    predicted = None
    if options.engine == "vllm":
        progress("the fleet simulation's prediction for the same shape")
        predicted = predict(workload, args.routers, options)
    print(
        f"\nlive: {workload.name}, {len(workload.requests)} requests, {options.pods} "
        + (
            f"real vLLM servers ({options.kv_blocks or vllm_pods.DEFAULT_KV_BLOCKS} KV blocks)"
            if options.engine == "vllm"
            else f"pods, time-scale {options.time_scale}"
        )
        + f", concurrency {options.concurrency}"
        + (f", speed {options.speed}" if options.speed else "")
        + (", streamed" if options.stream else ", not streamed")
    )
    print(format_table(runs, predicted))
    command = shlex.join(["python", "-m", "bench.live", *argv])
    doc = result_doc(workload, runs, options, command, wall, predicted, left_out)
    print(
        f"ceiling: {doc['workload']['cached_share_ceiling']:.1%} of prompt tokens, the most"
        " any router could serve from cache (one cache holding every earlier prompt;"
        " python -m bench.ceiling)"
    )
    suffix = f"-seed{options.seed}" if options.seed else ""
    engine = "" if options.engine == "sim" else f"{options.engine}-"
    out = Path(args.out or f"bench/results/live-{engine}{workload.name}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out} ({wall:.0f} s)")
    if args.records:
        write_records(Path(args.records), runs)
        print(f"wrote {args.records}")
    return 1 if any(run.failed for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
