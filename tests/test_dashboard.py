"""The shipped Grafana dashboard (dashboards/ace-extproc.json): well formed, on the
``${datasource}`` variable, every query names only metrics ace-extproc exports (read
from a real exposition of the collector), and every ace_ metric has a panel."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ace_extproc import telemetry as tm
from ace_extproc.config import Settings, TenantConfig, sim_fleet
from ace_extproc.observe import Ledger, Observation
from ace_extproc.routing import BlockIndex, FleetState
from ace_extproc.routing.metrics_text import parse
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.stalls import LoopWatchdog

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "ace-extproc.json"

# PromQL words that are not metric names.
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
)
# Clauses whose parenthesised list holds label names, not series.
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = _LABEL_LISTS.sub("", expr)
    names = set()
    for m in _IDENT.finditer(expr):
        rest = expr[m.end() :].lstrip()
        word = m.group()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if re.fullmatch(r"\d", expr[m.start() - 1 : m.start()] or "x"):
            continue  # part of a number such as 1e-6
        names.add(word)
    return names


class _Sharing:
    """A replica sharing placements (routing/replicas.ReplicaSync), as the metrics see it."""

    def stats(self) -> dict[str, int]:
        return {"published": 3, "dropped": 0, "learned": 6, "skipped": 1, "subscribed": 1}


def exported_names() -> tuple[set[str], set[str]]:
    """(sample names, family names) of a real exposition with every family populated:
    tenant labels on, a scraped pod (running a LoRA adapter), an index entry, decisions
    of every kind."""
    tenants = TenantConfig(key_digests={b"a" * 32: "acme"})
    settings = Settings(metrics_tenant_label=True, tenants=tenants)
    fleet = FleetState(sim_fleet(["127.0.0.1:9001", "127.0.0.1:9002"]))
    index = BlockIndex(100)
    index.add_pod(0)
    index.record(0, [1, 2])
    monitor = FleetMonitor(fleet, index, settings)
    monitor.apply(
        0,
        parse(
            "vllm:num_requests_running 1\nvllm:prefix_cache_queries_total 10\n"
            "vllm:prefix_cache_hits_total 5\nvllm:prompt_tokens_total 10\n"
            "vllm:prompt_tokens_cached_total 5\n"
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="8"} 1\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a"} 1.7e9\n'
        ),
    )
    monitor.answered(0, 0.0, 0.005, 0.005)  # a scrape that took 5 ms
    ledger = Ledger()
    # With the process collectors.
    t = tm.Telemetry(settings, fleet, index, monitor, ledger=ledger, sharing=_Sharing())
    t.registry.register(LoopWatchdog())  # as serve() registers it
    t.decision("prod", "hit", "acme", 0, 100, 50, 2.0, 30_000)
    t.decision("prod", "bypass_bad_json", "acme")
    t.steps_ns(1, 2, 3, 4)
    seen = Observation(mode="shadow", saved_tokens=40, status=200, hold_ns=1_500_000)
    seen.on_body(
        b'{"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 60}}}'
    )
    seen.read_usage()
    ledger.add(seen, fleet.pods[0].key)
    samples: set[str] = set()
    families: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(t.registry).decode()):
        families.add(family.name)
        samples.update(s.name for s in family.samples)
    return samples, families


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold theirs
    return out


def _exprs(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (p["title"], t["expr"]) for p in _panels(doc) for t in p.get("targets", []) if "expr" in t
    ]


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, step) "
        '(rate(ace_decision_step_seconds_bucket{job=~"$job", mode="prod"}[$__rate_interval])))'
        " / on (pod) group_left ace_pods unless foo_total offset 5m > 1e-6"
    )
    assert metric_names(expr) == {"ace_decision_step_seconds_bucket", "ace_pods", "foo_total"}


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "ace-extproc" and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"


def test_every_query_reads_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    samples, _ = exported_names()
    for title, expr in _exprs(dashboard):
        assert expr.count("(") == expr.count(")"), title
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - samples
        assert not unknown, f"{title}: {sorted(unknown)} not exported"


def test_every_ace_metric_has_a_panel(dashboard: dict[str, Any]) -> None:
    samples, families = exported_names()
    used = set().union(*(metric_names(e) for _, e in _exprs(dashboard)))
    for family in sorted(f for f in families if f.startswith("ace_")):
        family_samples = {s for s in samples if s == family or s.startswith(family + "_")}
        assert used & family_samples, f"no panel shows {family}"


def test_the_issue_s_panels_are_there(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(e for _, e in _exprs(dashboard))
    for needle in (
        "sum by (action) (rate(ace_decisions_total",
        "sum by (mode) (rate(ace_decisions_total",
        "histogram_quantile(0.5, sum by (le, step) (rate(ace_decision_step_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, step) (rate(ace_decision_step_seconds_bucket",
        "sum by (reason) (rate(ace_bypasses_total",
        "max by (state) (ace_pods",
        "ace_engine_cached_prompt_tokens_total",
        "ace_estimated_cached_tokens_total",
        "ace_estimated_saved_prefill_seconds_total",
        "ace_index_entries",
        "ace_index_bytes",
    ):
        assert needle in exprs, needle
