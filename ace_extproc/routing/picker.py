"""The routing policy's interface, and the first policy: prefix affinity.

A ``Policy`` is called once per request with a ``RoutingRequest`` (block hashes, the
canonical prompt, its size, tenant, model, session) and the bitmask of candidate
pods; it returns a ``Pick`` and records what the chosen pod will hold. Policies are
interchangeable behind it, so the benchmark runs each of them exactly as the server
calls them (``bench/baselines`` holds the other routers' policies). The default
policy is ``pipeline.Pipeline``, whose last plug-in is called its picker, as in the
Gateway API Inference Extension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ace_extproc.config import Pod
from ace_extproc.prefix import PrefixHashes
from ace_extproc.routing import rendezvous
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex


@dataclass(slots=True)
class RoutingRequest:
    hashes: PrefixHashes
    prompt: bytes  # the canonical prompt (for policies that match on text)
    prompt_tokens: int  # estimated from its size
    tenant: str
    model: str
    session: str | None = None  # x-session-id / x-user-id, for session-affinity policies
    # Precise routing (routing/precise_routing.py): the candidates whose KV events are
    # trusted (a bitmask), and the depth each of them holds, in the index's blocks.
    known: int = 0
    known_depths: dict[int, float] | None = None


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is ~4x slower
class Pick:
    pod: Pod
    slot: int
    matched_blocks: float  # leading blocks the router believes the pod holds warm
    action: str  # "hit": went to a warm pod; "miss": placed fresh; "spill": hot prefix moved on
    fallbacks: tuple[int, ...] = ()  # next-best slots, for Envoy's retries (endpoint mode)


class Policy(Protocol):
    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        """The pod for this request among ``candidates`` (a bitmask of slots), or None
        when there is no candidate."""
        ...


class PrefixAffinityPicker:
    """Longest warm prefix wins; a new prefix goes to its rendezvous pod.

    Ties between pods holding the same longest match also break by rendezvous
    order, so replicas agree on them too.
    """

    def __init__(self, fleet: FleetState, index: BlockIndex) -> None:
        self.fleet = fleet
        self.index = index
        for slot in range(len(fleet.pods)):
            index.add_pod(slot)

    def pick(self, request: RoutingRequest, candidates: int) -> Pick | None:
        if not candidates:
            return None
        hashes = request.hashes
        depth, holders = self.index.longest_match(hashes.blocks, candidates)
        if holders and not holders & (holders - 1):  # exactly one pod holds it: no tie
            slot = holders.bit_length() - 1
        else:
            slot = rendezvous.best(hashes.route_key, self.fleet.seeds, holders or candidates)
        self.index.record(slot, hashes.blocks)
        return Pick(self.fleet.pods[slot], slot, depth, "hit" if depth else "miss")
