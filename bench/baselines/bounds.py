"""The two bounds the benchmark brackets every policy with. Each is an ordinary picker;
what makes it a bound is the simulation setting it must run under.

- ``bound_unbounded``: our ``PrefixAffinityPicker`` (imported, not copied) run with
  **unbounded** engine caches and router index: nothing is ever evicted, so only a
  prefix's first prefill misses (affinity always finds where it is warm). The ceiling
  on cache reuse; the gap to ``ace`` is what eviction costs.
- ``bound_pooled``: least in-flight placement (``LeastLoadedPicker``) run with **one KV
  cache pooled** across all pods: any pod reuses any prefix any pod computed, so
  placement only has to balance load. The ceiling on reuse and balance together.

Without those settings they are just ``ace`` and ``least_loaded``.
"""

from __future__ import annotations

from ace_extproc.routing import PrefixAffinityPicker
from bench.baselines.least_loaded import LeastLoadedPicker

bound_unbounded = PrefixAffinityPicker
bound_pooled = LeastLoadedPicker

# What each bound needs from the fleet simulation (names are descriptive, for its config).
SIMULATION_SETTINGS: dict[str, str] = {
    "bound_unbounded": "unbounded engine KV caches and router index (no eviction)",
    "bound_pooled": "one KV cache pooled across all pods (any pod reuses any prefix)",
}
