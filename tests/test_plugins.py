"""Filters, scorers and a picker composed through ``router.pipeline``: the same path
the built-ins run on, from a fleet.yaml as an operator writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from ace_extproc import config as config_mod
from ace_extproc.config import ConfigError
from ace_extproc.routing.pipeline import NearBest, Pipeline
from tests.conftest import make_app

PODS = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
HEADERS = {":path": "/v1/chat/completions", ":method": "POST"}


def fleet_file(tmp_path: Path, pipeline: dict[str, Any] | None) -> Path:
    router: dict[str, Any] = {"salt_secret": "s", "probe_interval_s": 0}
    if pipeline is not None:
        router["pipeline"] = pipeline
    doc = {
        "destinations": [
            {
                "id": "sim",
                "provider": "vllm",
                "base_url": "http://127.0.0.1:9000",
                "pods": [{"id": f"pod-{i}", "base_url": f"http://{a}"} for i, a in enumerate(PODS)],
            }
        ],
        "router": router,
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def route(path: Path, conversations: int = 12) -> list[str]:
    """Where each of ``conversations`` two-turn chats went, turn by turn."""
    processor = make_app(config_mod.load(path)).processor
    went = []
    for c in range(conversations):
        system = f"conversation {c}: " + "context " * 300
        for turn in ("first", "second"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": turn}]
            body = msgspec.json.encode({"model": "m", "messages": messages})
            outcome = processor.on_body(processor.on_headers(HEADERS, False), body)
            assert outcome.pod is not None, outcome.action
            went.append(outcome.pod.id)
    return went


def test_an_empty_pipeline_section_is_the_default(tmp_path: Path) -> None:
    default = route(fleet_file(tmp_path, None))
    assert len(set(default)) == 3  # new conversations spread over the pods
    assert route(fleet_file(tmp_path, {})) == default
    spelled_out = {
        "filters": [{"name": "not-saturated"}],
        "scorers": [{"name": "prefill"}, {"name": "eviction"}, {"name": "queue"}],
        "picker": {"name": "near-best"},
    }
    assert route(fleet_file(tmp_path, spelled_out)) == default


def test_a_custom_filter_from_configuration_decides(tmp_path: Path) -> None:
    only = {"name": "tests.plugin_examples:OnlyPods", "args": {"pods": ["pod-1", "pod-2"]}}
    went = route(fleet_file(tmp_path, {"filters": [{"name": "not-saturated"}, only]}))
    assert set(went) == {"pod-1", "pod-2"}


def test_a_custom_scorer_from_configuration_prices_pods(tmp_path: Path) -> None:
    default = route(fleet_file(tmp_path, None))
    penalty = {"name": "tests.plugin_examples:Penalty", "args": {"pods": ["pod-0"]}}
    scorers = [{"name": "prefill"}, {"name": "eviction"}, {"name": "queue"}, penalty]
    went = route(fleet_file(tmp_path, {"scorers": scorers}))
    assert "pod-0" in default and "pod-0" not in went
    # Weighted to nothing, it changes nothing.
    scorers[-1] = {**penalty, "weight": 0.0}
    assert route(fleet_file(tmp_path, {"scorers": scorers})) == default


def test_the_picker_takes_its_args(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"picker": {"name": "near-best", "args": {"fallbacks": 1}}})
    picker = make_app(config_mod.load(path)).picker
    assert isinstance(picker, Pipeline) and isinstance(picker.picker, NearBest)
    assert picker.picker.fallbacks == 1 and picker.picker.slack_ratio == 0.10


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        ({"filters": [{"name": "no-such"}]}, r"router.pipeline.filters\[0\]: unknown plug-in"),
        ({"scorers": [{"name": "nowhere.mod:X"}]}, r"scorers\[0\]: cannot import"),
        ({"scorers": [{"name": "tests.plugin_examples:Nope"}]}, r"scorers\[0\]: cannot import"),
        ({"scorers": []}, r"router.pipeline.scorers: at least one scorer"),
        ({"scorers": [{"name": "prefill", "args": {"x": 1}}]}, r"prefill refused its args"),
        ({"picker": {"name": "near-best", "args": {"slack": 1}}}, r"near-best refused its args"),
        ({"filters": [{"nme": "not-saturated"}]}, r"router.pipeline.*filters\[0\]"),
        ({"scorer": [{"name": "prefill"}]}, r"router.pipeline.*scorer"),
    ],
)
def test_a_bad_pipeline_is_refused_at_start_naming_where(
    tmp_path: Path, pipeline: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_app(config_mod.load(fleet_file(tmp_path, pipeline)))


def policy_file(tmp_path: Path, policy: str) -> Path:
    path = fleet_file(tmp_path, None)
    doc = yaml.safe_load(path.read_text())
    doc["router"]["policy"] = policy
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_policy_of_ones_own_routes_by_import_path(tmp_path: Path) -> None:
    """``router.policy: module:Class``: the whole policy is the user's (here GIE's
    LoRA-affinity filter and scorers, from the benchmark's baselines), made per router as
    ``Class(fleet, index)`` and called where the built-in one is."""
    from bench.baselines.gie_lora import GIELoraPicker

    path = policy_file(tmp_path, "bench.baselines.gie_lora:GIELoraPicker")
    assert isinstance(make_app(config_mod.load(path)).picker, GIELoraPicker)
    went = route(path)
    assert len(went) == 24 and set(went) <= {"pod-0", "pod-1", "pod-2"}


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("nope", r"router.policy: unknown policy 'nope'; known: cost.*or module:Class"),
        ("nowhere.mod:Policy", r"router.policy: cannot import"),
        ("tests.plugin_examples:Nope", r"router.policy: cannot import"),
        ("ace_extproc.routing.policies:POLICIES", r"is not a class or function"),
    ],
)
def test_a_bad_policy_is_refused_at_start(tmp_path: Path, policy: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_app(config_mod.load(policy_file(tmp_path, policy)))
