"""Operability: the router's own metrics (its logs are ``logs.py``).

**Metrics.** The request path records into plain Python ints (a dict probe and a few
additions per decision, a ``bisect`` per latency step); nothing there takes a lock or
builds a label set. ``Telemetry`` is also a prometheus-client collector: at scrape
time it turns those tallies, and the fleet, index and monitor state it reads then,
into Prometheus families (``ace_*``). ``serve_metrics`` serves them on their own HTTP
port, in a thread, so a scrape never waits on the serving event loop.

A scrape reads the tallies from another thread while the loop may be adding to them.
Each read is of a whole int or a copied dict (atomic under the GIL), so a scrape may
see one decision counted and its tokens not yet: the next scrape has both. Counters
never go backwards.

**Labels.** ``mode`` and ``action`` come from a fixed vocabulary, pods from the fleet
(the pods present, and those gone whose slot no new pod has taken: see
``retire_slot``), steps and states are fixed. A ``tenant`` label exists only
with ``router.metrics_tenant_label``: the tenants the configuration names are labels,
others get one while fewer than ``metrics_max_tenants`` are labelled, the rest fold
into ``other``.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from ace_extproc import request
from ace_extproc.config import Settings, check_listen
from ace_extproc.logs import ANOMALY_BURST, RateLimit, log_decision

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from ace_extproc.config import Pod
    from ace_extproc.observe import Ledger
    from ace_extproc.probes import Probes
    from ace_extproc.routing.fleet import FleetState
    from ace_extproc.routing.index import BlockIndex
    from ace_extproc.routing.monitor import FleetMonitor

# ------------------------------------------------------------------ vocabulary

# Steps of the body phase, timed separately (``step_ns``); the whole decision is
# ``decision(latency_ns=...)``.
STEPS = ("parse", "hash", "pick", "rewrite")
PARSE, HASH, PICK, REWRITE = range(len(STEPS))
_TOTAL = len(STEPS)  # the whole decision's histogram, after the steps'

# Histogram bounds in nanoseconds (exposed in seconds): a decision is tens of
# microseconds at 4K tokens and a few hundred at 32K; parsing a body near the 8 MiB
# limit takes milliseconds.
BOUNDS_NS: tuple[int, ...] = (
    1_000, 2_000, 3_000, 5_000, 7_500, 10_000, 15_000, 20_000, 30_000, 50_000, 75_000,
    100_000, 150_000, 200_000, 300_000, 500_000, 750_000, 1_000_000, 2_500_000,
    5_000_000, 10_000_000, 25_000_000, 50_000_000, 100_000_000,
)  # fmt: skip
_LE = (*(repr(b / 1e9) for b in BOUNDS_NS), "+Inf")  # "le" label values, in seconds

OTHER_TENANT = "other"
# Tenants remembered as "other" (so each is looked up once); past this, looked up each time.
_MAX_REMEMBERED_TENANTS = 10_000

# Actions a well-behaved client and a healthy fleet do not cause: logged at info.
# Routine ones (another path, a GET, mode off) and routing actions are not.
ROUTINE_BYPASSES = frozenset({"bypass_unknown_path", "bypass_method"})


def is_anomaly(action: str) -> bool:
    return action.startswith(("bypass_", "reject_")) and action not in ROUTINE_BYPASSES


# Pod states for ``ace_pods``, the first that applies: gone (discovery removed it);
# marked down by the health checks; drained by an operator (admin API); taking new
# requests; out of rotation for another reason.
POD_STATES = ("removed", "down", "drained", "available", "unavailable")

# Bytes per index entry, when the index cannot say (``BlockIndex.approx_bytes``): the
# Python reference's dict entry and 64-bit int object, as bench.index_memory measures
# (the C BlockLRU's are fewer; an estimate should not be under).
INDEX_BYTES_PER_ENTRY_ESTIMATE = 80


class _Tally:
    """What was recorded for one (mode, action, tenant label, pod slot)."""

    __slots__ = ("anomaly", "cached_tokens", "count", "prompt_tokens", "saved_ms")

    def __init__(self, anomaly: bool) -> None:
        self.count = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.saved_ms = 0.0
        self.anomaly = anomaly


class Telemetry(Collector):
    """Tallies of the router's decisions, and a collector exposing them with the
    fleet's state. One per process (``app.py``); ``registry`` is what
    ``serve_metrics`` serves. ``ledger``: what became of the responses
    (``observe.Ledger``); ``sharing``: this replica's placement sharing, for its stats."""

    def __init__(
        self,
        settings: Settings | None = None,
        fleet: FleetState | None = None,
        index: BlockIndex | None = None,
        monitor: FleetMonitor | None = None,
        *,
        ledger: Ledger | None = None,
        sharing: object = None,
        process_metrics: bool = True,
    ) -> None:
        s = settings or Settings()
        self.fleet = fleet
        self.index = index
        self.monitor = monitor
        self.by_tenant = s.metrics_tenant_label
        self.max_tenants = s.metrics_max_tenants
        # Tenant -> label. The configuration's tenants always have their own.
        known = sorted({*s.tenants.key_digests.values(), s.tenants.anonymous})
        self._tenant_labels: dict[str, str] = {t: t for t in known}
        self._labelled = len(known)
        self._tallies: dict[tuple[str, str, str, int], _Tally] = {}
        self._hist: list[list[int]] = [[0] * len(_LE) for _ in range(len(STEPS) + 1)]
        self._hist_sum: list[int] = [0] * (len(STEPS) + 1)
        self._decision_log = logging.getLogger("ace_extproc.decision")
        self._anomalies = RateLimit(ANOMALY_BURST, 1.0)
        self.ledger = ledger
        self.sharing = sharing
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        if process_metrics:
            ProcessCollector(registry=self.registry)
            GCCollector(registry=self.registry)

    # ------------------------------------------------------------- hot path

    def decision(
        self,
        mode: str,
        action: str,
        tenant: str = "",
        slot: int = -1,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        saved_prefill_ms: float = 0.0,
        latency_ns: int = 0,
        steps: tuple[int, int, int, int] | None = None,
    ) -> None:
        """One request's outcome. ``slot``: the pod picked (``Pick.slot``; -1 when
        none); ``prompt_tokens`` and ``cached_tokens`` the router's estimates
        (``Outcome.saved_tokens``); ``saved_prefill_ms`` the TTFT model's cold minus
        warm time; ``latency_ns`` the whole body phase (0: not timed); ``steps`` its
        routed steps' times, as ``steps_ns`` takes them (None: not routed)."""
        label = (
            (self._tenant_labels.get(tenant) or self._new_tenant(tenant)) if self.by_tenant else ""
        )
        key = (mode, action, label, slot)
        t = self._tallies.get(key)
        if t is None:
            t = self._tallies[key] = _Tally(is_anomaly(action))
        t.count += 1
        t.prompt_tokens += prompt_tokens
        t.cached_tokens += cached_tokens
        t.saved_ms += saved_prefill_ms
        if latency_ns:
            self._hist[_TOTAL][bisect_left(BOUNDS_NS, latency_ns)] += 1
            self._hist_sum[_TOTAL] += latency_ns
        if steps is not None:
            self.steps_ns(*steps)
        if t.anomaly and self._anomalies.allow(action):
            self._log(logging.INFO, "anomaly", mode, action, tenant, slot, prompt_tokens,
                      cached_tokens, latency_ns)  # fmt: skip
        elif self._decision_log.isEnabledFor(logging.DEBUG):
            self._log(logging.DEBUG, "decision", mode, action, tenant, slot, prompt_tokens,
                      cached_tokens, latency_ns)  # fmt: skip

    def retire_slot(self, slot: int) -> None:
        """The pod that was in ``slot`` is gone and another takes the slot: its per-pod
        series end, and what it counted stays in the totals (under no pod), so no
        counter goes backwards. One new dict swapped in, of new tallies where merged,
        so a scrape copying the old one meanwhile still reads a consistent state."""
        old = self._tallies
        if all(key[3] != slot for key in old):
            return
        new = {key: t for key, t in old.items() if key[3] != slot}
        for (mode, action, label, s), t in old.items():
            if s != slot:
                continue
            key = (mode, action, label, -1)
            merged = _Tally(t.anomaly)
            for part in (new.get(key), t):
                if part is not None:
                    merged.count += part.count
                    merged.prompt_tokens += part.prompt_tokens
                    merged.cached_tokens += part.cached_tokens
                    merged.saved_ms += part.saved_ms
            new[key] = merged
        self._tallies = new

    def step_ns(self, step: int, ns: int) -> None:
        """One step's time (``PARSE``, ``HASH``, ``PICK``, ``REWRITE``)."""
        self._hist[step][bisect_left(BOUNDS_NS, ns)] += 1
        self._hist_sum[step] += ns

    def steps_ns(self, parse: int, hash: int, pick: int, rewrite: int = 0) -> None:
        """All four steps' times in one call; a step given as 0 (not run: no rewrite
        in shadow mode, no pick after a parse error) is not recorded."""
        h, s = self._hist, self._hist_sum
        if parse:
            h[0][bisect_left(BOUNDS_NS, parse)] += 1
            s[0] += parse
        if hash:
            h[1][bisect_left(BOUNDS_NS, hash)] += 1
            s[1] += hash
        if pick:
            h[2][bisect_left(BOUNDS_NS, pick)] += 1
            s[2] += pick
        if rewrite:
            h[3][bisect_left(BOUNDS_NS, rewrite)] += 1
            s[3] += rewrite

    def _new_tenant(self, tenant: str) -> str:
        if tenant and self._labelled < self.max_tenants:
            self._labelled += 1
            label = tenant
        else:
            label = OTHER_TENANT
        if len(self._tenant_labels) < _MAX_REMEMBERED_TENANTS:
            self._tenant_labels[tenant] = label
        return label

    def tenant_label(self, tenant: str) -> str:
        """The label value a tenant's decisions get ("" without tenant labels)."""
        if not self.by_tenant:
            return ""
        return self._tenant_labels.get(tenant) or self._new_tenant(tenant)

    def _log(
        self,
        level: int,
        event: str,
        mode: str,
        action: str,
        tenant: str,
        slot: int,
        prompt_tokens: int,
        cached_tokens: int,
        latency_ns: int,
    ) -> None:
        suppressed = self._anomalies.take_suppressed(action) if event == "anomaly" else 0
        log_decision(
            self._decision_log,
            mode,
            action,
            tenant,
            self.pod_name(slot),
            prompt_tokens,
            cached_tokens,
            latency_ns,
            level=level,
            event=event,
            suppressed=suppressed,
        )

    # ------------------------------------------------------------- scrape time

    def pod_name(self, slot: int) -> str:
        """``destination/pod`` of a slot ("" for none)."""
        if slot < 0:
            return ""
        pods = self.fleet.pods if self.fleet is not None else []
        return pods[slot].key if slot < len(pods) else f"slot-{slot}"

    def collect(self) -> Iterator[Metric]:
        yield from self._decision_families()
        yield from self._latency_families()
        yield self._parser_family()
        if self.fleet is not None:
            yield from self._fleet_families(self.fleet)
        if self.index is not None:
            yield from self._index_families(self.index)
        if self.ledger is not None:
            yield from self._response_families(self.ledger)
        stats = getattr(self.sharing, "stats", None)
        if stats is not None:
            yield from self._sharing_families(stats())

    def _parser_family(self) -> Metric:
        parsed = CounterMetricFamily(
            "ace_parsed_bodies",
            "Request bodies parsed by the native code (native) or handed to the Python "
            "parser (python: what the C one does not handle, invalid bodies included; "
            "all of them where the extension was not built).",
            labels=["parser"],
        )
        for parser, count in request.parsed_by.copy().items():
            parsed.add_metric([parser], count)
        return parsed

    def _decision_families(self) -> Iterator[Metric]:
        # The pods first: a slot retired after this copy has its tallies out of the
        # copy below, so a gone pod's counts are never labelled with its successor.
        pods = list(self.fleet.pods) if self.fleet is not None else []
        tallies = self._tallies.copy()  # atomic: the loop may add keys meanwhile
        tenant = ["tenant"] if self.by_tenant else []
        decisions = CounterMetricFamily(
            "ace_decisions",
            "Routing decisions, by mode and action (hit, miss, spill, off, bypass_<reason>, "
            "reject_<reason>).",
            labels=["mode", "action", *tenant],
        )
        bypasses = CounterMetricFamily(
            "ace_bypasses",
            "Requests passed through undecided, by reason (the actions bypass_<reason>).",
            labels=["reason"],
        )
        pod = ["mode", "destination", "pod"]
        picks = CounterMetricFamily("ace_picks", "Decisions that picked this pod.", labels=pod)
        prompt = CounterMetricFamily(
            "ace_estimated_prompt_tokens",
            "Prompt tokens of the decisions that picked this pod (router estimate: canonical "
            "prompt bytes / bytes_per_token).",
            labels=pod,
        )
        cached = CounterMetricFamily(
            "ace_estimated_cached_tokens",
            "Prompt tokens the router believed cached on the pod it picked (matched blocks; "
            "the trace's saved_prefill_tokens).",
            labels=pod,
        )
        saved = CounterMetricFamily(
            "ace_estimated_saved_prefill_seconds",
            "Prefill time the cached tokens saved, under the TTFT model (cold minus warm TTFT).",
            labels=pod,
        )
        by_action: dict[tuple[str, str, str], int] = {}
        by_reason: dict[str, int] = {}
        by_pod: dict[tuple[str, int], list[float]] = {}
        by_tenant: dict[tuple[str, str], list[int]] = {}
        for (mode, action, label, slot), t in tallies.items():
            count = t.count
            k = (str(mode), action, label)
            by_action[k] = by_action.get(k, 0) + count
            if action.startswith("bypass_"):
                reason = action[7:]
                by_reason[reason] = by_reason.get(reason, 0) + count
            if slot >= 0:
                p = by_pod.setdefault((str(mode), slot), [0, 0, 0, 0.0])
                p[0] += count
                p[1] += t.prompt_tokens
                p[2] += t.cached_tokens
                p[3] += t.saved_ms
            if self.by_tenant:
                tt = by_tenant.setdefault((str(mode), label), [0, 0])
                tt[0] += t.prompt_tokens
                tt[1] += t.cached_tokens
        for (mode, action, label), count in sorted(by_action.items()):
            decisions.add_metric([mode, action, *([label] if self.by_tenant else [])], count)
        for reason, count in sorted(by_reason.items()):
            bypasses.add_metric([reason], count)
        for (mode, slot), (n, p_tok, c_tok, ms) in sorted(by_pod.items()):
            labels = [mode, *_pod_labels(pods, slot)]
            picks.add_metric(labels, n)
            prompt.add_metric(labels, p_tok)
            cached.add_metric(labels, c_tok)
            saved.add_metric(labels, ms / 1000)
        yield from (decisions, bypasses, picks, prompt, cached, saved)
        if self.by_tenant:
            t_prompt = CounterMetricFamily(
                "ace_tenant_estimated_prompt_tokens",
                "Prompt tokens of decided requests, by tenant (router estimate).",
                labels=["mode", "tenant"],
            )
            t_cached = CounterMetricFamily(
                "ace_tenant_estimated_cached_tokens",
                "Prompt tokens the router believed cached where it sent them, by tenant.",
                labels=["mode", "tenant"],
            )
            for (mode, label), (p_tok, c_tok) in sorted(by_tenant.items()):
                t_prompt.add_metric([mode, label], p_tok)
                t_cached.add_metric([mode, label], c_tok)
            yield from (t_prompt, t_cached)

    def _latency_families(self) -> Iterator[Metric]:
        steps = HistogramMetricFamily(
            "ace_decision_step_seconds",
            "Time of each step of a decision: parse the body, hash the prefix, pick the pod, "
            "rewrite the body.",
            labels=["step"],
        )
        for i, step in enumerate(STEPS):
            steps.add_metric([step], _cumulative(self._hist[i]), self._hist_sum[i] / 1e9)
        total = HistogramMetricFamily(
            "ace_decision_seconds", "Time of the whole body-phase decision, in process."
        )
        total.add_metric([], _cumulative(self._hist[_TOTAL]), self._hist_sum[_TOTAL] / 1e9)
        yield steps
        yield total

    def _fleet_families(self, fleet: FleetState) -> Iterator[Metric]:
        monitor = self.monitor
        pods = list(fleet.pods)
        available, members = fleet.available, fleet.members
        loads, capacities = list(fleet.load), list(fleet.capacity_tokens)
        # Health and drain masks where the fleet keeps them; else the monitor says.
        healthy: int | None = getattr(fleet, "healthy", None)
        if healthy is not None:  # ejected by passive health is down too
            healthy &= ~getattr(fleet, "ejected", 0)
        drained: int = getattr(fleet, "drained", 0)
        by_state = GaugeMetricFamily(
            "ace_pods",
            "Pods by state: removed (left the fleet), down (failed health checks, or its "
            "requests: passive health), drained "
            "(by an operator), available (taking new requests), unavailable (otherwise).",
            labels=["destination", "state"],
        )
        pl = ["destination", "pod"]
        up = GaugeMetricFamily("ace_pod_up", "1 if the pod takes new requests, else 0.", labels=pl)
        running = GaugeMetricFamily(
            "ace_pod_running_requests", "Requests the engine runs (last scrape).", labels=pl
        )
        waiting = GaugeMetricFamily(
            "ace_pod_waiting_requests", "Requests queued in the engine (last scrape).", labels=pl
        )
        inflight = GaugeMetricFamily(
            "ace_pod_inflight_requests",
            "Requests this replica believes in flight on the pod (scraped running + waiting, "
            "plus picks since).",
            labels=pl,
        )
        kv = GaugeMetricFamily(
            "ace_pod_kv_cache_usage_ratio", "Engine KV cache use, 0..1 (last scrape).", labels=pl
        )
        queued = GaugeMetricFamily(
            "ace_pod_queued_prefill_seconds",
            "Prefill sent to the pod and, by the router's estimate, not yet done: each "
            "request priced by the pod's TTFT model, drained in real time.",
            labels=pl,
        )
        underpriced = CounterMetricFamily(
            "ace_pod_underpriced_waits",
            "Scrapes that found requests waiting in the engine while the router's "
            "queued-prefill estimate for the pod was empty: the pod is slower than its "
            "TTFT model, or its prompts longer than the router counts them (a full batch, "
            "max_num_seqs, counts too). Calibrate the model or set prefill_tokens_per_s.",
            labels=pl,
        )
        pace = GaugeMetricFamily(
            "ace_pod_prefill_pace",
            "How many times its TTFT model's time the pod takes, learned from the TTFT it "
            "reports (router.learn_pace). Past 1.5x either way its queue drains, and its "
            "prefill and queue prices grow, by it; within, it is priced as modelled. 1: not "
            "learned (no TTFT histogram, learn_pace off).",
            labels=pl,
        )
        capacity = GaugeMetricFamily(
            "ace_pod_kv_capacity_tokens", "The engine's KV cache size in tokens.", labels=pl
        )
        lora_slots = GaugeMetricFamily(
            "ace_pod_lora_slots",
            "The pod's LoRA adapter slots (max_lora of vllm:lora_requests_info); only pods "
            "that run LoRA.",
            labels=pl,
        )
        adapters = GaugeMetricFamily(
            "ace_pod_lora_adapters",
            "LoRA adapters this replica believes the pod has loaded, and in use (the last "
            "scrape's running and waiting, plus picks since, less those Envoy reports "
            "answered).",
            labels=[*pl, "state"],
        )
        scrape_s = GaugeMetricFamily(
            "ace_pod_scrape_seconds",
            "How long the pod's last /metrics scrape took (a timed-out one: until it gave up).",
            labels=pl,
        )
        scrape_gap = GaugeMetricFamily(
            "ace_pod_scrape_interval_seconds",
            "Seconds from the pod's last scrape to its next: scrape_interval_s, or more "
            "where its scrapes are slow (scrape_max_engine_share).",
            labels=pl,
        )
        scrapes = CounterMetricFamily(
            "ace_pod_scrapes",
            "Scrapes of the pod's /metrics answered or timed out (not those that could "
            "not connect).",
            labels=pl,
        )
        e_prompt = CounterMetricFamily(
            "ace_engine_prompt_tokens",
            "Prompt tokens the engine processed (vllm:prompt_tokens_total, "
            "sglang:prompt_tokens_total), as last scraped.",
            labels=pl,
        )
        e_cached = CounterMetricFamily(
            "ace_engine_cached_prompt_tokens",
            "Prompt tokens the engine served from cache (vllm:prompt_tokens_cached_total, "
            "sglang:cached_tokens_total), as last scraped.",
            labels=pl,
        )
        e_queries = CounterMetricFamily(
            "ace_engine_prefix_cache_queried_tokens",
            "Tokens looked up in the engine's prefix cache (vllm:prefix_cache_queries_total).",
            labels=pl,
        )
        e_hits = CounterMetricFamily(
            "ace_engine_prefix_cache_hit_tokens",
            "Tokens found in the engine's prefix cache (vllm:prefix_cache_hits_total, "
            "sglang:cached_tokens_total).",
            labels=pl,
        )
        e_rate = GaugeMetricFamily(
            "ace_engine_prefix_cache_hit_ratio",
            "The engine's prefix cache hit rate (sglang:cache_hit_rate; vLLM: hits / queries "
            "since start).",
            labels=pl,
        )
        counts: dict[tuple[str, str], int] = {}
        # Every destination, with or without pods: one whose discovery has found none
        # yet reports available 0 (what an alert on it must see), not nothing.
        for dest in {d.id for d in fleet.fleet.destinations} | {p.destination for p in pods}:
            for state in POD_STATES:
                counts[dest, state] = 0
        for slot, pod in enumerate(pods):
            bit = 1 << slot
            if not members & bit:
                counts[pod.destination, "removed"] += 1
                continue
            labels = [pod.destination, pod.id]
            if (healthy is not None and not healthy & bit) or (
                monitor is not None and _is_down(monitor, slot)
            ):
                state = "down"
            elif drained & bit:
                state = "drained"
            elif available & bit:
                state = "available"
            else:
                state = "unavailable"
            counts[pod.destination, state] += 1
            up.add_metric(labels, 1.0 if state == "available" else 0.0)
            if slot < len(loads):
                load = loads[slot]
                running.add_metric(labels, load.running)
                waiting.add_metric(labels, load.waiting)
                inflight.add_metric(labels, load.inflight)
                kv.add_metric(labels, load.kv_usage)
                queued.add_metric(labels, load.queued_prefill_ms / 1000)
                underpriced.add_metric(labels, load.underpriced)
                pace.add_metric(labels, load.pace_learned)
                lora = load.lora
                if lora.max_lora:
                    lora_slots.add_metric(labels, lora.max_lora)
                    adapters.add_metric([*labels, "loaded"], len(lora.loaded))
                    adapters.add_metric([*labels, "in_use"], len(lora.in_use))
            if slot < len(capacities) and capacities[slot] is not None:
                capacity.add_metric(labels, float(capacities[slot] or 0))
            timing = _scrape_timing(monitor, slot) if monitor is not None else None
            if timing is not None:
                scrape_s.add_metric(labels, timing[0])
                scrape_gap.add_metric(labels, timing[1])
                scrapes.add_metric(labels, timing[2])
            stats = _stats(monitor, slot) if monitor is not None else None
            if stats is None:
                continue
            for family, value in (
                (e_prompt, stats.prompt_tokens),
                (e_cached, stats.cached_prompt_tokens),
                (e_queries, stats.cache_queries),
                (e_hits, stats.cache_hits),
                (e_rate, stats.hit_rate),
            ):
                if value is not None:
                    family.add_metric(labels, value)
        for (dest, state), n in sorted(counts.items()):
            by_state.add_metric([dest, state], n)
        families = (by_state, up, running, waiting, inflight, kv, queued, underpriced, pace)
        yield from (*families, capacity, scrape_s, scrape_gap, scrapes, lora_slots, adapters)
        yield from (e_prompt, e_cached, e_queries, e_hits, e_rate)

    def _index_families(self, index: BlockIndex) -> Iterator[Metric]:
        pods = list(self.fleet.pods) if self.fleet is not None else []
        members = self.fleet.members if self.fleet is not None else 0
        pl = ["destination", "pod"]
        held = GaugeMetricFamily(
            "ace_index_pod_entries", "Prefix blocks the index believes the pod holds.", labels=pl
        )
        bound = GaugeMetricFamily(
            "ace_index_pod_capacity_entries",
            "The index's bound for the pod, in blocks (from its KV size once scraped).",
            labels=pl,
        )
        total = 0
        for slot, pod in enumerate(pods):
            n = index.blocks_held(slot)
            total += n
            if (members >> slot) & 1:
                held.add_metric([pod.destination, pod.id], n)
                bound.add_metric([pod.destination, pod.id], index.capacity_of(slot))
        entries = GaugeMetricFamily(
            "ace_index_entries", "Entries in the prefix index (a block held by a pod)."
        )
        entries.add_metric([], _retry(lambda: len(index), total))
        size = GaugeMetricFamily(
            "ace_index_bytes", "Memory of the prefix index, estimated (not measured)."
        )
        size.add_metric([], _retry(lambda: _index_bytes(index), 0))
        yield from (entries, size, held, bound)

    def _sharing_families(self, stats: dict[str, int]) -> Iterator[Metric]:
        """Placements shared with the other replicas (``router.share_url``)."""
        for key, name, doc in (
            ("published", "ace_share_published_placements", "Placements sent to the others."),
            ("dropped", "ace_share_dropped_placements", "Placements not sent: Redis away."),
            ("learned", "ace_share_learned_placements", "The others' placements applied."),
            ("skipped", "ace_share_skipped_placements", "The others' placements on pods "
             "this replica does not route to."),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc)
            family.add_metric([], stats[key])
            yield family
        subscribed = GaugeMetricFamily(
            "ace_share_subscribed", "1 while subscribed to the replicas' channel, else 0."
        )
        subscribed.add_metric([], stats["subscribed"])
        yield subscribed

    def _response_families(self, ledger: Ledger) -> Iterator[Metric]:
        """Responses as Envoy's access log reported them, and the engines' own reuse (usage
        cached_tokens) next to the router's estimate for the same responses."""
        responses = CounterMetricFamily(
            "ace_responses", "Responses Envoy reported (its access log), by mode.", labels=["mode"]
        )
        failed = CounterMetricFamily(
            "ace_responses_failed",
            "Responses with a 5xx status (Envoy's own included), by mode.",
            labels=["mode"],
        )
        prompt = CounterMetricFamily(
            "ace_response_prompt_tokens",
            "Prompt tokens of responses whose usage the engine reported, by mode.",
            labels=["mode"],
        )
        cached = CounterMetricFamily(
            "ace_response_cached_tokens",
            "Engine-reported cached prompt tokens (usage.prompt_tokens_details."
            "cached_tokens), by mode: in shadow, what default routing reused.",
            labels=["mode"],
        )
        estimated = CounterMetricFamily(
            "ace_response_estimated_cached_tokens",
            "The router's estimate of cached tokens for the same responses, by mode, in "
            "the engine's tokens (its saved share of each prompt): in shadow, what its "
            "own pick would have reused.",
            labels=["mode"],
        )
        pod_cached = CounterMetricFamily(
            "ace_pod_response_cached_tokens",
            "Engine-reported cached prompt tokens by the pod that answered.",
            labels=["destination", "pod"],
        )
        pod_prompt = CounterMetricFamily(
            "ace_pod_response_prompt_tokens",
            "Prompt tokens with usage reported, by the pod that answered.",
            labels=["destination", "pod"],
        )
        for mode, t in ledger.by_mode.copy().items():
            responses.add_metric([mode], t.responses)
            failed.add_metric([mode], t.failed)
            prompt.add_metric([mode], t.prompt_tokens)
            cached.add_metric([mode], t.cached_tokens)
            estimated.add_metric([mode], t.estimated_saved_with_usage)
        for key, t in ledger.by_pod.copy().items():
            destination, _, pod = key.partition("/")
            pod_cached.add_metric([destination, pod], t.cached_tokens)
            pod_prompt.add_metric([destination, pod], t.prompt_tokens)
        hold = HistogramMetricFamily(
            "ace_gateway_hold_seconds",
            "Envoy's hold of each request it sent to a pod (its access log): the request's "
            "last byte received to its first byte sent upstream, which is the ext_proc's "
            "answer, the route and the connection: what routing added, by Envoy's clock.",
            labels=["mode"],
        )
        for mode, h in ledger.holds.copy().items():
            hold.add_metric([mode], _cumulative(h.counts), h.sum_ns / 1e9)
        yield from (responses, failed, prompt, cached, estimated, pod_cached, pod_prompt, hold)


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    out = []
    running = 0
    for le, n in zip(_LE, list(counts), strict=True):
        running += n
        out.append((le, float(running)))
    return out


def _pod_labels(pods: list[Pod], slot: int) -> list[str]:
    if 0 <= slot < len(pods):
        return [pods[slot].destination, pods[slot].id]
    return ["", f"slot-{slot}"]


def _is_down(monitor: FleetMonitor, slot: int) -> bool:
    try:
        return monitor.is_down(slot)
    except IndexError:  # a slot added since the monitor last followed the fleet
        return False


def _scrape_timing(monitor: FleetMonitor, slot: int) -> tuple[float, float, int] | None:
    try:
        return monitor.scrape_timing(slot)
    except IndexError:
        return None


def _stats(monitor: FleetMonitor, slot: int) -> Any:
    try:
        return monitor.stats(slot)
    except IndexError:
        return None


def _index_bytes(index: BlockIndex) -> int:
    approx = getattr(index, "approx_bytes", None)
    if callable(approx):
        return int(approx())
    return INDEX_BYTES_PER_ENTRY_ESTIMATE * len(index)


def _retry(read: Callable[[], int], default: int) -> int:
    """A figure read from another thread while the loop may resize a dict: try again."""
    for _ in range(3):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return default


# ------------------------------------------------------------------ serving


class MetricsServer:
    """A running exposition endpoint (``serve_metrics``)."""

    def __init__(self, host: str, port: int, server: WSGIServer, thread: threading.Thread):
        self.host = host
        self.port = port  # the bound port (the real one when asked for 0)
        self._server = server
        self._thread = thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and release the port; safe to call twice."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    listen: str,
    source: Telemetry | CollectorRegistry | None = None,
    probes: Probes | None = None,
) -> MetricsServer | None:
    """Serve Prometheus exposition of ``source`` (a ``Telemetry`` or any registry;
    default: prometheus-client's global one) at ``http://<listen>/metrics`` from a
    daemon thread, and with ``probes`` the kubelet's ``/healthz`` and ``/readyz``.
    ``listen``: ``host:port`` (port 0: a free one, see ``MetricsServer.port``) or
    ``"off"`` (returns None). Raises ConfigError on a bad address, OSError when the
    port cannot be bound."""
    if listen == "off":
        return None
    host, port = check_listen(listen, "metrics_listen", allow_off=True)
    registry: Collector
    if isinstance(source, Telemetry):
        registry = source.registry
    elif source is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    else:
        registry = source
    app = make_wsgi_app(_NameFilter(registry))
    if probes is not None:
        app = probes.wrap(app)

    class Server(ThreadingWSGIServer):
        """Its own class: the address family is set on it (IPv6 listens too)."""

    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    Server.address_family = family
    server = make_server(str(address[0]), port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="ace-metrics", daemon=True)
    thread.start()
    return MetricsServer(host, int(server.server_address[1]), server, thread)


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape or probe."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _NameFilter:
    """``registry`` answering Prometheus' ``/metrics?name[]=...`` filter. prometheus-
    client's own filter only finds names that collectors describe up front, and this
    collector's families come and go with the fleet, so it answered every such query
    with an empty page. A name matches a family (``ace_decision_seconds``: the whole
    histogram) or one of its series (``ace_decision_seconds_count``)."""

    def __init__(self, registry: Collector, names: frozenset[str] | None = None) -> None:
        self._registry = registry
        self._names = names

    def restricted_registry(self, names: Iterable[str]) -> _NameFilter:
        return _NameFilter(self._registry, frozenset(names))

    def collect(self) -> Iterator[Metric]:
        names = self._names
        for metric in self._registry.collect():
            if names is None or metric.name in names:
                yield metric
                continue
            samples = [s for s in metric.samples if s.name in names]
            if samples:
                kept = copy.copy(metric)
                kept.samples = samples
                yield kept


def worker_listen(listen: str, worker: int) -> str:
    """The metrics address of worker ``worker`` (0-based) of ``serve --workers N``:
    the port plus the worker's number, since each worker has its own tallies and a
    shared port would answer from a different worker at each scrape."""
    if listen == "off" or worker == 0:
        return listen
    host, port = check_listen(listen, "metrics_listen", allow_off=True)
    if port == 0:
        return listen
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port + worker}"


def iter_families(telemetry: Telemetry) -> Iterable[Metric]:
    """Every family ``telemetry.registry`` exposes (tests, the dashboard check)."""
    return telemetry.registry.collect()
