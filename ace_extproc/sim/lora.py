"""LoRA adapter slots of a simulated engine, as vLLM runs them with ``--enable-lora``.

One implementation for both simulated engines: the HTTP pod (``engine.py``) and the
fleet simulation's pods (``bench/fleetsim/pod.py``).

What vLLM does, and what is kept here:

- ``--max-loras N``: N adapter slots on the GPU. vLLM's scheduler admits a request
  only while the running batch names at most N distinct adapters; a request whose
  adapter would be one too many is *skipped* (it stays waiting, the requests behind
  it may go: ``admissible``).
- An adapter not in a slot is loaded when a request needing it is admitted, in the
  model runner before the step runs, so that whole step takes the load time longer
  (``admit`` returns it; the engine adds it to the step). It takes the slot of the
  least recently used adapter that no running request uses (vLLM's LRU adapter cache).
- Each adapter has an id, counted from 1 in the order the server registered it
  (``--lora-modules`` first): vLLM's ``lora_int_id``, which its KV events carry as
  ``lora_id`` beside ``lora_name`` (``adapter_id``).
- ``vllm:lora_requests_info``: a gauge whose labels name the adapters of the running
  requests, comma-separated, and ``max_lora``; its value is the time the engine last saw
  that combination, one series per combination (``info_series``). vLLM 0.32 fills its
  ``waiting_lora_adapters`` with the same names, and learns of a request only from its
  first output (``LoRARequestStates`` reads the scheduler's events, which ride on a
  request's outputs): a request queued, deferred for a slot or still prefilling is in
  neither label (``named``); one deferred is counted in
  ``vllm:num_requests_waiting_by_reason{reason="deferred"}`` (``deferred``).
  vLLM sets it from the scheduler's stats after an engine step, so an engine that has
  had no request yet (just started, or just added to a fleet) shows no sample at all:
  not even ``max_lora`` (``reporting``).

Not modelled: the CPU-side cache of ``--max-cpu-loras`` (every load here costs the
same, as from disk), and adapter ranks or sizes (one load time for all).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

# The series of vllm:lora_requests_info kept: vLLM keeps one per label combination ever
# seen (prometheus-client never drops them); the sim keeps the newest few.
MAX_SERIES = 64


class AdapterSlots:
    """The adapter slots of one engine: what is loaded, what its requests use."""

    def __init__(
        self, max_loras: int, load_ms: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        """``max_loras``: slots (vLLM's ``--max-loras``); ``load_ms``: model time to load
        an adapter into one; ``clock``: wall seconds, the metric's sample values."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if not load_ms >= 0:
            raise ValueError(f"load_ms must not be negative, got {load_ms}")
        self.max_loras = max_loras
        self.load_ms = load_ms
        self.clock = clock
        self.loaded: OrderedDict[str, None] = OrderedDict()  # in slots, LRU first
        self.running: dict[str, int] = {}  # admitted requests per adapter
        # Those past their first token: what the gauge names, in the order first named.
        self.named: dict[str, int] = {}
        self.waiting: dict[str, int] = {}  # queued requests per adapter
        self.loads = 0  # adapters loaded into a slot
        self.reporting = False  # whether the engine has had a request (the gauge has a sample)
        self.evictions = 0  # adapters dropped from a slot for another
        self._series: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._ids: dict[str, int] = {}

    def adapter_id(self, adapter: str) -> int:
        """vLLM's ``lora_int_id`` of ``adapter``: 1, 2, ... in the order adapters were
        registered (the server registers its ``--lora-modules`` at start, in order)."""
        ids = self._ids
        found = ids.get(adapter)
        if found is None:
            found = ids[adapter] = len(ids) + 1
        return found

    # -- the scheduler ----------------------------------------------------------------
    def stepped(self) -> None:
        """The engine has a request (of any model): from its first step on, vLLM's
        gauge has a sample."""
        self.reporting = True

    def queued(self, adapter: str) -> None:
        """A request for ``adapter`` joined the waiting queue."""
        self.waiting[adapter] = self.waiting.get(adapter, 0) + 1

    def unqueued(self, adapter: str) -> None:
        """It left the waiting queue (admitted, or gone)."""
        _drop(self.waiting, adapter)

    def admissible(self, adapter: str) -> bool:
        """Whether a request for ``adapter`` may join the running batch now: its adapter
        is already running, or the batch names fewer than ``max_loras`` adapters."""
        return adapter in self.running or len(self.running) < self.max_loras

    def admit(self, adapter: str) -> float:
        """Admit a request for ``adapter`` (``admissible`` must hold): the milliseconds
        of loading it costs its step, 0 when its adapter is in a slot already."""
        self.running[adapter] = self.running.get(adapter, 0) + 1
        loaded = self.loaded
        if adapter in loaded:
            loaded.move_to_end(adapter)
            return 0.0
        if len(loaded) >= self.max_loras:
            # admissible() left a slot whose adapter no running request uses.
            victim = next(name for name in loaded if name not in self.running)
            del loaded[victim]
            self.evictions += 1
        loaded[adapter] = None
        self.loads += 1
        return self.load_ms

    def deferred(self) -> int:
        """Queued requests the scheduler skips for their adapter (it is not running and
        the batch names ``max_loras`` adapters): vLLM's waiting ``reason="deferred"``."""
        if len(self.running) < self.max_loras:
            return 0
        return sum(n for name, n in self.waiting.items() if name not in self.running)

    def first_token(self, adapter: str) -> None:
        """A running request for ``adapter`` produced its first token: the gauge names it
        from now on."""
        self.named[adapter] = self.named.get(adapter, 0) + 1

    def release(self, adapter: str, named: bool = True) -> None:
        """A running request for ``adapter`` finished (``named``: past its first token);
        the adapter stays in its slot."""
        _drop(self.running, adapter)
        if named:
            _drop(self.named, adapter)

    # -- the metric -------------------------------------------------------------------
    def info_series(self) -> list[tuple[dict[str, str], float]]:
        """``vllm:lora_requests_info``'s samples, oldest first: the current state is
        stamped now (vLLM stamps it at every engine step), earlier ones keep theirs;
        none before the engine's first request."""
        if not self.reporting:
            return []
        running = ",".join(self.named)
        key = (running, running)  # vLLM 0.32: the waiting label repeats the running one
        series = self._series
        series.pop(key, None)
        series[key] = self.clock()
        while len(series) > MAX_SERIES:
            series.popitem(last=False)
        max_lora = str(self.max_loras)
        return [
            (
                {
                    "max_lora": max_lora,
                    "running_lora_adapters": running,
                    "waiting_lora_adapters": waiting,
                },
                stamp,
            )
            for (running, waiting), stamp in series.items()
        ]


def _drop(counts: dict[str, int], adapter: str) -> None:
    left = counts.get(adapter, 0) - 1
    if left > 0:
        counts[adapter] = left
    else:
        counts.pop(adapter, None)
