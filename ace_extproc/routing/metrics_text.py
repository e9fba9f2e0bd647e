"""The few series the router needs from an engine's Prometheus ``/metrics`` text.

vLLM and SGLang names are read in one pass (a pod is whichever it says it is).
A series exposed under several label sets (several models, or data-parallel
engines in one pod) is summed; fractions (KV use, hit rate) are averaged. The
text is scanned as bytes with one regex that only stops on wanted lines: a vLLM
exposition is mostly histogram buckets, and this runs on the event loop that
serves Envoy, every scrape interval, for every pod.

Nothing here raises on bad input: unknown, malformed or non-finite samples are
skipped and counted in ``EngineStats.reason``; fields not found stay None.

SGLang's KV capacity is ``sglang:max_total_num_tokens`` ("Maximum total number of
tokens in the KV cache pool", a gauge in sgl-project/sglang
``python/sglang/srt/metrics/collector.py``). SGLang emits scheduler metrics from
attention-TP rank 0 only unless ``--enable-metrics-for-all-schedulers``, so a sum
over label sets is a sum over DP ranks; with that flag it over-counts.

LoRA (``vllm:lora_requests_info``, vLLM's ``vllm/v1/metrics/loggers.py``): a gauge
whose labels are ``max_lora`` (``--max-loras``) and the comma-separated adapters of the
running and of the waiting requests (``running_lora_adapters``,
``waiting_lora_adapters``), set to the current time at every engine step. Each
combination of labels is its own series and none is ever dropped, so the exposition
holds every combination seen since the engine started: the newest, the largest value,
is the engine's state (``LoraInfo``). The pod's base model is the ``model_name`` label
of its other series (the first served model name).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

# name -> field it feeds. Counters (``*_total``) detect engine restarts.
_VLLM = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_usage",
    b"vllm:prefix_cache_queries_total": "cache_queries",
    b"vllm:prefix_cache_hits_total": "cache_hits",
    b"vllm:prompt_tokens_total": "prompt_tokens",
    # Prompt tokens served from a cache (local prefix cache or a KV connector), counted
    # per finished request: what the engine really reused.
    b"vllm:prompt_tokens_cached_total": "cached_prompt_tokens",
    b"vllm:cache_config_info": "cache_config",
    b"vllm:lora_requests_info": "lora_info",
    # Its reason="deferred" sample: requests waiting for a LoRA adapter's slot, which
    # vllm:lora_requests_info names in neither label (vLLM 0.32).
    b"vllm:num_requests_waiting_by_reason": "waiting_reason",
    # The TTFT histogram's count and sum: each first token, from the request's arrival
    # (queue included), what the router's pace learns from (pace.py).
    b"vllm:time_to_first_token_seconds_count": "first_tokens",
    b"vllm:time_to_first_token_seconds_sum": "first_token_s",
}
_SGLANG = {
    b"sglang:num_running_reqs": "running",
    b"sglang:num_queue_reqs": "waiting",
    b"sglang:token_usage": "kv_usage",
    b"sglang:cache_hit_rate": "hit_rate",
    b"sglang:prompt_tokens_total": "prompt_tokens",
    b"sglang:cached_tokens_total": "cache_hits",  # also its cached_prompt_tokens
    b"sglang:max_total_num_tokens": "capacity",
    b"sglang:time_to_first_token_seconds_count": "first_tokens",
    b"sglang:time_to_first_token_seconds_sum": "first_token_s",
}
# prometheus-client's process collector: a new value means a new process.
_PROCESS = {b"process_start_time_seconds": "start_time"}
_FIELD = {**_VLLM, **_SGLANG, **_PROCESS}
# What the monitor asks for: only these samples. prometheus-client's ASGI app collects
# and renders just the metrics named by ``name[]``. vLLM (0.32) serves its plain
# ``/metrics`` through another handler, which ignores the parameter, and mounts that
# app under ``/metrics/``; SGLang serves the app on both. vLLM's whole exposition is
# ~56 KB, mostly histogram buckets, rendered on the event loop that streams its tokens,
# for every read of every router; these series are 3.5 KB of it, 5-9x less of its CPU.
# A server without that path (a 404, or no engine series) is read at ``METRICS_PATH``.
SCRAPED_SERIES = tuple(name.decode() for name in _FIELD)
METRICS_PATH = "/metrics"
SCRAPE_PATH = "/metrics/?" + urlencode([("name[]", name) for name in SCRAPED_SERIES])


def _trie(names: list[bytes]) -> bytes:
    """One regex alternation of ``names``, factored into a trie: most lines are other
    ``vllm:`` series, and a factored pattern rejects each after a few characters."""
    tree: dict[int, Any] = {}
    for name in names:
        node = tree
        for c in name:
            node = node.setdefault(c, {})
        node[-1] = {}  # the end of a name

    def render(node: dict[int, Any]) -> bytes:
        alts = [b"" if c < 0 else re.escape(bytes([c])) + render(sub) for c, sub in node.items()]
        return alts[0] if len(alts) == 1 else b"(?:" + b"|".join(alts) + b")"

    return render(tree)


# A wanted name at a line start (the text gets a leading newline, so the pattern
# starts with a literal and the regex engine jumps from line to line), its labels
# (greedy to the line's last brace, so braces inside quoted label values are fine),
# then the value. A timestamp after the value is ignored.
_SAMPLE = re.compile(rb"\n[ \t]*(" + _trie(list(_FIELD)) + rb")(\{[^\n]*\})?[ \t]+([^ \t\r\n]+)")
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_MEANS = frozenset({"kv_usage", "hit_rate"})


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """The newest sample of ``vllm:lora_requests_info``: the engine's adapter slots."""

    max_lora: int  # adapter slots (--max-loras); 0 where the label is missing or bad
    running: tuple[str, ...] = ()  # adapters of the running requests
    waiting: tuple[str, ...] = ()  # adapters of the waiting requests (vLLM 0.32: the same)
    deferred: int = 0  # requests waiting for an adapter's slot, named in neither label

    @property
    def in_use(self) -> tuple[str, ...]:
        """Running and waiting, each once, in order (the router's LRU follows it)."""
        return tuple(dict.fromkeys(self.running + self.waiting))


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape, summed over label sets; a field is None when the text lacks it."""

    engine: str | None = None  # "vllm" or "sglang": whose names were found
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    capacity_tokens: int | None = None  # the KV cache in tokens
    block_size: int | None = None  # tokens a KV block (vllm:cache_config_info)
    hit_rate: float | None = None  # prefix cache hits / queried tokens, 0..1
    prompt_tokens: float | None = None  # counters: never decrease while the engine lives
    cache_queries: float | None = None
    cache_hits: float | None = None
    # Prompt tokens the engine served from cache (vllm:prompt_tokens_cached_total;
    # SGLang: sglang:cached_tokens_total, the same series as cache_hits).
    cached_prompt_tokens: float | None = None
    start_time: float | None = None  # process_start_time_seconds, where exposed
    model_name: str | None = None  # the served model (the model_name label), where given
    lora: LoraInfo | None = None  # vllm:lora_requests_info: only with --enable-lora
    # The TTFT histogram: first tokens so far and their summed TTFT (seconds).
    first_tokens: float | None = None
    first_token_s: float | None = None
    reason: str = ""  # why some of the text was not used ("" when all was)

    @property
    def usable(self) -> bool:
        """Whether the scrape says anything about the pod's load."""
        return self.running is not None or self.waiting is not None or self.kv_usage is not None

    @property
    def ttft_counters(self) -> tuple[float, float] | None:
        """The TTFT histogram's (count, sum in seconds), where the text has both."""
        if self.first_tokens is None or self.first_token_s is None:
            return None
        return self.first_tokens, self.first_token_s

    def counters(self) -> dict[str, float]:
        found = {
            "prompt_tokens": self.prompt_tokens,
            "cache_queries": self.cache_queries,
            "cache_hits": self.cache_hits,
        }
        return {k: v for k, v in found.items() if v is not None}


def parse(text: bytes | str) -> EngineStats:
    """The wanted series of one ``/metrics`` body; never raises."""
    if isinstance(text, str):
        text = text.encode("utf-8", "replace")
    text = b"\n" + text
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    capacity_tokens = 0.0
    block_size: int | None = None
    engine: str | None = None
    model_name: str | None = None
    lora_labels: bytes | None = None  # of the newest vllm:lora_requests_info sample
    lora_stamp = -math.inf
    deferred = 0.0  # vllm:num_requests_waiting_by_reason{reason="deferred"}, summed
    bad: list[str] = []
    for m in _SAMPLE.finditer(text):
        name, labels, raw = m.group(1), m.group(2), m.group(3)
        field = _FIELD[name]
        try:
            value = float(raw)
        except ValueError:
            bad.append(f"{name.decode()}: value {raw[:20]!r}")
            continue
        if not math.isfinite(value):
            bad.append(f"{name.decode()}: {raw.decode('ascii', 'replace')}")
            continue
        if engine is None and field != "start_time":
            engine = "vllm" if name in _VLLM else "sglang"
        if field == "lora_info":  # one series per label set: the newest is the state
            if value >= lora_stamp:
                lora_stamp, lora_labels = value, labels or b""
            continue
        if field == "waiting_reason":
            if labels and _label(labels, b"reason") == "deferred":
                deferred += value
            continue
        if model_name is None and labels and field in ("running", "waiting"):
            model_name = _label(labels, b"model_name")
        if field == "cache_config":  # an info series: the figures are its labels
            config = _cache_config(labels or b"")
            if config is None:
                bad.append("vllm:cache_config_info: no block_size/num_gpu_blocks")
                continue
            block_size, blocks = config
            capacity_tokens += block_size * blocks
            continue
        if field == "capacity":
            capacity_tokens += value
            continue
        sums[field] = sums.get(field, 0.0) + value
        counts[field] = counts.get(field, 0) + 1
    if engine is None:
        bad.insert(0, "no vllm: or sglang: series")

    def total(field: str) -> float | None:
        if field not in counts:
            return None
        if field in _MEANS:
            return sums[field] / counts[field]
        return sums[field]

    running, waiting = total("running"), total("waiting")
    hit_rate = total("hit_rate")
    queries, hits = total("cache_queries"), total("cache_hits")
    if hit_rate is None and queries and hits is not None:
        hit_rate = hits / queries
    cached = total("cached_prompt_tokens")
    if cached is None and engine == "sglang":
        cached = hits
    start = total("start_time")
    if start is not None and counts["start_time"] > 1:
        start = None  # several processes in one exposition: no single start
    lora = None if lora_labels is None else _lora(lora_labels, max(0, int(deferred)))
    if lora is not None and not lora.max_lora:
        bad.append("vllm:lora_requests_info: no max_lora")
    return EngineStats(
        engine=engine,
        running=None if running is None else max(0, round(running)),
        waiting=None if waiting is None else max(0, round(waiting)),
        kv_usage=None if (kv := total("kv_usage")) is None else min(max(kv, 0.0), 1.0),
        capacity_tokens=int(capacity_tokens) if capacity_tokens >= 1 else None,
        block_size=block_size,
        hit_rate=hit_rate,
        prompt_tokens=total("prompt_tokens"),
        cache_queries=queries,
        cache_hits=hits,
        cached_prompt_tokens=cached,
        start_time=start,
        model_name=model_name,
        lora=lora,
        first_tokens=total("first_tokens"),
        first_token_s=total("first_token_s"),
        reason="; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""),
    )


def _cache_config(labels: bytes) -> tuple[int, int] | None:
    """``(block_size, num_gpu_blocks)`` from the info series' labels."""
    found = {k: v for k, v in _LABEL.findall(labels) if k in (b"block_size", b"num_gpu_blocks")}
    try:
        block_size, blocks = int(found[b"block_size"]), int(found[b"num_gpu_blocks"])
    except (KeyError, ValueError):
        return None
    return (block_size, blocks) if block_size > 0 and blocks > 0 else None


def _label(labels: bytes, name: bytes) -> str | None:
    """The value of label ``name`` in ``labels`` (``{a="1",...}``), unescaped, or None."""
    for key, raw in _LABEL.findall(labels):
        if key == name:
            return _unescape(raw)
    return None


def _unescape(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    if "\\" not in text:
        return text
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _lora(labels: bytes, deferred: int = 0) -> LoraInfo:
    """The adapter slots one ``vllm:lora_requests_info`` sample describes; a label
    missing or empty is no adapter (or, for ``max_lora``, 0). ``deferred``: the requests
    waiting for a slot."""
    found = {key: _unescape(raw) for key, raw in _LABEL.findall(labels)}
    try:
        max_lora = max(0, int(found.get(b"max_lora", "")))
    except ValueError:
        max_lora = 0

    def names(key: bytes) -> tuple[str, ...]:
        return tuple(n for n in (p.strip() for p in found.get(key, "").split(",")) if n)

    return LoraInfo(
        max_lora, names(b"running_lora_adapters"), names(b"waiting_lora_adapters"), deferred
    )


def restarted(before: EngineStats, after: EngineStats) -> str | None:
    """Why ``after`` looks like a new engine process (counters reset), or None."""
    if (
        before.start_time is not None
        and after.start_time is not None
        and after.start_time != before.start_time
    ):
        return "process_start_time_seconds changed"
    old = before.counters()
    for name, value in after.counters().items():
        if name in old and value < old[name]:
            return f"{name} went back from {old[name]:.0f} to {value:.0f}"
    return None
