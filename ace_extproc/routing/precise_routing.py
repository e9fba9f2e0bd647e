"""A request's side of precise routing: its token-exact block keys, and how much of it
each candidate whose events are trusted really holds.

The processor asks ``view`` before the pick: the destination's tokenizer turns the
body into the engine's token ids (``tokens.py``), cut into the block size the pods'
events use and keyed from the salt the engine will see and the LoRA adapter the
request names (an engine keys an adapter's blocks by it, and its events name it). The
precise index answers for the live pods; the approximate index still answers for the
rest (pods that publish no events, or whose stream is not trusted now), in the same
fleet. After the pick, ``picked`` records the blocks on the chosen pod speculatively.

Depths go to the picker in the approximate index's units (its blocks of the
canonical prompt), as the share of the prompt the pod holds, so both kinds of pod
are priced alike. A block offloaded to CPU or storage counts ``1 - offloaded_cost``
of a GPU block: cheaper than a miss, dearer than a hit.

Each keyed request also asks the approximate index what it guesses the same pods hold
and counts how far the guess is from the events (the ``ace_precise_guess_*`` metrics):
where they agree, the events cannot steer better, and an operator can see whether a
fleet needs them (another replica's or gateway's traffic, evictions the index does not
foresee) before paying for the tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ace_extproc.config import Destination
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.tokens import (
    ModelTokens,
    RequestTokens,
    TokenizerError,
    block_keys,
    chain_seed,
    load,
)

log = logging.getLogger("ace_extproc.precise")


@dataclass(slots=True)
class Deferred:
    """A request routed approximately while its long new document was tokenized aside:
    what keys its pick once the ids are at hand."""

    tokenizer: ModelTokens
    path: str
    body: bytes
    salt: str | None
    model: str
    live: int


@dataclass(slots=True)
class PreciseView:
    keys: list[int]  # the prompt's block keys, in the pods' block size
    tokens: int  # the prompt's tokens, exact
    live: int  # candidates whose events are trusted (bitmask); 0 while deferred
    depths: dict[int, float]  # live candidate -> depth in approximate-index blocks
    deferred: Deferred | None = None


class PreciseRouting:
    def __init__(
        self,
        index: PreciseIndex,
        fleet: FleetState,
        destinations: tuple[Destination, ...],
        *,
        offloaded_cost: float = 0.3,
        speculate: bool = True,
        guess: BlockIndex | None = None,
    ) -> None:
        self.index = index
        self.guess = guess  # the approximate index, compared with the events
        self.speculate = speculate
        self.fleet = fleet
        self.offloaded_cost = offloaded_cost
        self.tokenizers: dict[str, RequestTokens] = {}
        self.failed: dict[str, str] = {}  # destination -> why its tokenizer did not load
        for d in destinations:
            if not d.tokenizer:
                continue
            try:
                self.tokenizers[d.id] = load(d.tokenizer)
            except TokenizerError as exc:
                self.failed[d.id] = str(exc)
                log.error(
                    "destination %s: tokenizer not loaded, routed approximately: %s", d.id, exc
                )
        self.views = 0  # requests keyed token-exact
        self.unkeyed = 0  # requests the tokenizer could not render (routed approximately)
        # Keyed requests whose deepest live pods the guess named alike, or not; and the
        # blocks only the guess holds (evicted, or not yet computed) or only the events
        # (placed by someone else), in the approximate index's blocks.
        self.guess_agreed = 0
        self.guess_differed = 0
        self.guess_only_blocks = 0.0
        self.events_only_blocks = 0.0

    def view(
        self,
        destination: str,
        path: str,
        body: bytes,
        salt: str | None,
        model: str,
        candidates: int,
        router_blocks: Sequence[int],
    ) -> PreciseView | None:
        """None where no candidate's events are trusted, or the request cannot be
        tokenized as the engine would: then the approximate index decides alone (as it
        does for a view with nothing ``live``, whose long document is being tokenized
        aside: its pick is keyed later)."""
        live = candidates & self.index.live_mask
        tokenizer = self.tokenizers.get(destination)
        if not live or tokenizer is None:
            return None
        block_size = self._block_size(live)
        model_tokens = tokenizer if isinstance(tokenizer, ModelTokens) else None
        deferrals = model_tokens.deferred if model_tokens is not None else 0
        ids = tokenizer.token_ids(path, body)
        if not ids or not block_size:
            self.unkeyed += 1
            if model_tokens is not None and model_tokens.deferred > deferrals:
                deferred = Deferred(model_tokens, path, body, salt, model, live)
                return PreciseView([], 0, 0, {}, deferred)
            return None
        self.views += 1
        keys = block_keys(ids, block_size, chain_seed(salt, self._adapter(model, live)))
        tokens = len(ids)
        depths: dict[int, float] = {}
        if keys:
            discount = 1.0 - self.offloaded_cost
            scale = len(router_blocks) / tokens
            for slot, (warm, held) in self.index.match(keys, live).items():
                cached = min((warm + discount * (held - warm)) * block_size, tokens - 1)
                depths[slot] = scale * cached
        if self.guess is not None:
            self._compare(self.guess.match_depths(router_blocks, live), depths)
        return PreciseView(keys, tokens, live, depths)

    def _compare(self, guessed: Mapping[int, int], depths: Mapping[int, float]) -> None:
        """Count how far the guess is from the events' word. Differences under a block
        are the partial last block, which only the engine's tokens count."""
        for slot in guessed.keys() | depths.keys():
            diff = guessed.get(slot, 0) - depths.get(slot, 0.0)
            if diff >= 1:
                self.guess_only_blocks += diff
            elif diff <= -1:
                self.events_only_blocks -= diff
        if _deepest(guessed) == _deepest(depths):
            self.guess_agreed += 1
        else:
            self.guess_differed += 1

    def picked(self, slot: int, view: PreciseView) -> None:
        if not (self.speculate and slot in self.index.pods):
            return
        deferred = view.deferred
        if deferred is None:
            self.index.speculate(slot, view.keys)
        else:
            # Keyed once its document is tokenized: until the engine has prefilled it
            # (seconds, for a long one) and said so, only this entry tells the next
            # request for that document where it went.
            deferred.tokenizer.when_tokenized(lambda: self._speculate_later(slot, deferred))

    def _speculate_later(self, slot: int, deferred: Deferred) -> None:
        if slot not in self.index.pods:
            return  # the pod left meanwhile
        ids = deferred.tokenizer.token_ids(deferred.path, deferred.body)
        block_size = self._block_size(deferred.live)
        if ids and block_size:
            seed = chain_seed(deferred.salt, self._adapter(deferred.model, deferred.live))
            self.index.speculate(slot, block_keys(ids, block_size, seed))

    def _adapter(self, model: str, live: int) -> str | None:
        """``model`` where it names a LoRA adapter on the live candidates (one
        destination: any one says), else None: the base model's keys name no adapter."""
        lora = self.fleet.load[live.bit_length() - 1].lora
        return model if lora.is_adapter(model) else None

    def _block_size(self, live: int) -> int:
        """The block size the live candidates' events use (one destination: one)."""
        pods = self.index.pods
        while live:
            low = live & -live
            view = pods.get(low.bit_length() - 1)
            if view is not None and (view.block_size or view.expected_block_size):
                return view.block_size or view.expected_block_size
            live ^= low
        return 0


def _deepest(depths: Mapping[int, float]) -> frozenset[int]:
    """The pods holding the deepest match, within the partial block a depth from the
    events may lack; none where no pod holds a whole block."""
    top = max(depths.values(), default=0.0)
    if top < 1:
        return frozenset()
    return frozenset(slot for slot, depth in depths.items() if depth > top - 1)
