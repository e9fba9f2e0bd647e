"""Session consistent hashing: all requests of one session to one pod.

Follows the vLLM Router's ``consistent_hash`` policy (``/work/shared/reference/peers.md``;
``src/policies/consistent_hash.rs`` and ``hash_key.rs`` in vllm-project/router): the key
is the ``x-session-id`` header, else ``x-user-id`` (the Processor puts either in
``RoutingRequest.session``), looked up on a hash ring with 160 virtual nodes per worker;
when the worker the ring names is not healthy, the request goes to the first healthy
worker (here: the lowest candidate slot), not to the next one on the ring.

Approximations:
- the ring hashes with xxh3-64, not FurcHash/MurmurHash64A: any good 64-bit hash gives
  the same spread and the same ~1/N movement when a pod joins or leaves;
- with no session the key is the prompt's first 512-byte block (``hashes.route_key``),
  so a shared document or system prompt still lands on one pod. The vLLM Router itself
  falls back to body fields (``user``, ``session_id``) and then to a hash of the *whole*
  request text, which changes every turn; ``fallback_whole_prompt=True`` does that.
No cache belief: every pick is a "miss" with ``matched_blocks=0``.
"""

from __future__ import annotations

import bisect

import xxhash

from ace_extproc.routing import BlockIndex, FleetState, Pick, RoutingRequest
from bench.baselines._common import make_pick

VIRTUAL_NODES = 160  # VIRTUAL_NODES_PER_WORKER in the vLLM Router

_xxh3 = xxhash.xxh3_64_intdigest


class SessionHashPicker:
    def __init__(
        self, fleet: FleetState, index: BlockIndex, fallback_whole_prompt: bool = False
    ) -> None:
        self.fleet = fleet
        self.fallback_whole_prompt = fallback_whole_prompt
        ring = sorted(
            (_xxh3(f"{pod.key}:{i}".encode()), slot)
            for slot, pod in enumerate(fleet.pods)
            for i in range(VIRTUAL_NODES)
        )
        self._points = [h for h, _ in ring]
        self._owners = [slot for _, slot in ring]

    def key(self, request: RoutingRequest) -> int:
        if request.session:
            return _xxh3(b"session:" + request.session.encode())
        if self.fallback_whole_prompt:
            return _xxh3(request.prompt)
        return _xxh3(request.hashes.route_key.to_bytes(8, "little"))

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        i = bisect.bisect_left(self._points, self.key(request))
        slot = self._owners[i % len(self._owners)]  # past the last point: wrap to the first
        if not (candidates >> slot) & 1:
            slot = (candidates & -candidates).bit_length() - 1  # first healthy worker
        return make_pick(self.fleet, slot)
