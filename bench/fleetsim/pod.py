"""One simulated engine pod: admission, continuous batching with chunked prefill,
decode, all in simulated time (see the package docstring for the step model).

The pod does not own the clock: ``start_step``/``end_step``/``enter``/``poke``
return the time its current activity ends (or None when idle), and the runner
calls ``end_step`` then with the epoch it was given.  A change of plan (a stretch
of decode steps cut short by a new request) bumps the epoch, so the stale end
event is ignored.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ace_extproc.latency import TTFTModel
from ace_extproc.sim.kvcache import Allocation, PrefixCache
from ace_extproc.sim.lora import AdapterSlots


@dataclass(slots=True, eq=False)
class Job:
    """One request's life on a pod."""

    index: int  # into the workload's requests
    arrival_s: float
    tokens: int  # prompt tokens
    keys: list[int]  # its KV block keys
    output_tokens: int
    replica: int  # the router replica that routed it (its in-flight counters)
    slot: int = -1  # the pod it was sent to
    enter_s: float = 0.0  # when it reached the pod's queue
    alloc: Allocation | None = None
    cache: PrefixCache | None = None  # the cache ``alloc`` came from
    cached: int = 0  # prefix tokens the engine found cached at admission
    prefilled: int = 0  # uncached tokens computed so far
    first_step_s: float = -1.0  # start of its first prefill step
    first_token_s: float = -1.0
    # For KV events (kept only while they are on): the prompt the block token ids
    # come from, and the salt of block 0.
    prompt: bytes | list[int] = b""
    salt: str | None = None
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)

    @property
    def uncached(self) -> int:
        return self.tokens - self.cached


class Listener(Protocol):
    """What the runner hears from a pod (for the router's counters and the records)."""

    def committed(self, job: Job, blocks: range) -> None:
        """The prefill step cached these of ``job``'s full prompt blocks (BlockStored)."""

    def finished(self, job: Job, now: float) -> None: ...


@dataclass(slots=True)
class StepPlan:
    start: float
    duration: float  # seconds per step
    count: int  # identical steps (>1 only for a stretch of decode-only steps)
    chunks: list[tuple[Job, int]] = field(default_factory=list)  # prefill work
    work: float = 0.0  # seconds of compute per step (the duration without its floor)

    @property
    def end(self) -> float:
        return self.start + self.duration * self.count


class SimPod:
    def __init__(
        self,
        slot: int,
        cache: PrefixCache,
        model: TTFTModel,
        listener: Listener,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        tpot_ms: float | None,
        lora: AdapterSlots | None = None,
    ) -> None:
        self.slot = slot
        self.lora = lora  # adapter slots (--enable-lora); None: base model only
        self.cache = cache
        self.model = model
        self.listener = listener
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.tpot_ms = tpot_ms
        # A prefill chunk under this many tokens costs less than the step floor; a
        # request's remainder that small is finished in the same step instead (see
        # _chunk), so that a lone request's TTFT is the calibrated model's exactly.
        self.min_chunk = math.ceil(model.t_step_ms / model.a_ms) if model.a_ms > 0 else 0
        self.present = True  # in the fleet (not removed)
        self.waiting: deque[Job] = deque()  # not admitted yet, FIFO
        self.prefilling: list[Job] = []  # admitted, prefill not done, admission order
        self._decoding: list[tuple[int, int, Job]] = []  # heap of (finish step, seq, job)
        self._seq = 0
        # Sum of decoding requests' prompt tokens: each decode token attends to its
        # context (a + b * context); the growth over the output is left out.
        self.decode_ctx = 0
        self.running = 0  # admitted requests (hold KV blocks)
        self.steps = 0  # steps completed
        self.busy_s = 0.0
        # The compute in those steps: a step of one decode token still lasts the floor
        # (t_step), so busy time counts a pod decoding one request as fully busy.
        self.work_s = 0.0
        self.evictions = 0
        # vllm:time_to_first_token_seconds' count and sum (from arrival, queue included).
        self.first_tokens = 0
        self.first_token_s = 0.0
        self.plan: StepPlan | None = None
        self.epoch = 0
        self.wake_pending = False  # the runner has a wake-up queued for this idle pod

    # -- the runner's entry points --------------------------------------------------
    def enter(self, job: Job, now: float) -> float | None:
        """A request reaches the pod's queue. Returns a new end time to schedule, if
        any. An idle pod does not start at once: the runner wakes it after every
        request arriving at this same instant has entered, so they share the step."""
        job.enter_s = now
        self.waiting.append(job)
        if self.lora is not None:
            self.lora.stepped()
        if job.adapter is not None and self.lora is not None:
            self.lora.queued(job.adapter)
            # Requests skipped for their adapter do not block it: it may go at once.
            if self.plan is not None and len(self.waiting) > 1:
                return self.poke(now)
        if self.plan is None or len(self.waiting) > 1:
            return None  # idle (woken later), or the queue is blocked and it waits too
        return self.poke(now)

    def poke(self, now: float) -> float | None:
        """Something may be admissible now (a request arrived, blocks were freed)."""
        if self.plan is None:
            return self.start_step(now)
        if self.plan.count > 1:
            return self._cut_stretch(now)
        return None  # the current step ends soon and the next one looks at the queue

    def end_step(self, now: float, epoch: int) -> float | None:
        """The planned steps are done (if ``epoch`` is current): apply them, plan more."""
        plan = self.plan
        if plan is None or epoch != self.epoch:
            return None
        self.plan = None
        self.steps += plan.count
        self.busy_s += plan.duration * plan.count
        self.work_s += plan.work * plan.count
        listener = self.listener
        done_prefill = False
        for job, chunk in plan.chunks:
            job.prefilled += chunk
            assert job.alloc is not None and job.cache is not None
            # vLLM caches each full block as soon as it is computed.
            blocks = job.cache.commit(
                job.alloc, (job.cached + job.prefilled) // job.cache.block_size
            )
            if blocks:
                listener.committed(job, blocks)
            if job.prefilled >= job.uncached:
                done_prefill = True
                job.first_token_s = now
                self.first_tokens += 1
                if job.adapter is not None and self.lora is not None:
                    self.lora.first_token(job.adapter)
                self.first_token_s += now - job.arrival_s
                if job.output_tokens <= 1:
                    self._finish(job, now)
                else:  # one token per step from the next step on
                    self._seq += 1
                    finish_step = self.steps + job.output_tokens - 1
                    heapq.heappush(self._decoding, (finish_step, self._seq, job))
                    self.decode_ctx += job.tokens
        if done_prefill:
            self.prefilling = [j for j in self.prefilling if j.prefilled < j.uncached]
        decoding = self._decoding
        while decoding and decoding[0][0] <= self.steps:
            _, _, job = heapq.heappop(decoding)
            self.decode_ctx -= job.tokens
            self._finish(job, now)
        return self.start_step(now)

    def start_step(self, now: float) -> float | None:
        """Plan the next step(s) from the queues; None when there is nothing to do."""
        assert self.plan is None
        n_decode = len(self._decoding)
        budget = self.budget - n_decode  # each decoding request takes one token
        chunks: list[tuple[Job, int]] = []
        work = 0.0
        for job in self.prefilling:
            if budget <= 0:
                break
            chunk = self._chunk(job.uncached - job.prefilled, budget)
            chunks.append((job, chunk))
            work += self._work(chunk, job.cached + job.prefilled)
            budget -= chunk
        waiting = self.waiting
        lora = self.lora
        skipped: list[Job] = []
        while waiting and budget > 0 and self.running < self.max_num_seqs:
            job = waiting[0]
            adapter = job.adapter
            if adapter is not None and lora is not None and not lora.admissible(adapter):
                # vLLM skips a request whose adapter would exceed --max-loras in the
                # batch; the ones behind it may go.
                skipped.append(waiting.popleft())
                continue
            if not self._admit(job):
                break  # FIFO: the head waits for blocks, and so does everyone behind it
            waiting.popleft()
            if adapter is not None and lora is not None:
                lora.unqueued(adapter)
                # Loading an adapter into a slot holds up the whole step, as in vLLM.
                work += lora.admit(adapter)
            self.prefilling.append(job)
            job.first_step_s = now
            chunk = self._chunk(job.uncached, budget)
            chunks.append((job, chunk))
            work += self._work(chunk, job.cached)
            budget -= chunk
        if skipped:
            waiting.extendleft(reversed(skipped))
        if not chunks and not n_decode:
            return None
        m = self.model
        if self.tpot_ms is None:
            decode_work = n_decode * m.a_ms + m.b_ms * self.decode_ctx
            floor = m.t_step_ms
        else:
            decode_work = 0.0
            floor = self.tpot_ms if n_decode else m.t_step_ms
        duration = max(floor, work + decode_work) / 1000
        # With no prefill to do, nothing changes until the next request finishes
        # decoding: plan all those identical steps at once.
        count = 1 if chunks else self._decoding[0][0] - self.steps
        self.plan = StepPlan(now, duration, count, chunks, (work + decode_work) / 1000)
        self.epoch += 1
        return self.plan.end

    def take_waiting(self) -> list[Job]:
        """Hand back the requests not yet admitted (the pod is leaving)."""
        jobs = list(self.waiting)
        self.waiting.clear()
        if self.lora is not None:
            for job in jobs:
                if job.adapter is not None:
                    self.lora.unqueued(job.adapter)
        return jobs

    # -- internals ------------------------------------------------------------------
    def _cut_stretch(self, now: float) -> float | None:
        """End a stretch of decode steps at the boundary of the step under way."""
        plan = self.plan
        assert plan is not None
        done = max(1, math.ceil((now - plan.start) / plan.duration))
        if done >= plan.count:
            return None
        plan.count = done
        self.epoch += 1
        return plan.end

    def _chunk(self, remaining: int, budget: int) -> int:
        if remaining <= budget or remaining - budget < self.min_chunk:
            # The overrun (< t_step / a tokens, ~275 for the default model) spares a
            # step that would cost the floor for almost no work: vLLM would take that
            # step; we fold it in so a lone request's TTFT is the model's at any length.
            return remaining
        return budget

    def _work(self, tokens: int, context: int) -> float:
        # a*k + b*k*(context + k/2): over the chunks of one prefill this sums to the
        # model's a*n + b*n*(c + n/2) exactly (k*(s + k/2) telescopes to n^2/2).
        m = self.model
        return tokens * (m.a_ms + m.b_ms * (context + tokens / 2))

    def _admit(self, job: Job) -> bool:
        cache = self.cache
        before = cache.evictions
        alloc = cache.allocate_keys(job.keys, job.tokens, extra_tokens=job.output_tokens)
        if alloc is None:
            return False
        self.evictions += cache.evictions - before
        job.alloc, job.cache, job.cached = alloc, cache, alloc.cached_tokens
        self.running += 1
        return True

    def _finish(self, job: Job, now: float) -> None:
        assert job.alloc is not None and job.cache is not None
        job.cache.release(job.alloc)
        if job.adapter is not None and self.lora is not None:
            self.lora.release(job.adapter, named=job.first_token_s >= 0)
        job.alloc = None
        job.keys = []
        job.prompt = b""
        self.running -= 1
        self.listener.finished(job, now)
