"""What each event-publishing pod's engine holds, from its own KV events; and what this
router has just sent there, speculatively, until the events confirm it.

The approximate index (``index.py``) records where requests were sent and ages them
out as a model of the engine's LRU: a guess. Engines that publish KV events say what
they stored and evicted, so for those pods the router knows. Blocks are named by the
router's own keys (``tokens.block_keys``: chained hashes of token ids from a seed of
the salt), computed the same way from a request's tokens and from an event's token
ids; each pod's map from the engine's block hashes to those keys resolves a stored
block's parent and a removal.

* **Speculative, then confirmed.** A pick is recorded at once (``speculate``), so the
  next turn a few milliseconds later finds it; a ``BlockStored`` confirms it, and an
  entry never confirmed within ``confirm_s`` expires.
* **Tiers.** A block offloaded to CPU or storage is held, but reading it back costs
  more than a GPU hit: ``match`` reports the two depths apart for pricing.
* **Tenants.** The seed holds the salt the engine hashed into block 0, and requests
  are keyed from the salt ace-extproc gives their tenant, so blocks stored under any
  other salt (or none) never match a request.
* **Evicted while queued.** A pick that adds blocks to a full pod pushes its least
  recently used ones out of ``recent``. The engine evicts them only when it admits that
  pick, behind the queue there, and says so only then; a request sent meanwhile as a
  hit on them would find them gone. So a block pushed out by a pick the engine has not
  yet stored counts as evicted (``doomed``, with the pick's last new block as its
  witness); once the witness is stored, the removals sent before it have said what the
  engine really evicted.
* **Trust.** A pod's view is used only while ``live``: its stream connected with no
  unrecovered gap. Otherwise the pod is routed by the approximate index, which keeps
  recording every pick for exactly that.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ace_extproc.routing.kv_wire import BlockHash, Cleared, Event, Removed, Stored
from ace_extproc.tokens import block_keys, chain_seed

GPU = 1  # tier bits of a held block
OFFLOADED = 2  # CPU or storage: held, but read back before use


@dataclass(slots=True)
class PodView:
    """One pod's engine, as its events tell it."""

    blocks: dict[BlockHash, list[int]] = field(default_factory=dict)  # hash -> [key, tiers]
    # Keys on GPU or just sent there, least recently used first, at most ``capacity``:
    # when the map from the engine's hashes must shrink, these are kept.
    recent: OrderedDict[int, None] = field(default_factory=OrderedDict)
    block_size: int = 0  # from its events; 0 until the first store
    expected_block_size: int = 0  # from its cache_config_info; 0: not known
    live: bool = False  # connected, no unrecovered gap: its view is trusted
    uncertain_until: float = 0.0  # after a gap it could not replay: not trusted before
    stored: int = 0  # blocks stored, ever (events applied)
    removed: int = 0
    orphans: int = 0  # stored blocks whose parent it never saw: not keyable
    mismatched: bool = False  # its events' block size is not its engine's
    capacity: int = 0  # the engine's KV blocks, where known: the view holds no more
    # Blocks pushed out of ``recent`` by a pick still queued there -> that pick's
    # witness key: counted evicted while the witness is speculative on this pod.
    doomed: dict[int, int] = field(default_factory=dict)


class PreciseIndex:
    def __init__(
        self, confirm_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.confirm_s = confirm_s
        self.clock = clock  # speculation's deadlines (the fleet simulation's own clock)
        self.pods: dict[int, PodView] = {}
        self._warm: dict[int, int] = {}  # key -> bitmask of pods holding it on GPU
        self._offloaded: dict[int, int] = {}  # key -> bitmask of pods holding it offloaded
        self._speculative: dict[int, int] = {}  # key -> bitmask of pods picked for it
        self._deadlines: dict[tuple[int, int], float] = {}  # (slot, key) -> expiry
        self._expiry: deque[tuple[float, int, int]] = deque()  # in deadline order
        self.live_mask = 0  # pods whose view is trusted
        self.confirmed = 0  # speculative entries a store confirmed
        self.expired = 0  # speculative entries never confirmed
        self.doomed_blocks = 0  # blocks a match lost to a pick still queued there

    # -- pods ----------------------------------------------------------------------
    def add_pod(self, slot: int) -> PodView:
        view = self.pods.get(slot)
        if view is None:
            view = self.pods[slot] = PodView()
        return view

    def drop_pod(self, slot: int) -> None:
        """Forget the pod (it left, or its slot goes to another)."""
        self.clear(slot)
        self.pods.pop(slot, None)
        self.set_live(slot, False)

    def set_live(self, slot: int, live: bool) -> None:
        view = self.pods.get(slot)
        live = live and view is not None and not view.mismatched
        self.live_mask = self.live_mask | (1 << slot) if live else self.live_mask & ~(1 << slot)
        if view is not None:
            view.live = live

    def set_engine_cache(self, slot: int, block_size: int, tokens: int | None) -> None:
        """The engine's block size and KV size (``cache_config_info``). Events that
        disagree on the block size make the pod's view untrusted (a request's keys are
        cut by it); the KV size bounds the view, so blocks whose removal was lost
        age out as the cache turns over."""
        view = self.add_pod(slot)
        view.expected_block_size = block_size
        if tokens:
            view.capacity = max(1, tokens // block_size)
        self._check_block_size(slot, view)

    def clear(self, slot: int) -> None:
        """The engine holds nothing (``AllBlocksCleared``, a restart)."""
        view = self.pods.get(slot)
        if view is None:
            return
        keep = ~(1 << slot)
        for _, (key, _tiers) in view.blocks.items():
            _unset(self._warm, key, keep)
            _unset(self._offloaded, key, keep)
        view.blocks.clear()
        view.recent.clear()
        view.doomed.clear()
        for key in [k for k, mask in self._speculative.items() if mask & ~keep]:
            _unset(self._speculative, key, keep)
            self._deadlines.pop((slot, key), None)

    # -- events --------------------------------------------------------------------
    def apply(self, slot: int, events: Iterable[Event]) -> None:
        view = self.pods.get(slot)
        if view is None:
            return  # a pod that left: its late events change nothing
        for event in events:
            if isinstance(event, Stored):
                self._stored(slot, view, event)
            elif isinstance(event, Removed):
                self._removed(slot, view, event)
            elif isinstance(event, Cleared):
                self.clear(slot)

    def _stored(self, slot: int, view: PodView, event: Stored) -> None:
        if 0 < event.block_size < view.block_size and len(event.hashes) == 1:
            return  # SGLang's partial last page: no whole block of ours
        if view.block_size != event.block_size:
            view.block_size = event.block_size
            self._check_block_size(slot, view)
        if event.parent is None:
            parent = chain_seed(event.salt, event.lora)
        else:
            entry = view.blocks.get(event.parent)
            if entry is None:
                view.orphans += len(event.hashes)
                return
            parent = entry[0]
        keys = block_keys(event.token_ids, event.block_size, parent, limit=event.keyable)
        tier = GPU if event.medium == "GPU" else OFFLOADED
        bit = 1 << slot
        blocks = view.blocks
        held = self._warm if tier == GPU else self._offloaded
        for engine_hash, key in zip(event.hashes, keys, strict=False):
            entry = blocks.get(engine_hash)
            if entry is None:
                blocks[engine_hash] = [key, tier]
            else:
                entry[0], entry[1] = key, entry[1] | tier
            held[key] = held.get(key, 0) | bit
            if tier == GPU and self._speculative.get(key, 0) & bit:
                _unset(self._speculative, key, ~bit)
                self._deadlines.pop((slot, key), None)
                self.confirmed += 1
        if tier == GPU:
            self._touch(slot, view, keys)
        view.stored += len(keys)
        view.orphans += len(event.hashes) - len(keys)
        if view.capacity and len(blocks) > 2 * view.capacity:
            self._trim(slot, view)

    def _removed(self, slot: int, view: PodView, event: Removed) -> None:
        tier = GPU if event.medium == "GPU" else OFFLOADED
        held = self._warm if tier == GPU else self._offloaded
        keep = ~(1 << slot)
        blocks = view.blocks
        for engine_hash in event.hashes:
            entry = blocks.get(engine_hash)
            if entry is None:
                continue
            _unset(held, entry[0], keep)
            if tier == GPU and not self._speculative.get(entry[0], 0) & ~keep:
                view.recent.pop(entry[0], None)
            entry[1] &= ~tier
            if not entry[1]:
                del blocks[engine_hash]
            view.removed += 1

    def _touch(
        self, slot: int, view: PodView, keys: Sequence[int], witness: int | None = None
    ) -> None:
        """Make a chain's blocks the most recently used, its head last (an engine frees
        a request's blocks tail first), keeping at most the engine's capacity.

        What falls out is not taken as evicted for good. A router that predicted the
        engine's evictions from what it sent stopped matching blocks the engine still
        held: a replica sees only its own requests, and a hit through another refreshes
        blocks without an event (bench/RESULTS.md, "Precise routing"). Only a removal
        removes. But what a pick pushes out (``witness``: the pick's last new block) is
        doomed until the engine has stored that pick: the engine evicts it then, behind
        the queue, before its removal can say so."""
        recent, doomed = view.recent, view.doomed
        if doomed:
            for key in keys:
                doomed.pop(key, None)  # used again: held again once this is admitted
        for key in reversed(keys):
            if key in recent:
                recent.move_to_end(key)
            else:
                recent[key] = None
        if view.capacity and len(recent) > view.capacity:
            bit, warm = 1 << slot, self._warm
            for _ in range(len(recent) - view.capacity):
                key, _ = recent.popitem(last=False)
                if witness is not None and warm.get(key, 0) & bit:
                    doomed[key] = witness
            if len(doomed) > view.capacity:
                self._forget_doomed(slot, view)

    def _forget_doomed(self, slot: int, view: PodView) -> None:
        """Bound ``doomed``: drop the blocks whose witness was stored (or expired), then,
        if still too many, the oldest doomed."""
        bit, speculative = 1 << slot, self._speculative
        kept = {k: w for k, w in view.doomed.items() if speculative.get(w, 0) & bit}
        if len(kept) > view.capacity:
            kept = dict(itertools.islice(kept.items(), len(kept) - view.capacity, None))
        view.doomed = kept

    def _trim(self, slot: int, view: PodView) -> None:
        """Bound the map from the engine's hashes: its oldest-stored entries go, their
        blocks forgotten unless recently used (a lost removal is not kept forever)."""
        blocks, keep, recent = view.blocks, ~(1 << slot), view.recent
        for engine_hash in list(itertools.islice(blocks, len(blocks) - view.capacity)):
            key, _tiers = blocks.pop(engine_hash)
            if key not in recent:
                _unset(self._warm, key, keep)
                _unset(self._offloaded, key, keep)

    def _check_block_size(self, slot: int, view: PodView) -> None:
        expected, seen = view.expected_block_size, view.block_size
        view.mismatched = bool(expected and seen and expected != seen)
        if view.mismatched:
            self.set_live(slot, False)

    # -- the request path ----------------------------------------------------------
    def speculate(self, slot: int, keys: Sequence[int]) -> None:
        """The router sent these blocks to ``slot``: held until the events confirm
        them, or ``confirm_s`` passes without."""
        bit = 1 << slot
        warm, speculative, deadlines = self._warm, self._speculative, self._deadlines
        deadline = self.clock() + self.confirm_s
        view = self.pods.get(slot)
        if view is None:
            return
        # Its last new block: stored when the engine has admitted it (and evicted for it).
        witness = next((key for key in reversed(keys) if not warm.get(key, 0) & bit), None)
        self._touch(slot, view, keys, witness)  # the engine will use them: recently used
        for key in keys:
            if warm.get(key, 0) & bit:
                continue
            held = speculative.get(key, 0)
            if held & bit:  # already waiting: a later deadline (``expire`` requeues it)
                deadlines[(slot, key)] = deadline
                continue
            speculative[key] = held | bit
            deadlines[(slot, key)] = deadline
            self._expiry.append((deadline, slot, key))

    def expire(self) -> None:
        """Drop speculative entries past their deadline (a pick the engine never
        stored: it failed, or evicted before its events said so)."""
        now, expiry, deadlines = self.clock(), self._expiry, self._deadlines
        while expiry and expiry[0][0] <= now:
            _, slot, key = expiry.popleft()
            deadline = deadlines.get((slot, key))
            if deadline is not None and deadline > now:
                # Sent again since: one entry a pending block, requeued at its new
                # deadline. Behind later deadlines it may expire late (by less than
                # confirm_s), never early.
                expiry.append((deadline, slot, key))
            elif deadline is not None:
                del deadlines[(slot, key)]
                _unset(self._speculative, key, ~(1 << slot))
                self.expired += 1
                view = self.pods.get(slot)
                if view is not None and not self._warm.get(key, 0) & (1 << slot):
                    view.recent.pop(key, None)

    def match(self, keys: Sequence[int], candidates: int) -> dict[int, tuple[int, int]]:
        """For each live candidate holding the first block: ``(warm, held)``, the
        leading blocks it holds on GPU (or was just sent), and on any tier; a doomed
        block ends both, as an evicted one would, unless it is offloaded."""
        candidates &= self.live_mask
        if not candidates or not keys:
            return {}
        self.expire()
        warm_get, off_get, spec_get = self._warm.get, self._offloaded.get, self._speculative.get
        warm = candidates  # pods still matching on GPU
        held = candidates  # pods still matching on any tier
        warm_depth: dict[int, int] = {}
        depth: dict[int, int] = {}
        for i, key in enumerate(keys):
            on_gpu = warm_get(key, 0) | spec_get(key, 0)
            anywhere = on_gpu | off_get(key, 0)
            if lost := warm & ~on_gpu:
                _settle(warm_depth, lost, i)
                warm &= on_gpu
            if lost := held & ~anywhere:
                _settle(depth, lost, i)
                held &= anywhere
                if not held:
                    break
        n = len(keys)
        _settle(warm_depth, warm, n)
        _settle(depth, held, n)
        pods = self.pods
        for slot, w in warm_depth.items():
            if w and pods[slot].doomed and (fresh := self._undoomed(slot, keys, w)) < w:
                self.doomed_blocks += w - fresh
                warm_depth[slot] = fresh
                on_tier = fresh  # past the doomed block, only an offloaded copy holds
                while on_tier < depth[slot] and off_get(keys[on_tier], 0) >> slot & 1:
                    on_tier += 1
                depth[slot] = on_tier
        return {slot: (warm_depth.get(slot, 0), d) for slot, d in depth.items() if d}

    def _undoomed(self, slot: int, keys: Sequence[int], warm: int) -> int:
        """The leading blocks of ``keys[:warm]`` not doomed on ``slot``. Eviction takes
        a chain's tail first, so only a doomed tail costs a walk from the head."""
        doomed, bit, speculative = self.pods[slot].doomed, 1 << slot, self._speculative
        witness = doomed.get(keys[warm - 1])
        if witness is None or not speculative.get(witness, 0) & bit:
            return warm
        for i in range(warm):
            witness = doomed.get(keys[i])
            if witness is not None and speculative.get(witness, 0) & bit:
                return i
        return warm

    def blocks_held(self, slot: int) -> int:
        view = self.pods.get(slot)
        return len(view.blocks) if view is not None else 0


def _settle(depths: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        depths[low.bit_length() - 1] = depth
        mask ^= low


def _unset(table: dict[int, int], key: int, keep: int) -> None:
    mask = table.get(key)
    if mask is not None:
        if mask := mask & keep:
            table[key] = mask
        else:
            del table[key]
