"""Gateway API Inference Extension (llm-d) endpoint picker, default scoring profile.

Follows ``/work/shared/reference/peers.md`` and the GIE sources in
kubernetes-sigs/gateway-api-inference-extension, ``pkg/epp/scheduling/framework/plugins``:
- ``scorer/queue.go`` (queue-scorer): over the candidates' waiting-queue sizes
  (``PodLoad.waiting``), ``(max - q) / (max - min)``, or 1 for all when they are equal;
- ``scorer/kvcache_utilization.go`` (kv-cache-utilization-scorer): ``1 - kv_usage``;
- ``prefixcachescorer/plugin.go`` and ``indexer.go`` (prefix-cache-scorer): the prompt
  cut into 64-character blocks, at most 256 (longer prompts are truncated, so two
  prompts that agree on their first 16,384 characters look the same; a prompt under one
  block scores 0 everywhere), hashed with xxhash64 chained as
  ``h_i = xxh64(block_i || h_{i-1})`` from a seed ``xxh64(model || cache_salt)``; for each
  hash in order, every pod that holds it gets one more matched block, stopping at the
  first hash no pod holds; score = matched / total blocks. Each pod's hashes live in an
  LRU of 31,250 entries, filled from the EPP's own picks only (``PreRequest`` adds the
  request's hashes to the chosen pod, in order, so a prompt's head is its oldest entry);
- weights queue 2, kv-cache 2, prefix 3, summed; ``picker/max_score_picker.go``: the
  highest total, ties broken at random (it shuffles before a stable sort; seeded here).

Approximations: the text is the canonical prompt's bytes (GIE hashes the completion
prompt, or the chat messages' JSON); the seed takes the tenant in place of the
``cache_salt`` (per tenant here); ``waiting`` and ``kv_usage`` are whatever the
simulation last scraped (GIE scrapes every 50 ms); the LRU capacity is GIE's default,
not auto-tuned from the engine's ``vllm:cache_config_info``.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import xxhash

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import BLOCK_BYTES, make_pick, slots_of

_xxh64 = xxhash.xxh64_intdigest


class GIEScorerPicker:
    def __init__(
        self,
        fleet: FleetState,
        index: BlockIndex,
        queue_weight: float = 2.0,
        kv_cache_weight: float = 2.0,
        prefix_weight: float = 3.0,
        block_chars: int = 64,
        max_prefix_blocks: int = 256,
        lru_capacity_per_server: int = 31_250,
        seed: int = 0,
    ) -> None:
        self.fleet = fleet
        self.weights = (queue_weight, kv_cache_weight, prefix_weight)
        self.block_chars = block_chars
        self.max_prefix_blocks = max_prefix_blocks
        self.capacity = lru_capacity_per_server
        self._holders: dict[int, int] = {}  # hash -> bitmask of pods (hashToPods)
        self._lru: dict[int, OrderedDict[int, None]] = {}  # slot -> hashes, oldest first
        self._rng = random.Random(seed)

    def prompt_hashes(self, request: RoutingRequest) -> list[int]:
        size = self.block_chars
        prompt = request.prompt[: size * self.max_prefix_blocks]
        if len(prompt) < size:
            return []  # too short for the prefix cache: every pod scores 0
        h = _xxh64(f"{request.model}{request.tenant}".encode())
        out: list[int] = []
        for i in range(0, len(prompt) - size + 1, size):
            h = _xxh64(prompt[i : i + size] + h.to_bytes(8, "little"))
            out.append(h)
        return out

    def matched(self, hashes: list[int]) -> dict[int, int]:
        """Each pod's count of the prompt's hashes, up to the first one no pod holds."""
        counts: dict[int, int] = {}
        for h in hashes:
            mask = self._holders.get(h, 0)
            if not mask:
                break
            for slot in slots_of(mask):
                counts[slot] = counts.get(slot, 0) + 1
        return counts

    def add(self, hashes: list[int], slot: int) -> None:
        lru = self._lru.setdefault(slot, OrderedDict())
        holders, bit = self._holders, 1 << slot
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            holders[h] = holders.get(h, 0) | bit
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                mask = holders[old] & ~bit
                if mask:
                    holders[old] = mask
                else:
                    del holders[old]

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        slots = slots_of(candidates)
        load = self.fleet.load
        hashes = self.prompt_hashes(request)
        counts = self.matched(hashes)
        waiting = [load[s].waiting for s in slots]
        q_hi, q_lo = max(waiting), min(waiting)
        wq, wkv, wp = self.weights
        scores = []
        for slot, q in zip(slots, waiting, strict=True):
            queue = 1.0 if q_hi == q_lo else (q_hi - q) / (q_hi - q_lo)
            prefix = counts.get(slot, 0) / len(hashes) if hashes else 0.0
            scores.append(wq * queue + wkv * (1.0 - load[slot].kv_usage) + wp * prefix)
        top = max(scores)
        slot = self._rng.choice([s for s, v in zip(slots, scores, strict=True) if v == top])
        self.add(hashes, slot)
        warm = counts.get(slot, 0) * self.block_chars
        return make_pick(self.fleet, slot, warm // BLOCK_BYTES)
