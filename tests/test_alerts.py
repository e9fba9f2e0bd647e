"""The shipped Prometheus alerting rules (dashboards/alerts.yaml): each expression parses
(a real PromQL parser, ``promql-parser``), reads only series and labels ace-extproc
exports, and each rule fires when what it names is real and stays quiet otherwise:
evaluated here, by a small evaluator of the PromQL they use (selectors, ``rate`` over
two scrapes a minute apart, ``sum by``, ``histogram_quantile``, comparisons and
arithmetic), on expositions of a real ``Telemetry``."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import promql_parser as promql
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ace_extproc import telemetry as tm
from ace_extproc.config import Destination, DiscoveryConfig, Settings, sim_fleet
from ace_extproc.config import Fleet as FleetConfig
from ace_extproc.observe import Ledger, Observation
from ace_extproc.routing import BlockIndex, FleetState
from tests.test_dashboard import exported_names, metric_names

RULES = Path(__file__).resolve().parent.parent / "dashboards" / "alerts.yaml"
CHART_RULES = RULES.parent.parent / "charts" / "ace-extproc" / "files" / "alerts.yaml"
SEVERITIES = {"critical", "warning", "info"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def rule(name: str) -> dict[str, Any]:
    (found,) = [r for r in rules() if r["alert"] == name]
    return found


def test_the_rules_are_well_formed_and_the_chart_ships_the_same() -> None:
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) >= 8
    for r in rules():
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in SEVERITIES
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert re.fullmatch(r"\d+[smh]", r["for"])
    assert CHART_RULES.read_text() == RULES.read_text()  # a link to the same file


@pytest.mark.parametrize("name", [r["alert"] for r in rules()])
def test_every_expression_parses_and_reads_what_is_exported(name: str) -> None:
    expr = rule(name)["expr"]
    tree = promql.parse(expr)  # raises on a syntax error
    samples, _ = exported_names()
    assert metric_names(expr) <= samples
    labels = exported_labels()
    for series, matchers in selectors(tree):
        used = {m.name for m in matchers}
        assert used <= labels[series] | TARGET_LABELS, (series, used)


def test_a_malformed_expression_is_caught() -> None:
    with pytest.raises(ValueError):
        promql.parse("sum by (instance) (rate(ace_decisions_total[5m])")


# ------------------------------------------------------------------ firing, on real state


def test_no_pod_available_fires_only_when_every_pod_is_out() -> None:
    fleet = Fleet()
    assert fired("AceNoPodAvailable", fleet.scrape()) == []
    fleet.state.set_available(0, False)  # down, as the health checks mark it
    assert fired("AceNoPodAvailable", fleet.scrape()) == []  # the other one still takes
    assert fired("AcePodsDown", fleet.scrape()) == [({"destination": "sim"}, 1.0)]
    fleet.state.drain(1)
    assert fired("AceNoPodAvailable", fleet.scrape()) == [({"destination": "sim"}, 0.0)]


def test_no_pod_available_fires_for_a_destination_discovery_found_nothing_for() -> None:
    """A destination whose pods are found at run time, and none were (a wrong service
    name, say): its requests have nowhere to go from the start."""
    sim = sim_fleet(["127.0.0.1:9001"])
    empty = Destination(
        "llama", "vllm", "http://llama:8000", (), discovery=DiscoveryConfig("dns", 8000)
    )
    fleet = Fleet(FleetConfig((*sim.destinations, empty)))
    assert fired("AceNoPodAvailable", fleet.scrape()) == [({"destination": "llama"}, 0.0)]


def test_a_full_kv_cache_fires_for_that_pod() -> None:
    fleet = Fleet()
    fleet.state.load[0].kv_usage = 0.96
    assert fired("AcePodKvCacheFull", fleet.scrape()) == []
    fleet.state.load[1].kv_usage = 0.99
    (labels, value), *more = fired("AcePodKvCacheFull", fleet.scrape())
    assert not more and labels["pod"] == fleet.state.pods[1].id and value == 0.99


def test_bypasses_fire_on_anomalies_not_on_other_paths() -> None:
    routine, anomalous = Fleet(), Fleet()
    actions = ((routine, "bypass_unknown_path"), (anomalous, "bypass_bad_json"))
    for fleet, action in actions:  # series exist before the window: rate needs two samples
        fleet.decide("hit", 1)
        fleet.decide(action, 1)
    before = routine.scrape(), anomalous.scrape()
    for fleet, action in actions:
        fleet.decide("hit", 90)
        fleet.decide(action, 10)
    assert fired("AceBypassesHigh", before[0], routine.scrape()) == []
    ((_, share),) = fired("AceBypassesHigh", before[1], anomalous.scrape())
    assert share == pytest.approx(0.1)


def test_a_pod_slower_than_its_model_fires_where_requests_keep_waiting() -> None:
    fleet = Fleet()
    before = fleet.scrape()
    fleet.state.load[0].underpriced += 30  # now and then: a full batch, a long prompt
    fleet.state.load[1].underpriced += 600  # most scrapes (10 a second) over the minute
    (labels, value), *more = fired("AcePodSlowerThanModel", before, fleet.scrape())
    assert not more and labels["pod"] == fleet.state.pods[1].id and value == 10.0


def test_a_pace_far_off_the_model_fires_for_that_pod_only() -> None:
    fleet = Fleet()
    fleet.state.load[0].pace_learned = 1.7  # somewhat slower: routing allows for it, quietly
    fleet.state.load[1].pace_learned = 3.2
    (labels, value), *more = fired("AcePodOffItsModel", fleet.scrape())
    assert not more and labels["pod"] == fleet.state.pods[1].id and value == 3.2


def test_reuse_below_the_estimate_fires_when_the_engines_disagree() -> None:
    agreeing, disagreeing = Fleet(), Fleet()
    for fleet in (agreeing, disagreeing):
        fleet.respond(estimated=1, cached=1)
    before = agreeing.scrape(), disagreeing.scrape()
    agreeing.respond(estimated=800, cached=700)
    disagreeing.respond(estimated=800, cached=100)
    assert fired("AceCacheReuseBelowEstimate", before[0], agreeing.scrape()) == []
    assert len(fired("AceCacheReuseBelowEstimate", before[1], disagreeing.scrape())) == 1


def test_failing_responses_fire_past_one_in_twenty() -> None:
    fleet = Fleet()
    fleet.answer(200, 1)
    fleet.answer(500, 1)
    before = fleet.scrape()
    fleet.answer(200, 97)
    fleet.answer(503, 3)
    assert fired("AceResponsesFailing", before, fleet.scrape()) == []  # 3%
    fleet.answer(502, 10)
    ((_, share),) = fired("AceResponsesFailing", before, fleet.scrape())
    assert share == pytest.approx(13 / 110)


def test_slow_decisions_fire_at_milliseconds_not_microseconds() -> None:
    fleet = Fleet()
    fleet.decide("hit", 1, latency_ns=50_000)
    before = fleet.scrape()
    fleet.decide("hit", 200, latency_ns=60_000)
    assert fired("AceDecisionSlow", before, fleet.scrape()) == []
    fleet.decide("hit", 100, latency_ns=4_000_000)  # a third of them at 4 ms
    ((_, p99),) = fired("AceDecisionSlow", before, fleet.scrape())
    assert 0.0025 < p99 <= 0.005  # within the 2.5-5 ms bucket


def test_a_slow_gateway_hold_fires_where_envoy_waits_tens_of_ms_for_the_answer() -> None:
    fleet = Fleet()
    fleet.hold("prod", 100, 2_000_000)
    fleet.hold("shadow", 50, 90_000_000)  # shadow's holds are not the alert's
    before = fleet.scrape()
    fleet.hold("prod", 200, 2_500_000)
    fleet.hold("shadow", 50, 90_000_000)
    assert fired("AceGatewayHoldSlow", before, fleet.scrape()) == []
    fleet.hold("prod", 100, 40_000_000)  # a third of them at 40 ms
    ((_, p99),) = fired("AceGatewayHoldSlow", before, fleet.scrape())
    assert 0.025 < p99 <= 0.05  # within the 25-50 ms bucket


def test_sharing_alerts_follow_the_subscription_and_the_outbox() -> None:
    fleet = Fleet()
    assert fired("AceSharingDisconnected", fleet.scrape()) == []  # no sharing: no series
    fleet.sharing = {"published": 5, "dropped": 0, "learned": 7, "skipped": 0, "subscribed": 1}
    before = fleet.scrape()
    assert fired("AceSharingDisconnected", before) == []
    fleet.sharing = {"published": 5, "dropped": 40, "learned": 7, "skipped": 0, "subscribed": 0}
    after = fleet.scrape()
    assert len(fired("AceSharingDisconnected", after)) == 1
    assert len(fired("AceSharingDropping", before, after)) == 1


# ------------------------------------------------------------------ the fleet and its scrapes

Sample = tuple[dict[str, str], float]
Scrape = tuple[float, dict[str, list[Sample]]]  # (seconds, series name -> samples)


class Fleet:
    """One ace-extproc's metrics over two pods: its real Telemetry, state set by hand."""

    def __init__(self, config: FleetConfig | None = None) -> None:
        self.state = FleetState(config or sim_fleet(["127.0.0.1:9001", "127.0.0.1:9002"]))
        index = BlockIndex(100)
        self.ledger = Ledger()
        self.telemetry = tm.Telemetry(Settings(), self.state, index, None, ledger=self.ledger)
        self.clock = 0.0

    @property
    def sharing(self) -> dict[str, int] | None:
        stats = self.telemetry.sharing
        return stats._stats if isinstance(stats, _Stats) else None

    @sharing.setter
    def sharing(self, stats: dict[str, int] | None) -> None:
        """This replica starts (or stops) sharing, with these figures."""
        self.telemetry.sharing = None if stats is None else _Stats(stats)

    def decide(self, action: str, count: int, latency_ns: int = 0) -> None:
        slot = 0 if action == "hit" else -1
        for _ in range(count):
            self.telemetry.decision("prod", action, "anon", slot, latency_ns=latency_ns)

    def respond(self, estimated: int, cached: int) -> None:
        seen = Observation(mode="prod", saved_tokens=estimated, status=200)
        usage = b'{"usage": {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": '
        seen.on_body(usage + str(cached).encode() + b"}}}")
        seen.read_usage()
        self.ledger.add(seen, self.state.pods[0].key)

    def hold(self, mode: str, count: int, ns: int) -> None:
        """``count`` responses of ``mode`` that Envoy held ``ns`` before sending them."""
        for _ in range(count):
            self.ledger.add(Observation(mode=mode, status=200, hold_ns=ns), self.state.pods[0].key)

    def answer(self, status: int, count: int) -> None:
        for _ in range(count):
            self.ledger.add(Observation(mode="prod", status=status), self.state.pods[0].key)

    def scrape(self) -> Scrape:
        self.clock += 60.0
        series: dict[str, list[Sample]] = defaultdict(list)
        text = generate_latest(self.telemetry.registry).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                series[s.name].append(({**s.labels, "instance": "gw-0"}, s.value))
        return self.clock, dict(series)


class _Stats:
    def __init__(self, stats: dict[str, int]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, int]:
        return dict(self._stats)


def exported_labels() -> dict[str, set[str]]:
    """Label names of each exported series, from an exposition with every family."""
    fleet = Fleet()
    fleet.sharing = {"published": 1, "dropped": 1, "learned": 1, "skipped": 1, "subscribed": 1}
    fleet.decide("hit", 1)
    fleet.decide("bypass_bad_json", 1)
    fleet.respond(estimated=10, cached=5)
    fleet.hold("prod", 1, 1_000_000)
    labels: dict[str, set[str]] = defaultdict(set)
    for name, samples in fleet.scrape()[1].items():
        for sample_labels, _ in samples:
            labels[name] |= set(sample_labels) - {"instance"}
    return labels


def selectors(tree: Any) -> list[tuple[str, list[Any]]]:
    found: list[tuple[str, list[Any]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            found.append((node.name, list(node.matchers.matchers)))
        elif isinstance(node, promql.MatrixSelector):
            visit(node.vector_selector)
        elif isinstance(node, promql.BinaryExpr):
            visit(node.lhs)
            visit(node.rhs)
        elif isinstance(node, promql.AggregateExpr):
            visit(node.expr)
        elif isinstance(node, promql.Call):
            for arg in node.args:
                visit(arg)
        elif isinstance(node, promql.ParenExpr):
            visit(node.expr)

    visit(tree)
    return found


# ------------------------------------------------------------------ a small PromQL evaluator

Vector = dict[frozenset[tuple[str, str]], float]


def fired(name: str, *scrapes: Scrape) -> list[Sample]:
    """What the rule's expression returns on these scrapes (the last is "now"): the
    alerts it would raise once its ``for`` has passed."""
    result = evaluate(promql.parse(rule(name)["expr"]), scrapes)
    out = [({k: v for k, v in key if k != "instance"}, value) for key, value in result.items()]
    return sorted(out, key=lambda s: sorted(s[0].items()))


def evaluate(node: Any, scrapes: tuple[Scrape, ...]) -> Vector | float:
    if isinstance(node, promql.NumberLiteral):
        return float(node.val)
    if isinstance(node, promql.ParenExpr):
        return evaluate(node.expr, scrapes)
    if isinstance(node, promql.VectorSelector):
        return _select(node, scrapes[-1][1])
    if isinstance(node, promql.Call) and node.func.name == "rate":
        (matrix,) = node.args
        if len(scrapes) < 2:
            return {}
        (t0, first), (t1, last) = scrapes[0], scrapes[-1]
        old = _select(matrix.vector_selector, first)
        new = _select(matrix.vector_selector, last)
        return {k: (v - old[k]) / (t1 - t0) for k, v in new.items() if k in old}
    if isinstance(node, promql.Call) and node.func.name == "histogram_quantile":
        q, buckets = (evaluate(arg, scrapes) for arg in node.args)
        assert isinstance(q, float) and isinstance(buckets, dict)
        return _histogram_quantile(q, buckets)
    if isinstance(node, promql.AggregateExpr) and str(node.op) == "sum":
        by = set(node.modifier.labels) if node.modifier is not None else set()
        inner = evaluate(node.expr, scrapes)
        assert isinstance(inner, dict)
        sums: dict[frozenset[tuple[str, str]], float] = defaultdict(float)
        for key, value in inner.items():
            sums[frozenset((k, v) for k, v in key if k in by)] += value
        return dict(sums)
    if isinstance(node, promql.BinaryExpr):
        return _binary(str(node.op), evaluate(node.lhs, scrapes), evaluate(node.rhs, scrapes))
    raise NotImplementedError(f"not evaluated here: {node}")


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    """As Prometheus computes it: per series (all labels but ``le``), the bucket that
    holds rank q x count, interpolated linearly within it; the highest finite bound if
    the rank falls in +Inf."""
    series: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = defaultdict(list)
    for key, count in buckets.items():
        labels = dict(key)
        le = float(labels.pop("le"))
        series[frozenset(labels.items())].append((le, count))
    out: Vector = {}
    for key, points in series.items():
        points.sort()
        total = points[-1][1]
        if not total:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for le, count in points:
            if count >= rank:
                if le == float("inf"):
                    out[key] = lower
                else:
                    out[key] = lower + (le - lower) * (rank - below) / (count - below)
                break
            lower, below = le, count
    return out


_COMPARE = {
    "==": float.__eq__,
    "!=": float.__ne__,
    ">": float.__gt__,
    ">=": float.__ge__,
    "<": float.__lt__,
    "<=": float.__le__,
}
_ARITHMETIC = {"*": float.__mul__, "/": float.__truediv__, "+": float.__add__}


def _binary(op: str, lhs: Vector | float, rhs: Vector | float) -> Vector | float:
    if isinstance(lhs, float) and isinstance(rhs, float):
        return _ARITHMETIC[op](lhs, rhs)
    if isinstance(lhs, float):  # a number and a vector: only arithmetic here
        assert isinstance(rhs, dict)
        return {k: _ARITHMETIC[op](lhs, v) for k, v in rhs.items()}
    if isinstance(rhs, float):
        if op in _COMPARE:  # a filter: the series for which it holds, as they are
            return {k: v for k, v in lhs.items() if _COMPARE[op](v, rhs)}
        return {k: _ARITHMETIC[op](v, rhs) for k, v in lhs.items()}
    # Two vectors: matched on all their labels.
    matched = {k: (v, rhs[k]) for k, v in lhs.items() if k in rhs}
    if op in _COMPARE:
        return {k: a for k, (a, b) in matched.items() if _COMPARE[op](a, b)}
    if op == "/":
        return {k: a / b for k, (a, b) in matched.items() if b}
    return {k: _ARITHMETIC[op](a, b) for k, (a, b) in matched.items()}


def _select(selector: Any, series: dict[str, list[Sample]]) -> Vector:
    out: Vector = {}
    for labels, value in series.get(selector.name, []):
        if all(_matches(m, labels.get(m.name, "")) for m in selector.matchers.matchers):
            out[frozenset(labels.items())] = value
    return out


def _matches(matcher: Any, value: str) -> bool:
    op = str(matcher.op)
    if op.endswith("Equal"):
        return (value == matcher.value) == (op == "MatchOp.Equal")
    anchored = re.fullmatch(matcher.value, value) is not None
    return anchored == (op == "MatchOp.Re")
