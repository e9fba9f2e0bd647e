"""SGLang Model Gateway ``cache_aware`` (sglang-router 0.3.x), as described in
``/work/shared/reference/peers.md`` and in sgl-router's ``policies/cache_aware.rs``.

Per request, with load = the router's own in-flight count per worker (``inflight``):
1. if ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > balance_rel_threshold * min_load``: the least loaded worker;
2. else if the best character match rate (matched characters / request characters)
   against its approximate radix tree is ``> cache_threshold``: the best-matching worker;
3. else the least loaded worker (peers.md; in the source: the least loaded worker of the
   model whose tree is smallest, which with one model is the least loaded worker).
Either way the request text is then inserted into the tree under the chosen worker: the
tree is built only from the router's own decisions, never from the engines' caches.
Defaults: ``cache_threshold=0.3``, ``balance_abs_threshold=64``,
``balance_rel_threshold=1.5``, ``max_tree_size=2**26`` characters per worker,
``eviction_interval_secs=60``.

Faithful, weakness included: ties in load go to the first worker (Rust ``min_by_key``),
so with sequential traffic (all loads 0) every new prefix lands on the first worker.

Approximations (see ``_text_tree.py``): the tree has 64-byte edges with an exact partial
match on the last edge, so the match rate is the character match rate for ASCII text
(bytes of the canonical prompt stand in for characters); eviction applies the size bound
on every insert instead of every 60 s. Ties between equally matching workers go to the
lowest slot (SGLang takes the first tenant of a node, in hash-map order). Loads and
matches are over the request's candidate pods (SGLang takes loads over all workers and
matches over all tenants, then keeps the match only if that worker is healthy). The tree
is scoped by tenant and model: SGLang keeps one tree per model and knows no tenants, but
every engine here salts its cache per tenant (for every policy), so text shared across
tenants is never warm across them and SGLang would believe in hits no engine can give.
"""

from __future__ import annotations

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import BLOCK_BYTES, least_inflight, make_pick, slots_of
from bench.baselines._text_tree import TextTree


class SGLangCacheAwarePicker:
    # Bytes of canonical prompt per matching unit: 1 = characters (SGLang); the vLLM
    # Router matches tokens (``vllm_cache_aware.py``).
    unit_bytes = 1

    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**26,
    ) -> None:
        self.fleet = fleet
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = TextTree(max_tree_size * self.unit_bytes)

    def match_rate(self, matched_bytes: int, text_bytes: int) -> float:
        units = text_bytes // self.unit_bytes
        return (matched_bytes // self.unit_bytes) / units if units else 0.0

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        slots = slots_of(candidates)
        loads = [self.fleet.load[s].inflight for s in slots]
        hi, lo = max(loads), min(loads)
        walk = self.tree.walk(request.prompt, request.hashes.seed)
        matched, holders = 0, 0
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            slot = least_inflight(self.fleet, slots)
        else:
            matched, holders = self.tree.match(walk, candidates)
            if holders and self.match_rate(matched, len(request.prompt)) > self.cache_threshold:
                slot = (holders & -holders).bit_length() - 1
            else:
                slot = least_inflight(self.fleet, slots)
        if not (holders >> slot) & 1:  # what it believes the chosen worker holds
            matched = self.tree.match(walk, 1 << slot)[0]
        self.tree.insert(walk, slot)
        return make_pick(self.fleet, slot, matched // BLOCK_BYTES)
