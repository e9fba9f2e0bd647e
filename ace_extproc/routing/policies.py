"""The policies a fleet can name in ``router.policy``.

- ``cost`` (default): the pipeline of ``pipeline.py`` as ``router.pipeline`` composes
  it (``plugins.py``); by default, pricing each pod by its estimated time to first
  token (uncached prefill + evictions + queued prefill).
- ``cost-balanced``: the same, but a new prefix goes to the least busy of the
  near-best pods rather than its rendezvous pod (for a single replica).
- ``affinity``: the first version, longest warm prefix else rendezvous, no load
  awareness (kept as a reference point for the benchmark).
- ``module:Class``: a policy of one's own (or a published router's algorithm, as in
  ``bench/baselines``), made as ``Class(fleet, index)`` for each router: a ``Policy``
  on the same path as the built-ins.
"""

from __future__ import annotations

from collections.abc import Callable

from ace_extproc.config import ConfigError, Settings, ttft_models
from ace_extproc.latency import get_model
from ace_extproc.routing import plugins
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.picker import Policy, PrefixAffinityPicker
from ace_extproc.routing.pipeline import Pipeline

PolicyFactory = Callable[[FleetState, BlockIndex], Policy]


def cost_policy(
    settings: Settings,
    *,
    balance_new: bool = False,
    min_match: float | None = None,
    place_sessions: bool | None = None,
) -> PolicyFactory:
    """The cost pipeline; ``min_match`` and ``place_sessions`` override the settings'.
    Its plug-ins are made once, here: a configuration error shows at start-up."""
    share = settings.min_match if min_match is None else min_match
    by_session = settings.place_sessions if place_sessions is None else place_sessions
    model = get_model(settings.ttft_model)
    filters = plugins.filters(settings)
    scorers = plugins.scorers(settings)
    picker = plugins.picker(settings, balance_new=balance_new)

    def build(fleet: FleetState, index: BlockIndex) -> Policy:
        return Pipeline(
            fleet,
            index,
            model,
            settings.block_bytes / settings.bytes_per_token,
            filters=filters,
            scorers=scorers,
            picker=picker,
            min_match=share,
            place_sessions=by_session,
            destination_models=ttft_models(fleet.fleet, settings),
            prefill_tokens_per_s=settings.prefill_tokens_per_s,
        )

    return build


def cost_balanced_policy(settings: Settings) -> PolicyFactory:
    return cost_policy(settings, balance_new=True)


def affinity_policy(settings: Settings) -> PolicyFactory:
    return PrefixAffinityPicker


POLICIES: dict[str, Callable[[Settings], PolicyFactory]] = {
    "cost": cost_policy,
    "cost-balanced": cost_balanced_policy,
    "affinity": affinity_policy,
}


def build(settings: Settings) -> PolicyFactory:
    policy = POLICIES.get(settings.policy)
    if policy is not None:
        return policy(settings)
    found = plugins.import_path(settings.policy, "router.policy")
    if found is None:
        known = ", ".join(POLICIES)
        raise ConfigError(
            f"router.policy: unknown policy {settings.policy!r}; known: {known}; or module:Class"
        )
    if not callable(found):
        raise ConfigError(f"router.policy: {settings.policy!r} is not a class or function")
    factory: PolicyFactory = found
    return factory
