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
  shown the series yet (vLLM samples it only after its first request) has the slots
  the other pods of its destination show (``load.py``); one that has answered and
  shows none runs no LoRA: every request costs 0 there;
- each pick of adapter A on the pod marks A in use, and loaded unless every slot is
  held by adapters in use (then the request waits for one: A is loaded once its answer
  says it ran, or a scrape shows it running). The mark outlives a scrape that cannot
  show the request yet (the engine's gauges lag a request by its
  API server's read and tokenization, ``load.UNSEEN_MS``);
- each answer Envoy reports (its access log, ``observe.py``, which carries the pick's
  number) frees A once this router has no pick of it open on the pod, unless the last
  scrape showed A in use by requests not this router's (another replica's or
  gateway's). Without the access log, only the next scrape frees it, so adapter routing
  then depends on how often the pods are read (the fleet simulation's lora-mix at reads
  1 s apart: TTFT p99 2.4x);
- an adapter that was in use stays believed loaded after its requests finish (vLLM
  keeps it in its slot until another needs the slot), the least recently used
  forgotten first, ``max_lora`` at most; a slot freed goes first to an adapter of a
  pick sent to wait for one (``_admit_waiting``), as vLLM's scheduler gives it;
- vLLM 0.32 names a request's adapter in neither label until its first token, whether
  it waits for the step's token budget, for a slot (then it counts it as deferred,
  ``LoraInfo.deferred``) or is still prefilling. So where answers are heard, a scrape
  closes no pick: it cannot tell a queued request from an answered one. Without
  answers, a pick sent to wait stays open while the engine counts that many deferred.

Prefixes need nothing here: prefix hashes are seeded by tenant and ``model``
(``prefix.scope_seed``), so two adapters' prompts never match each other's blocks, as
in vLLM, whose block hashes include the adapter.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ace_extproc.routing.pipeline import Candidates

# How long a pick of an adapter stays open without its answer: past it, only the
# scrapes say whether the adapter is in use (answers lost, or no access log).
OPEN_FOR_S = 60.0
# Pick numbers, unique in the process (a pod's slot may be reused by a new pod).
_pick_numbers = itertools.count(1)


@dataclass(slots=True)
class Adapters:
    """The router's view of one pod's adapter slots."""

    max_lora: int = 0  # slots (vLLM's --max-loras); 0: LoRA off, or not scraped yet
    reported_slots: bool = False  # max_lora is the pod's own word, not its siblings'
    base: str | None = None  # the pod's base model (the scrape's model_name label)
    in_use: set[str] = field(default_factory=set)  # running or waiting, or picked since
    loaded: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU first
    # The last scrape's adapters in use, as the engine said them (no picks since).
    reported: frozenset[str] = frozenset()
    # This router's picks of adapters on the pod not yet answered: pick number ->
    # (adapter, monotonic seconds by which the engine's gauges must show it, whether it
    # was sent to wait for a slot); oldest first.
    picks: dict[int, tuple[str, float, bool]] = field(default_factory=dict)
    # Those picks counted per adapter, kept as they open and close (read per candidate
    # pod on the request path, ``slot_wait_answers``).
    open_picks: Counter[str] = field(default_factory=Counter)
    # Adapters the last scrape showed in use with none of this router's picks open.
    others: frozenset[str] = frozenset()
    # Whether an answer to a pick here has been heard (Envoy's access log reaches this
    # router): then answers alone close picks (or ``OPEN_FOR_S``), not scrapes.
    answers_heard: bool = False

    def is_adapter(self, model: str) -> bool:
        """Whether ``model`` names an adapter on this pod (it runs LoRA, and that is not
        its base model)."""
        return self.max_lora > 0 and self.base is not None and model != self.base

    def scraped(
        self,
        base: str | None,
        max_lora: int,
        in_use: Iterable[str],
        now: float = 0.0,
        running: Iterable[str] | None = None,
        deferred: int = 0,
    ) -> None:
        """A scrape's word at ``now``: the adapters in use are those it shows, and those
        of this router's open picks (``_settle``: closed by their answers, or by a
        scrape where no answer is heard; ``deferred``: its requests waiting for a slot).
        Loaded are the adapters it shows ``running`` (by default all it shows), and
        those of the picks not yet shown that did not wait for a slot."""
        self.base, self.max_lora = base, max(0, max_lora)
        self.reported_slots = True
        names = tuple(in_use)  # touched in the engine's order, not a set's (hash-seeded)
        self.reported = frozenset(names)
        young, slotted = self._settle(now, self.reported, deferred)
        ours = self.open_picks
        self.others = frozenset(n for n in names if not ours[n])
        self.in_use = set(names) | young
        for name in (*(names if running is None else running), *sorted(slotted)):
            self._touch(name)
        self._admit_waiting()

    def assume(self, base: str | None, max_lora: int) -> None:
        """``max_lora`` slots serving ``base`` until the pod's own scrape says (vLLM
        shows none before its first request); the adapters in use stay those of this
        router's picks."""
        self.base, self.max_lora = base, max(0, max_lora)

    def idle(self, now: float = 0.0) -> None:
        """The engine runs and queues nothing at ``now``: no adapter is in use but those
        of picks it cannot show yet (vLLM leaves the gauge's last sample as it was when
        the engine went idle)."""
        self.in_use = self._settle(now, frozenset())[0]
        self.others = frozenset()
        self._admit_waiting()

    def picked(self, model: str, seen_by: float = 0.0) -> int:
        """A request for ``model`` went to the pod: its adapter is in use there at least
        until ``seen_by`` (the clock's seconds), when the engine's gauges must show it
        (by default, at once: the next scrape), and loaded now, unless every slot is
        held by adapters in use: then it waits for one, and is not loaded (the next
        request for it waits too). Returns the pick's number, for its answer
        (``answered``); 0 where ``model`` is no adapter here."""
        if not self.is_adapter(model):
            return 0
        number = next(_pick_numbers)
        waits = self.waits_for_slot(model)
        self.picks[number] = (model, seen_by, waits)
        self.open_picks[model] += 1
        self.in_use.add(model)
        if not waits:
            self._touch(model)
            self._trim()
        return number

    def answered(self, number: int) -> None:
        """Pick ``number`` has been answered: with no pick of its adapter left, the
        adapter is no longer in use, unless others' requests were using it. A pick
        already settled by a scrape, or not this pod's, changes nothing."""
        if number not in self.picks:
            return
        model = self._close(number)
        self.answers_heard = True
        if model not in self.loaded:  # it waited for its slot, and got it: it ran
            self._touch(model)
            self._trim()
        if model not in self.others and not self.open_picks[model]:
            self.in_use.discard(model)
            self._admit_waiting()

    def _settle(
        self, now: float, shown: frozenset[str], deferred: int = 0
    ) -> tuple[set[str], set[str]]:
        """Closes the picks a scrape at ``now`` showing ``shown`` in use says were
        answered, and those older than ``OPEN_FOR_S`` (their answers lost). vLLM 0.32
        names a request's adapter only from its first token on, so a scrape cannot tell
        an answered request from one queued for the step's token budget, prefilling or
        deferred for a slot. Where answers are heard, they alone close the picks: a
        scrape that closed those it did not show counted a busy pod's slots free (on
        the real pods, adapters priced as having a free slot there waited 2-7.5 s
        behind a full batch). Where none are heard, the scrapes must:
        a pick it could show and does not was answered, unless it was sent to wait for
        a slot and the engine counts that many requests deferred. Returns the adapters
        of the picks open and not shown, and of those that took a slot."""
        young: set[str] = set()
        slotted: set[str] = set()
        unshown: list[int] = []  # oldest first
        for number, (model, seen_by, waited) in list(self.picks.items()):
            if seen_by > now:
                young.add(model)
                if not waited:
                    slotted.add(model)
            elif seen_by < now - OPEN_FOR_S:
                self._close(number)
            elif model not in shown:
                unshown.append(number)
        if self.answers_heard:  # their answers close them
            young.update(self.picks[number][0] for number in unshown)
        else:
            for number in unshown:
                model, _, waited = self.picks[number]
                if waited and deferred > 0:  # still waiting for its slot
                    deferred -= 1
                    young.add(model)
                else:
                    self._close(number)
        return young, slotted

    def _close(self, number: int) -> str:
        """Pick ``number`` is no longer open; returns its adapter."""
        model = self.picks.pop(number)[0]
        left = self.open_picks[model] - 1
        if left:
            self.open_picks[model] = left
        else:
            del self.open_picks[model]
        return model

    def cost_ms(self, model: str, load_ms: float, busy_ms: float) -> float:
        """Milliseconds ``model`` adds to a request's TTFT here: 0 for the base model
        or a loaded adapter; the load where a slot is free, or held by an adapter no
        request uses (evicted: whoever needs it next pays its load then); the load and
        the wait for a slot where every slot's adapter is in use: ``busy_ms`` (one
        answer) for a slot whose adapter's requests come seldom, longer for one whose
        requests keep coming (``slot_wait_answers``)."""
        if not self.is_adapter(model) or model in self.loaded:
            return 0.0
        if not self.waits_for_slot(model):
            return load_ms
        return load_ms + busy_ms * self.slot_wait_answers(model)

    def slot_wait_answers(self, model: str) -> float:
        """How many answers' time a request for ``model`` waits for a slot here (every
        slot held by an adapter in use). vLLM admits a running adapter's new requests
        while others wait, so a slot frees only at a gap of one answer (d) between its
        adapter's requests: with them arriving at r a second, after (exp(r*d) - 1) / r
        on average, d for an adapter asked for seldom, many d for a hot one. r*d is
        the adapter's requests in flight (Little's law), less the one that holds the
        slot: this router's open picks of it, one where only a scrape showed it. The
        adapters already waiting take the first slots to free."""
        ours, loaded = self.open_picks, self.loaded
        others = [name for name in self.in_use if name != model]
        holding = sorted(_gap_answers(ours[name] - 1) for name in others if name in loaded)
        if not holding:
            return 1.0
        rounds, turn = divmod(len(others) - len(holding), len(holding))
        return holding[turn] * (1 + rounds)

    def state(self, model: str) -> str:
        """What ``model`` needs here, for the trace: "" (no adapter here), "loaded",
        "load" (a slot to take) or "wait" (every slot held by an adapter in use)."""
        if not self.is_adapter(model):
            return ""
        if model in self.loaded:
            return "loaded"
        return "wait" if self.waits_for_slot(model) else "load"

    def traced(self, model: str) -> tuple[str, str]:
        """The trace's ``adapter`` and ``adapter_slots_busy`` for a request for ``model``
        picked here; empty for no adapter."""
        state = self.state(model)
        return (state, self.busy_slots(model)) if state else ("", "")

    def busy_slots(self, model: str) -> str:
        """For the trace: the slots held by other adapters in use, of all, as
        ``"3/4"``."""
        return f"{len(self.in_use) - (model in self.in_use)}/{self.max_lora}"

    def waits_for_slot(self, model: str) -> bool:
        """Whether a request for ``model`` waits here for a slot: it is not loaded, and
        vLLM runs at most ``max_lora`` distinct adapters at once, so with that many
        others in use it waits for one of them to have no request left."""
        if not self.is_adapter(model) or model in self.loaded:
            return False
        return len(self.in_use) - (model in self.in_use) >= self.max_lora

    def _admit_waiting(self) -> None:
        """vLLM gives a slot whose adapter has no request left to an adapter waiting for
        one: the adapters of this router's picks sent to wait, oldest first, take the
        slots not held by adapters in use, and the idle adapters there are evicted (an
        idle adapter believed loaded past that drew the next requests for it into a
        wait behind the whole batch: 14.7 s on the real pods)."""
        loaded, in_use = self.loaded, self.in_use
        held = sum(name in in_use for name in loaded)
        for model, _, waited in self.picks.values():
            if held >= self.max_lora:
                break
            if waited and model in in_use and model not in loaded:
                self._touch(model)
                held += 1
        self._trim()

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


def _gap_answers(rd: float) -> float:
    """The mean wait, in answers, for a gap of one answer between requests that
    arrive ``rd`` to an answer (a Poisson stream): (exp(rd) - 1) / rd, 1 at rd = 0."""
    return math.expm1(rd) / rd if rd > 0 else 1.0


@dataclass(frozen=True, slots=True)
class LoraCost:
    """A pipeline scorer: what the request's adapter costs on each pod (``Adapters``),
    0 for the base model. ``load_ms``: loading an adapter into a slot (unset: the
    destination's TTFT model's ``adapter_load_ms``, 100 ms on the GPU models, 1 ms on the
    real-engine tier's CPU pods; the pods' pace is learned with the same, ``load.py``);
    ``busy_ms``:
    waiting for a slot when every one holds an adapter in use: until one adapter's
    requests have all finished, about one answer's decode (unset: the destination's
    TTFT model's ``decode_ms``, 1,980 ms on the default 70B model as the flat 2 s it
    replaced, 225 ms on the real-engine tier's CPU pods)."""

    load_ms: float | None = None
    busy_ms: float | None = None

    def __post_init__(self) -> None:
        if not all(ms is None or ms >= 0 for ms in (self.load_ms, self.busy_ms)):
            raise ValueError("load_ms and busy_ms must not be negative")

    def __call__(self, c: Candidates) -> list[float]:
        load, model = c.fleet.load, c.request.model
        load_ms, busy_ms = self.load_ms, self.busy_ms
        if load_ms is None:
            load_ms = c.model.adapter_load_ms
        if busy_ms is None:
            busy_ms = c.model.decode_ms()
        return [load[slot].lora.cost_ms(model, load_ms, busy_ms) for slot in c.slots]
