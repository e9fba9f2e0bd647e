"""The pipeline's plug-ins by name, and the pipeline a configuration composes.

``router.pipeline`` names filters, scorers and a picker, each a built-in below or a
``module:attribute`` import path to a user's own class, made with the ``args`` given
(as the Gateway API Inference Extension's plug-in configuration does). A scorer also
takes a ``weight``. Unset, each part is the default cost pipeline's:

    pipeline:
      filters: [{name: not-saturated}]
      scorers: [{name: prefill}, {name: eviction}, {name: queue}, {name: lora}]
      picker: {name: near-best}

A user's plug-in runs on the same path as the built-ins: there is no other.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ace_extproc.config import ConfigError, Settings
from ace_extproc.fleet_file import PluginSpec
from ace_extproc.routing.lora import LoraCost
from ace_extproc.routing.pipeline import (
    DEFAULT_SCORERS,
    EvictionCost,
    NearBest,
    NotSaturated,
    PrefillCost,
    QueueCost,
    Weighted,
)

FILTERS: dict[str, Callable[..., Any]] = {"not-saturated": NotSaturated}
SCORERS: dict[str, Callable[..., Any]] = {
    "prefill": PrefillCost,
    "eviction": EvictionCost,
    "queue": QueueCost,
    "lora": LoraCost,  # args: load_ms, busy_ms
}
PICKERS: dict[str, Callable[..., Any]] = {"near-best": NearBest}


def make(spec: PluginSpec, known: Mapping[str, Callable[..., Any]], where: str) -> Any:
    """The plug-in ``spec`` names, made with its args; a ConfigError naming ``where``
    if it cannot be found or made."""
    factory = known.get(spec.name)
    if factory is None:
        factory = _imported(spec.name, known, where)
    try:
        plugin = factory(**spec.args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {spec.name} refused its args: {exc}") from None
    if not callable(plugin):
        raise ConfigError(f"{where}: {spec.name} did not make a callable plug-in")
    return plugin


def _imported(name: str, known: Mapping[str, Callable[..., Any]], where: str) -> Any:
    found = import_path(name, where)
    if found is None:
        names = ", ".join(known)
        raise ConfigError(f"{where}: unknown plug-in {name!r}; built in: {names}; or module:Class")
    return found


def import_path(name: str, where: str) -> Any:
    """What a ``module:attribute`` name names; None where ``name`` is not of that form,
    a ConfigError naming ``where`` where it cannot be imported."""
    module, sep, attribute = name.partition(":")
    if not sep or not module or not attribute:
        return None
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot import {name!r}: {exc}") from None


def filters(settings: Settings) -> tuple[Any, ...]:
    specs = settings.pipeline.filters
    if specs is None:
        return (NotSaturated(),)
    return tuple(make(s, FILTERS, f"router.pipeline.filters[{i}]") for i, s in enumerate(specs))


def scorers(settings: Settings) -> tuple[Weighted, ...]:
    specs = settings.pipeline.scorers
    if specs is None:
        return DEFAULT_SCORERS
    if not specs:
        raise ConfigError("router.pipeline.scorers: at least one scorer prices the pods")
    return tuple(
        Weighted(make(s, SCORERS, f"router.pipeline.scorers[{i}]"), s.weight)
        for i, s in enumerate(specs)
    )


def adapter_load_ms(settings: Settings) -> float | None:
    """The ``lora`` scorer's ``load_ms`` where the pipeline sets one: what the pods' pace
    is learned with too (``load.py``), so the one figure prices and predicts a load.
    None: each destination's TTFT model's."""
    found = (w.scorer for w in scorers(settings) if isinstance(w.scorer, LoraCost))
    return next((lora.load_ms for lora in found), None)


def picker(settings: Settings, *, balance_new: bool = False) -> Any:
    """The picker; the built-in one takes its slack from ``router.affinity_slack`` and
    ``affinity_slack_ms`` unless its args say otherwise."""
    spec = settings.pipeline.picker
    if spec is None or spec.name == "near-best":
        args: dict[str, Any] = {
            "slack_ratio": settings.affinity_slack,
            "slack_ms": settings.affinity_slack_ms,
            "balance_new": balance_new,
            **(spec.args if spec is not None else {}),
        }
        return make(PluginSpec(name="near-best", args=args), PICKERS, "router.pipeline.picker")
    return make(spec, PICKERS, "router.pipeline.picker")
