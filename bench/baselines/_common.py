"""Small helpers the baseline pickers share: candidate slots, least load, the ``Pick``."""

from __future__ import annotations

from ace_extproc.routing import FleetState, Pick

# The router's default prefix block (``Settings.block_bytes``): ``Pick.matched_blocks`` is
# counted in these, whatever unit a policy matches in, so the trace's saved tokens compare.
BLOCK_BYTES = 512


def slots_of(mask: int) -> list[int]:
    """The slots whose bits are set in ``mask``, lowest first."""
    out: list[int] = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def least_inflight(fleet: FleetState, slots: list[int]) -> int:
    """The slot with the fewest in-flight requests; ties go to the lowest slot (the first
    minimum, as Rust's ``min_by_key`` in the SGLang and vLLM routers)."""
    load = fleet.load
    return min(slots, key=lambda s: load[s].inflight)


def make_pick(fleet: FleetState, slot: int, matched_blocks: int = 0) -> Pick:
    """A ``Pick`` whose action follows the policy's own belief: "hit" when it believes at
    least one whole block is warm on the chosen pod."""
    return Pick(fleet.pods[slot], slot, matched_blocks, "hit" if matched_blocks > 0 else "miss")
