"""The other routers' policies, each a ``Policy`` the benchmark runs through the
production ``Processor`` (``app.build(config, POLICIES[name])``), exactly as the
ext_proc server calls ours. Each module's docstring says which published description it
follows (``/work/shared/reference/peers.md`` first) and where it approximates.

Every factory is ``(FleetState, BlockIndex) -> Policy``. Every pick reports
``matched_blocks`` as what *that policy* believes is warm on the chosen pod, in the
router's 512-byte blocks (0 for policies with no cache model), and ``action`` "hit" when
it believes at least one block is warm, else "miss".

Ours with other router settings is named ``ace@setting=value[@setting=value...]``
(``resolve``), e.g. ``ace@min_match=0.1@place_sessions=false``: the settings a fleet
would write under ``router:``, checked as ``fleet.yaml``'s are, and ``lora_busy_ms``,
the default pipeline with the ``lora`` scorer's ``busy_ms`` set
(``router.pipeline.scorers``).

Special simulation settings: ``bound_unbounded`` needs unbounded engine caches and
router index, ``bound_pooled`` one KV cache pooled across all pods
(``bounds.SIMULATION_SETTINGS``); every other entry runs under the normal settings.
"""

from __future__ import annotations

from collections.abc import Callable

import yaml

from ace_extproc.config import ConfigError, Settings, parse_settings
from ace_extproc.routing import (
    BlockIndex,
    FleetState,
    Policy,
    PrefixAffinityPicker,
    plugins,
    policies,
)
from ace_extproc.routing.lora import LoraCost
from ace_extproc.routing.pipeline import DEFAULT_SCORERS
from bench.baselines.bounds import SIMULATION_SETTINGS, bound_pooled, bound_unbounded
from bench.baselines.dynamo_cost import DynamoCostPicker
from bench.baselines.gie_lora import GIELoraPicker
from bench.baselines.gie_scorers import GIEScorerPicker
from bench.baselines.least_loaded import LeastLoadedPicker
from bench.baselines.random_pick import RandomPicker
from bench.baselines.round_robin import RoundRobinPicker
from bench.baselines.session_hash import SessionHashPicker
from bench.baselines.sglang_cache_aware import SGLangCacheAwarePicker
from bench.baselines.vllm_cache_aware import VLLMCacheAwarePicker

PolicyFactory = Callable[[FleetState, BlockIndex], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "round_robin": RoundRobinPicker,
    "random": RandomPicker,
    "least_loaded": LeastLoadedPicker,
    "session_hash": SessionHashPicker,
    "sglang_cache_aware": SGLangCacheAwarePicker,
    "vllm_cache_aware": VLLMCacheAwarePicker,
    "gie_scorers": GIEScorerPicker,
    "gie_lora": GIELoraPicker,  # its LoRA-affinity filter, then its scorers
    "dynamo_cost": DynamoCostPicker,
    # Ours as the server runs it by default (router.policy: cost), and the first
    # version (router.policy: affinity) to measure what load-aware pricing changes.
    "ace": policies.cost_policy(Settings()),
    "ace_balanced": policies.cost_balanced_policy(Settings()),
    "ace_any_match": policies.cost_policy(Settings(), min_match=0.0, place_sessions=False),
    "ace_by_prefix": policies.cost_policy(Settings(), place_sessions=False),
    # Ours with the lora scorer pricing a load but not the wait for a busy slot: what
    # that wait's price trades (cache share against the tail) on a many-adapter fleet.
    "ace_no_slot_wait": lambda fleet, index: resolve("ace@lora_busy_ms=0")(fleet, index),
    "ace_affinity": PrefixAffinityPicker,
    "bound_pooled": bound_pooled,
    "bound_unbounded": bound_unbounded,
}

# The router settings a policy spec may change: those that shape the pick. The others
# (block size, TTFT model, ...) are the simulation's own and would not reach it.
TUNABLE = (
    "policy",
    "min_match",
    "place_sessions",
    "affinity_slack",
    "affinity_slack_ms",
    "lora_busy_ms",
)
# Not a router setting: the default pipeline with the ``lora`` scorer's ``busy_ms`` (the
# price of waiting for a busy adapter slot), set in ``router.pipeline.scorers``.
_LORA_BUSY_MS = "lora_busy_ms"


def _with_lora_busy_ms(raw: dict[str, object]) -> dict[str, object]:
    """``raw`` with its ``lora_busy_ms`` written as the default scorers' pipeline."""
    busy_ms = raw.pop(_LORA_BUSY_MS, None)
    if busy_ms is None:
        return raw
    names = {factory: name for name, factory in plugins.SCORERS.items()}
    scorers: list[dict[str, object]] = []
    for weighted in DEFAULT_SCORERS:  # the production default, named as a fleet file would
        spec: dict[str, object] = {"name": names[type(weighted.scorer)]}
        if isinstance(weighted.scorer, LoraCost):
            spec["args"] = {"busy_ms": busy_ms}
        scorers.append(spec)
    return {**raw, "pipeline": {"scorers": scorers}}


def resolve(name: str) -> PolicyFactory:
    """The policy ``name``: an entry of ``POLICIES``, or ours with router settings
    changed, ``ace@setting=value[@setting=value...]`` (values read as YAML scalars, so
    ``false`` and ``0.1`` mean what they do in ``fleet.yaml``). Raises ``ValueError``
    (a ``ConfigError`` for a bad value) saying what is wrong."""
    factory = POLICIES.get(name)
    if factory is not None:
        return factory
    base, sep, rest = name.partition("@")
    if base != "ace" or not sep:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(POLICIES)}, "
            f"or ace@setting=value[@...] with a setting of {', '.join(TUNABLE)}"
        )
    raw: dict[str, object] = {"salt_secret": "bench"}  # not used here; skips generating one
    for item in rest.split("@"):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{name}: expected setting=value after @, not {item!r}")
        if key not in TUNABLE:
            raise ValueError(
                f"{name}: {key!r} is not a setting the pick reads; one of {', '.join(TUNABLE)}"
            )
        if key in raw:
            raise ValueError(f"{name}: {key} given twice")
        try:
            raw[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"{name}: {key}: cannot read {value!r}") from None
    try:
        return policies.build(parse_settings(_with_lora_busy_ms(raw), env={}))
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


__all__ = ["POLICIES", "SIMULATION_SETTINGS", "TUNABLE", "PolicyFactory", "resolve"]
