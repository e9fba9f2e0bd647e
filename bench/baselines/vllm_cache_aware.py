"""vLLM Router ``cache_aware`` (vllm-router 0.1.x), as described in
``/work/shared/reference/peers.md``.

The vLLM Router is a fork of the SGLang router and keeps its ``cache_aware`` decision
(same defaults: ``cache_threshold=0.3``, ``balance_abs_threshold=64``,
``balance_rel_threshold=1.5``), but matches on **tokens**: it renders or tokenizes every
request through the workers and matches token ids; its eviction interval is 120 s.

Approximation: in the simulation a token is ~4 bytes of canonical prompt (the router's
``bytes_per_token``), so this shares the SGLang implementation with 4-byte units: the
match rate is whole matched tokens (matched bytes // 4) over request tokens (bytes // 4),
and the tree size bound is counted in tokens (``max_tree_size`` tokens = 4x the bytes;
peers.md gives no size default for it, so SGLang's 2**26 is assumed). Real token
boundaries do not fall every 4 bytes, so a real tokenizer would match a little less
at a divergence; the routing decisions are otherwise the SGLang ones. Assumes the
workers answer ``/render`` or ``/tokenize`` (without them the real router silently
degrades to load-only routing, which ``least_loaded`` models).
"""

from __future__ import annotations

from bench.baselines.sglang_cache_aware import SGLangCacheAwarePicker


class VLLMCacheAwarePicker(SGLangCacheAwarePicker):
    unit_bytes = 4
