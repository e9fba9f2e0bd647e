"""The simulated engine's timing: admission queue, batched prefill, decode.

A request's life, and where it waits:

1. **Admission** (FIFO): it needs one of ``max_num_seqs`` running slots and KV
   blocks for its prompt and output (see :mod:`.kvcache`).  Until then it
   counts as *waiting*; afterwards as *running* until it finishes.
2. **Prefill**: the pod runs one prefill batch at a time.  Requests that
   arrive while a batch runs wait for it, then go together in the next batch
   (FIFO, up to ``max_num_batched_tokens`` uncached tokens; a longer prompt
   runs alone instead of being chunked).  A batch takes
   ``t0 + p * (their prompt tokens) + max(t_step, sum of the members' prefill work)``
   model milliseconds, which for a request alone is exactly
   ``TTFTModel.ttft_ms(uncached, cached)``.
   The first output token comes with the end of the batch.
3. **Decode**: one token every ``tpot_ms``, whatever the batch (decode does
   not slow prefill down here, nor the reverse).

The load gauges (``gauges``) count a request only once the API server's share of it
(``TTFTModel.server_ms``: reading and tokenizing its prompt) has passed, as a real
vLLM's do: its engine hears of a request only once it is tokenized, so a scrape right
after a long prompt was sent reads the pod idle (``bench/gauge_lag.py`` measured
0.13-0.28 s for a 30K-token prompt). The timing above is unchanged by it.

With LoRA (``lora``, :mod:`.lora`), a request naming an adapter is admitted only
while the running requests name fewer than ``--max-loras`` other adapters (else it is
skipped, and the requests behind it may go); one whose adapter is not in a slot loads
it, and its prefill batch takes the load time longer.

Every model duration is multiplied by ``time_scale`` before sleeping
(0 sleeps not at all, but still yields so concurrent requests batch).  The TTFT
histogram records *simulated* seconds (admission wait divided by
``time_scale``, plus the model time of the prefill batches waited through), so
a run at ``time_scale=0.001`` still reports realistic TTFTs.  Nothing blocks
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..latency import TTFTModel
from .kvcache import Allocation, CacheEvents, PrefixCache, prompt_keys
from .lora import AdapterSlots
from .metrics import Histogram
from .tokenizer import BYTES_PER_TOKEN, encode_utf8


class CapacityError(ValueError):
    """The request can never run on this pod (it needs more KV blocks than exist)."""


Prompt = Sequence[int] | bytes  # token ids, or UTF-8 text (keyed without tokenizing)


class EngineEvents(CacheEvents, Protocol):
    """KV events (kv_events.KVEventPublisher): the engine reports the blocks a step
    stored and ends the step; the cache reports what it drops."""

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        extra_keys: list[tuple[Any, ...] | None],
        lora: tuple[int, str] | None = None,
    ) -> None: ...

    def flush(self) -> None: ...


@dataclass(slots=True, eq=False)
class EngineRequest:
    num_tokens: int  # prompt tokens
    keys: list[int]  # the prompt's block keys (see kvcache.prompt_keys)
    salt: str | None
    max_tokens: int
    n: int
    arrival: float  # loop time
    prompt: Prompt = b""  # kept for the token ids of KV events
    alloc: Allocation | None = None
    cached_tokens: int = 0
    generated: int = 0  # tokens produced per choice so far
    ttft_s: float = 0.0  # simulated seconds
    wait_s: float = 0.0  # simulated seconds spent waiting for admission
    prefill_enqueued_ms: float = 0.0  # prefill clock when it joined the prefill queue
    done: bool = False
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)
    counted_at: float = 0.0  # loop time the load gauges count it from (tokenized)
    load_ms: float = 0.0  # loading its adapter at admission (model ms, its batch's)

    @property
    def uncached_tokens(self) -> int:
        return self.num_tokens - self.cached_tokens


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    ttft: Histogram = dataclasses.field(default_factory=Histogram)


class Engine:
    def __init__(
        self,
        model: TTFTModel,
        cache: PrefixCache,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        time_scale: float = 1.0,
        tpot_ms: float = 20.0,
        events: EngineEvents | None = None,
        lora: AdapterSlots | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if time_scale < 0 or tpot_ms < 0:
            raise ValueError("time_scale and tpot_ms must not be negative")
        self.model = model
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.time_scale = time_scale
        self.tpot_ms = tpot_ms
        self.stats = EngineStats()
        self.events = events  # None: KV events off, and nothing is collected
        self.lora = lora  # adapter slots (--enable-lora); None: the base model only
        cache.events = events
        self.running = 0
        self.waiting = 0
        self._uncounted: deque[EngineRequest] = deque()  # not yet tokenized, by arrival
        # The model with no step floor gives a request's share of a batch's work.
        self._work = dataclasses.replace(model, t_step_ms=0.0)
        self._admit_queue: deque[tuple[EngineRequest, asyncio.Future[None]]] = deque()
        self._prefill_queue: deque[tuple[EngineRequest, asyncio.Future[None]]] = deque()
        self._prefill_task: asyncio.Task[None] | None = None
        self._prefill_clock_ms = 0.0  # model time spent in prefill batches so far
        self._batch_started = 0.0  # loop time the running batch began
        self._batch_ms = 0.0  # model duration of the running batch (0 when idle)

    # -- public API -----------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise :class:`CapacityError` if such a request could never be admitted."""
        need = self.cache.blocks_for(prompt_tokens + self._reserve(max_tokens, n))
        if need > self.cache.num_gpu_blocks:
            raise CapacityError(
                f"the request needs {need} KV blocks but the pod has "
                f"{self.cache.num_gpu_blocks} ({self.cache.block_size} tokens each)"
            )

    async def start(
        self,
        prompt: Prompt,
        *,
        salt: str | None = None,
        max_tokens: int = 16,
        n: int = 1,
        adapter: str | None = None,
    ) -> EngineRequest:
        """Admit and prefill a request; returns at its first token.

        ``prompt`` is token ids or the UTF-8 prompt text (the fast path: the same
        token count and cache behaviour without tokenizing).  ``adapter``: the LoRA
        adapter it names (LoRA on only). The caller must pass the result to
        :meth:`finish` (see :meth:`generate`).
        """
        if adapter is not None and self.lora is None:
            raise ValueError("a LoRA adapter on an engine without --enable-lora")
        num_tokens, keys = prompt_keys(prompt, self.cache.block_size, salt, adapter)
        self.check(num_tokens, max_tokens, n)
        loop = asyncio.get_running_loop()
        req = EngineRequest(num_tokens, keys, salt, max_tokens, n, loop.time(), prompt)
        req.adapter = adapter
        if self.time_scale > 0:
            server_s = self.model.server_ms(num_tokens) * self.time_scale / 1000
            req.counted_at = req.arrival + server_s
            self._prune_counted(req.arrival)  # bounded, whether or not anyone scrapes
            self._uncounted.append(req)
        try:
            await self._admit(req)
        except BaseException:
            req.done = True  # cancelled before admission: in no gauge (finish is a no-op)
            raise
        try:
            await self._prefill(req)
        except BaseException:
            self.finish(req, "abort")
            raise
        return req

    def gauges(self) -> tuple[int, int]:
        """``(running, waiting)`` as the engine reports them: without the requests whose
        prompt the API server is still reading (they are in neither yet)."""
        running, waiting = self.running, self.waiting
        uncounted = self._uncounted
        if not uncounted:
            return running, waiting
        now = asyncio.get_running_loop().time()
        self._prune_counted(now)
        for req in uncounted:
            if req.counted_at > now and not req.done:
                if req.alloc is None:
                    waiting -= 1
                else:
                    running -= 1
        return running, waiting

    def _prune_counted(self, now: float) -> None:
        """Drop the leading requests counted (or finished) by ``now``; in arrival order,
        so a longer prompt behind a short one may stay until the next call."""
        uncounted = self._uncounted
        while uncounted and (uncounted[0].counted_at <= now or uncounted[0].done):
            uncounted.popleft()

    async def decode(self, req: EngineRequest, tokens: int) -> None:
        """Produce ``tokens`` more tokens per choice, ``tpot_ms`` each."""
        tokens = min(tokens, req.max_tokens - req.generated)
        if tokens <= 0:
            return
        await self._sleep_ms(tokens * self.tpot_ms, yield_always=False)
        req.generated += tokens
        self.stats.generation_tokens += tokens * req.n

    def finish(self, req: EngineRequest, reason: str = "length") -> None:
        """Release the request's slot and blocks (idempotent)."""
        if req.done:
            return
        req.done = True
        if req.alloc is not None:
            self.cache.release(req.alloc)
            self.running -= 1
            if req.adapter is not None and self.lora is not None:
                self.lora.release(req.adapter, named=req.generated > 0)
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            self._wake()

    @contextlib.asynccontextmanager
    async def generate(
        self,
        prompt: Prompt,
        *,
        salt: str | None = None,
        max_tokens: int = 16,
        n: int = 1,
        adapter: str | None = None,
    ) -> AsyncIterator[EngineRequest]:
        """``start`` ... ``finish``: finished as "length", or "abort" on an exception."""
        req = await self.start(prompt, salt=salt, max_tokens=max_tokens, n=n, adapter=adapter)
        try:
            yield req
        except BaseException:
            self.finish(req, "abort")
            raise
        self.finish(req, "length")

    # -- admission ------------------------------------------------------------------
    def _reserve(self, max_tokens: int, n: int) -> int:
        return max_tokens * n

    def _try_admit(self, req: EngineRequest) -> bool | None:
        """Admit ``req`` if it fits: True; False if it waits for a sequence slot or KV
        blocks (and so does every request behind it); None if it waits for an adapter
        slot (the requests behind it may go, as vLLM's scheduler skips it)."""
        if self.running >= self.max_num_seqs:
            return False
        adapter, lora = req.adapter, self.lora
        if adapter is not None and lora is not None and not lora.admissible(adapter):
            return None
        alloc = self.cache.allocate_keys(
            req.keys, req.num_tokens, extra_tokens=self._reserve(req.max_tokens, req.n)
        )
        if alloc is None:
            return False
        req.alloc = alloc
        req.cached_tokens = alloc.cached_tokens
        self.running += 1
        if adapter is not None and lora is not None:
            req.load_ms = lora.admit(adapter)
        return True

    async def _admit(self, req: EngineRequest) -> None:
        if self.lora is not None:
            self.lora.stepped()
        if not self._admit_queue and self._try_admit(req):
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._admit_queue.append((req, fut))
        self.waiting += 1
        adapter, lora = req.adapter, self.lora
        if adapter is not None and lora is not None:
            lora.queued(adapter)
        if lora is not None:
            self._wake()  # those ahead may wait for adapter slots only: it may go now
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.finish(req, "abort")  # admitted just as it was cancelled
            raise
        finally:
            self.waiting -= 1
            if adapter is not None and lora is not None:
                lora.unqueued(adapter)
        if self.time_scale > 0:
            req.wait_s = (loop.time() - req.arrival) / self.time_scale

    def _wake(self) -> None:
        """Admit waiting requests in order while they fit (head-of-line blocking), but
        past those that wait for an adapter slot."""
        queue = self._admit_queue
        skipped: list[tuple[EngineRequest, asyncio.Future[None]]] = []
        while queue:
            req, fut = queue[0]
            if fut.done():  # cancelled while waiting
                queue.popleft()
                continue
            admitted = self._try_admit(req)
            if admitted is None:
                skipped.append(queue.popleft())
                continue
            if not admitted:
                break
            queue.popleft()
            fut.set_result(None)
        queue.extendleft(reversed(skipped))

    # -- prefill --------------------------------------------------------------------
    def _prefill_now_ms(self) -> float:
        """The prefill clock, including the elapsed part of the running batch."""
        if self._batch_ms == 0.0 or self.time_scale == 0:
            return self._prefill_clock_ms
        elapsed = (asyncio.get_running_loop().time() - self._batch_started) * 1000
        return self._prefill_clock_ms + min(self._batch_ms, elapsed / self.time_scale)

    async def _prefill(self, req: EngineRequest) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        req.prefill_enqueued_ms = self._prefill_now_ms()
        self._prefill_queue.append((req, fut))
        if self._prefill_task is None:
            self._prefill_task = asyncio.create_task(self._prefill_loop())
        await fut  # the prefill loop has committed its blocks
        req.generated = 1  # the first token comes out of the prefill step
        if req.adapter is not None and self.lora is not None:
            self.lora.first_token(req.adapter)
        req.ttft_s = req.wait_s + (self._prefill_clock_ms - req.prefill_enqueued_ms) / 1000
        stats = self.stats
        stats.prompt_tokens += req.num_tokens
        stats.cached_prompt_tokens += req.cached_tokens
        stats.generation_tokens += req.n
        # vLLM's histogram is wall-clock: the simulated seconds on the pods' clock (0: the
        # pods answer at once). The simulated TTFT itself is in the answer's usage.
        stats.ttft.observe(req.ttft_s * self.time_scale)

    def _next_batch(self) -> list[tuple[EngineRequest, asyncio.Future[None]]]:
        batch: list[tuple[EngineRequest, asyncio.Future[None]]] = []
        budget = 0
        queue = self._prefill_queue
        while queue:
            req, fut = queue[0]
            if fut.done():  # its client went away
                queue.popleft()
                continue
            if batch and budget + req.uncached_tokens > self.max_num_batched_tokens:
                break
            budget += req.uncached_tokens
            batch.append(queue.popleft())
        return batch

    def batch_ms(self, members: Sequence[tuple[int, int]], load_ms: float = 0.0) -> float:
        """Model time of one prefill batch of (uncached, cached) token counts, which
        loads adapters for ``load_ms`` first (the whole batch waits, as in vLLM)."""
        work = sum(self._work.prefill_ms(n, c) for n, c in members)
        # The server's share: the fixed part once, each prompt's tokens (tokenized one
        # after another), cached or not.
        server = self.model.server_ms(sum(n + c for n, c in members))
        return server + load_ms + max(self.model.t_step_ms, work)

    async def _prefill_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Let the requests that arrived in the same loop iteration join the first batch.
            await asyncio.sleep(0)
            while batch := self._next_batch():
                ms = self.batch_ms(
                    [(r.uncached_tokens, r.cached_tokens) for r, _ in batch],
                    sum(r.load_ms for r, _ in batch),
                )
                self._batch_started, self._batch_ms = loop.time(), ms
                await self._sleep_ms(ms, yield_always=True)
                self._prefill_clock_ms += ms
                self._batch_ms = 0.0
                self._commit(batch)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)
        finally:
            self._batch_ms = 0.0
            self._prefill_task = None
            if self.events is not None:
                self.events.flush()  # evictions of requests that left before their batch

    def _commit(self, batch: list[tuple[EngineRequest, asyncio.Future[None]]]) -> None:
        """The batch is computed: cache its full prompt blocks and, as vLLM does at
        the end of a step, publish the step's KV events before its first tokens go out."""
        events = self.events
        for req, fut in batch:
            if fut.done():
                continue  # its client went away: aborted, blocks released
            assert req.alloc is not None
            blocks = self.cache.commit(req.alloc)
            if events is not None and blocks:
                self._report_stored(events, req, blocks)
        if events is not None:
            events.flush()

    def _report_stored(self, events: EngineEvents, req: EngineRequest, blocks: range) -> None:
        """BlockStored of ``req``'s prompt blocks ``blocks``, as vLLM builds it."""
        size = self.cache.block_size
        start, end = blocks.start * size, blocks.stop * size
        prompt = req.prompt
        if isinstance(prompt, bytes):  # text: block keys hash bytes, events carry token ids
            tokens = encode_utf8(prompt[start * BYTES_PER_TOKEN : end * BYTES_PER_TOKEN])
        else:
            tokens = list(prompt[start:end])
        # One entry per block, as vLLM's: the adapter's name on every block (its block
        # hashes key each one by it), then block 0's salt.
        adapter, slots = req.adapter, self.lora
        lora = None if adapter is None or slots is None else (slots.adapter_id(adapter), adapter)
        first: tuple[Any, ...] = (req.salt,) if blocks.start == 0 and req.salt else ()
        each: tuple[Any, ...] = () if lora is None else (lora[1],)
        extra = [(*each, *first) or None] + [each or None] * (len(blocks) - 1)
        parent = req.keys[blocks.start - 1] if blocks.start else None
        events.stored(req.keys[blocks.start : blocks.stop], parent, tokens, size, extra, lora)

    async def _sleep_ms(self, ms: float, *, yield_always: bool) -> None:
        delay = ms * self.time_scale / 1000
        if delay > 0:
            await asyncio.sleep(delay)
        elif yield_always:
            await asyncio.sleep(0)
