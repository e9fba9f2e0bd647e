"""The other routers' policies, each a ``Picker`` the benchmark runs through the
production ``Processor`` (``Processor(config, picker=POLICIES[name])``), exactly as the
ext_proc server calls ours. Each module's docstring says which published description it
follows (``/work/shared/reference/peers.md`` first) and where it approximates.

Every factory is ``(FleetState, BlockIndex) -> Picker``. Every pick reports
``matched_blocks`` as what *that policy* believes is warm on the chosen pod, in the
router's 512-byte blocks (0 for policies with no cache model), and ``action`` "hit" when
it believes at least one block is warm, else "miss".

Special simulation settings: ``bound_unbounded`` needs unbounded engine caches and
router index, ``bound_pooled`` one KV cache pooled across all pods
(``bounds.SIMULATION_SETTINGS``); every other entry runs under the normal settings.
"""

from __future__ import annotations

from collections.abc import Callable

from ace_extproc.config import Settings
from ace_extproc.routing import BlockIndex, FleetState, Picker, PrefixAffinityPicker, policies
from bench.baselines.bounds import SIMULATION_SETTINGS, bound_pooled, bound_unbounded
from bench.baselines.dynamo_cost import DynamoCostPicker
from bench.baselines.gie_scorers import GIEScorerPicker
from bench.baselines.least_loaded import LeastLoadedPicker
from bench.baselines.random_pick import RandomPicker
from bench.baselines.round_robin import RoundRobinPicker
from bench.baselines.session_hash import SessionHashPicker
from bench.baselines.sglang_cache_aware import SGLangCacheAwarePicker
from bench.baselines.vllm_cache_aware import VLLMCacheAwarePicker

PickerFactory = Callable[[FleetState, BlockIndex], Picker]

POLICIES: dict[str, PickerFactory] = {
    "round_robin": RoundRobinPicker,
    "random": RandomPicker,
    "least_loaded": LeastLoadedPicker,
    "session_hash": SessionHashPicker,
    "sglang_cache_aware": SGLangCacheAwarePicker,
    "vllm_cache_aware": VLLMCacheAwarePicker,
    "gie_scorers": GIEScorerPicker,
    "dynamo_cost": DynamoCostPicker,
    # Ours as the server runs it by default (router.policy: cost), and the first
    # version (router.policy: affinity) to measure what load-aware pricing changes.
    "ace": policies.cost_policy(Settings()),
    "ace_balanced": policies.cost_balanced_policy(Settings()),
    "ace_any_match": policies.cost_policy(Settings(), min_match=0.0, place_sessions=False),
    "ace_by_prefix": policies.cost_policy(Settings(), place_sessions=False),
    "ace_affinity": PrefixAffinityPicker,
    "bound_pooled": bound_pooled,
    "bound_unbounded": bound_unbounded,
}

__all__ = ["POLICIES", "SIMULATION_SETTINGS", "PickerFactory"]
