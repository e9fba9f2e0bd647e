"""LoRA adapters: what the router knows of each pod's adapter slots, and what serving
an adapter a pod has not loaded costs (``LoraCost``, a scorer in milliseconds).

An engine run with ``--enable-lora --max-loras N`` holds N adapters on the GPU. A
request names an adapter as its ``model``; one not in a slot is loaded first (the
whole engine step waits for it), into the slot of the least recently used adapter that
no running request uses. While all N slots hold adapters with requests running, a
request for another one waits until one of them has none left (vLLM's scheduler admits
at most N distinct adapters into a batch).

The router's view of a pod (``Adapters``), kept by ``load.py``:

- each scrape of ``vllm:lora_requests_info`` (``metrics_text.LoraInfo``) gives
  ``max_lora`` and the adapters in use, those of the running and waiting requests;
  the pod's base model is the scrape's ``model_name`` label. A pod that has not
  shown the series has no adapters here: every request costs 0 there;
- between scrapes, each pick of adapter A on the pod marks A loaded and in use, as
  the picks count in flight between scrapes;
- an adapter that was in use stays believed loaded after its requests finish (vLLM
  keeps it in its slot until another needs the slot), the least recently used
  forgotten first, ``max_lora`` at most.

Prefixes need nothing here: prefix hashes are seeded by tenant and ``model``
(``prefix.scope_seed``), so two adapters' prompts never match each other's blocks, as
in vLLM, whose block hashes include the adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ace_extproc.routing.pipeline import Candidates

# Milliseconds to load an adapter into a GPU slot: an estimate, not a measurement. A
# rank-16 adapter on the attention projections of a 70B model is ~65 MB of fp16 (the
# MLP's too: ~400 MB); read from local disk at 1-2 GB/s, parsed and copied to the GPU,
# that is tens to a few hundred ms (less from vLLM's CPU cache, --max-cpu-loras).
DEFAULT_LOAD_MS = 100.0


@dataclass(slots=True)
class Adapters:
    """The router's view of one pod's adapter slots."""

    max_lora: int = 0  # slots (vLLM's --max-loras); 0: LoRA off, or not scraped yet
    base: str | None = None  # the pod's base model (the scrape's model_name label)
    in_use: set[str] = field(default_factory=set)  # running or waiting, or picked since
    loaded: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU first
    # The last scrape's adapters in use, as the engine said them (no picks since).
    reported: frozenset[str] = frozenset()

    def is_adapter(self, model: str) -> bool:
        """Whether ``model`` names an adapter on this pod (it runs LoRA, and that is not
        its base model)."""
        return self.max_lora > 0 and self.base is not None and model != self.base

    def scraped(self, base: str | None, max_lora: int, in_use: Iterable[str]) -> None:
        """A scrape's word: the adapters in use now replace those believed in use (the
        picks since the last scrape are in it, or finished)."""
        self.base, self.max_lora = base, max(0, max_lora)
        names = tuple(in_use)  # touched in the engine's order, not a set's (hash-seeded)
        self.reported = frozenset(names)
        self.in_use = set(names)
        for name in names:
            self._touch(name)
        self._trim()

    def idle(self) -> None:
        """The engine runs and queues nothing: no adapter is in use (vLLM leaves the
        gauge's last sample as it was when the engine went idle)."""
        self.in_use.clear()

    def picked(self, model: str) -> None:
        """A request for ``model`` went to the pod: its adapter is loaded there now."""
        if self.is_adapter(model):
            self.in_use.add(model)
            self._touch(model)
            self._trim()

    def cost_ms(self, model: str, load_ms: float, busy_ms: float) -> float:
        """Milliseconds ``model`` adds to a request's TTFT here: 0 for the base model
        or a loaded adapter; the load where a slot is free, or held by an adapter no
        request uses (evicted: whoever needs it next pays its load then); the load and
        the wait for a slot where every slot's adapter is in use."""
        if not self.is_adapter(model) or model in self.loaded:
            return 0.0
        return load_ms + busy_ms if self.waits_for_slot(model) else load_ms

    def waits_for_slot(self, model: str) -> bool:
        """Whether a request for ``model`` waits here for a slot: it is not loaded, and
        vLLM runs at most ``max_lora`` distinct adapters at once, so with that many
        others in use it waits for one of them to have no request left."""
        if not self.is_adapter(model) or model in self.loaded:
            return False
        return len(self.in_use) - (model in self.in_use) >= self.max_lora

    def _touch(self, name: str) -> None:
        loaded = self.loaded
        loaded[name] = None
        loaded.move_to_end(name)

    def _trim(self) -> None:
        """At most ``max_lora`` believed loaded: an adapter in use keeps its slot, the
        least recently used of the others goes first (the engine's LRU)."""
        loaded = self.loaded
        while len(loaded) > self.max_lora:
            idle = next((name for name in loaded if name not in self.in_use), None)
            del loaded[idle if idle is not None else next(iter(loaded))]


@dataclass(frozen=True, slots=True)
class LoraCost:
    """A pipeline scorer: what the request's adapter costs on each pod (``Adapters``),
    0 for the base model. ``load_ms``: loading an adapter into a slot; ``busy_ms``:
    waiting for a slot when every one holds an adapter in use: until one adapter's
    requests have all finished, about one answer's decode (unset: the destination's
    TTFT model's ``decode_ms``, 1,980 ms on the default 70B model as the flat 2 s it
    replaced, 225 ms on the real-engine tier's CPU pods)."""

    load_ms: float = DEFAULT_LOAD_MS
    busy_ms: float | None = None

    def __post_init__(self) -> None:
        if not (self.load_ms >= 0 and (self.busy_ms is None or self.busy_ms >= 0)):
            raise ValueError("load_ms and busy_ms must not be negative")

    def __call__(self, c: Candidates) -> list[float]:
        load, model = c.fleet.load, c.request.model
        load_ms, busy_ms = self.load_ms, self.busy_ms
        if busy_ms is None:
            busy_ms = c.model.decode_ms()
        return [load[slot].lora.cost_ms(model, load_ms, busy_ms) for slot in c.slots]
