"""The event loop: route each request with the production ``Processor``, hand it
to its pod, keep the router's view of the pods up to date, apply fleet events."""

from __future__ import annotations

import hashlib
import heapq
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ace_extproc.app import App, build
from ace_extproc.config import Config, Fleet, Mode, Settings, TenantConfig, default_fleet
from ace_extproc.fleet_file import Precise
from ace_extproc.latency import get_model
from ace_extproc.observe import Observation
from ace_extproc.routing.kv_wire import Cleared, Event, Removed, Stored
from ace_extproc.routing.metrics_text import LoraInfo
from ace_extproc.routing.policies import PolicyFactory
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.routing.replicas import Learner, Placement
from ace_extproc.sim.kvcache import PrefixCache
from ace_extproc.sim.lora import AdapterSlots
from ace_extproc.sim.tokenizer import BYTES_PER_TOKEN, encode_utf8
from bench.fleetsim.metrics import RequestRecord, RunResult
from bench.fleetsim.pod import Job, SimPod
from bench.fleetsim.prompt import EnginePrompt, PromptError, engine_prompt
from bench.fleetsim.settings import SimSettings, for_workload
from bench.workloads.base import FleetEvent, Request, Workload

# Event kinds, in the order they run when simultaneous: steps end (freeing blocks)
# and the KV events and access log entries due then reach the router, before the
# fleet changes, before new requests arrive, before routed ones land, before an idle
# pod starts (so all requests landing at one instant share a step), and last, a
# placement shared between replicas is learned (a request arriving at that same
# instant has not seen it).
_STEP_END, _KV_EVENTS, _ANSWERED, _FLEET, _ARRIVAL, _ENTER, _WAKE, _SHARED = range(8)
_UNBOUNDED_BLOCKS = 1 << 60
# A diagnostic's view of each pick: the request's index, the pod chosen, and the prompt
# tokens each pod holds cached for it at that moment (-1: not in the fleet).
Watch = Callable[[int, int, list[int]], None]


def simulate(
    workload: Workload,
    picker: PolicyFactory,
    *,
    pods: int,
    settings: SimSettings = SimSettings(),  # noqa: B008 (frozen, shared safely)
    mode: str = "prod",
    progress: bool = True,
    salt_secret: bytes = b"bench",
    replicas: int = 1,
    share_delay_s: float | None = None,
    common_load: bool = False,
    watch: Watch | None = None,
) -> RunResult:
    """Run ``workload`` over ``pods`` simulated pods routed by ``picker``.

    ``share_delay_s``: replicas share their placements (``router.share_url``), each
    reaching the others this long after it was made; None: they share nothing.
    ``common_load``: replicas that share no placements still see one load view
    (as sharing ones do here), so that only what they know of placements differs.
    ``watch``: called at each pick (a diagnostic, ``bench.placements``)."""
    if pods < 1 or replicas < 1:
        raise ValueError("pods and replicas must be at least 1")
    slots = [e.slot for e in workload.events] + list(workload.initially_absent)
    if slots and max(slots) >= pods:
        raise ValueError(
            f"{workload.name} adds and removes pod slots up to {max(slots)}: "
            f"it needs at least {max(slots) + 1} pods, not {pods}"
        )
    settings = for_workload(settings, workload)
    begin = time.perf_counter()
    sim = _Run(workload, picker, pods, settings, Mode.parse(mode), salt_secret, replicas)
    sim.watch = watch
    if share_delay_s is not None and replicas > 1:
        sim.share(share_delay_s)
    elif common_load:
        sim.common_load()
    with _progress(len(workload.requests), workload.name, progress) as tick:
        sim.tick = tick
        sim.run()
    for pod in sim.pods:  # those still in the fleet at the end
        if pod.present:
            sim.present_s[pod.slot] += sim.now - sim.joined_at[pod.slot]
    return RunResult(
        workload=workload.name,
        pods=pods,
        records=sim.records,
        busy_s=[p.busy_s for p in sim.pods],
        work_s=[p.work_s for p in sim.pods],
        present_s=sim.present_s,
        evictions=[p.evictions for p in sim.pods],
        duration_s=sim.now,
        wall_s=time.perf_counter() - begin,
        bypassed=sim.bypassed,
        rejected=sim.rejected,
        rerouted=sim.rerouted,
        replicas=replicas,
        extra={
            "scrapes": sim.scrapes,
            # Each pod's pace as the first replica learned it by the end (pace.py).
            "pace": [round(load.pace_learned, 3) for load in sim.procs[0].fleet.load],
            **sim.precise_stats(),
            **sim.lora_stats(),
        },
    )


def tenant_config(workload: Workload) -> TenantConfig:
    """A key map with one tenant per distinct bearer token in the workload, as an
    operator would configure ``router.tenants.api_keys`` for its clients; requests
    without a token are the anonymous tenant."""
    digests: dict[bytes, str] = {}
    for r in workload.requests:
        auth = r.headers.get("authorization", "")
        scheme, _, token = auth.strip().partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            digest = hashlib.sha256(token.encode()).digest()
            digests.setdefault(digest, f"key-{digest.hex()[:16]}")
    return TenantConfig(key_digests=digests)


class _Run:
    def __init__(
        self,
        workload: Workload,
        picker: PolicyFactory,
        n_pods: int,
        settings: SimSettings,
        mode: Mode,
        salt_secret: bytes,
        replicas: int,
    ) -> None:
        self.workload = workload
        self.settings = settings
        self.model = get_model(settings.ttft_model)
        fleet = default_fleet(n_pods)
        if settings.kv_events:
            # The production path: a destination with a tokenizer gets precise routing.
            fleet = Fleet(tuple(replace(d, tokenizer="sim") for d in fleet.destinations))
        config = Config(
            fleet,
            Settings(
                mode=mode,
                salt_secret=salt_secret,
                tenants=tenant_config(workload),
                ttft_model=settings.ttft_model,
                probe_interval_s=0,
                precise=Precise(speculate=settings.speculate),
                learn_pace=settings.learn_pace,
            ),
        )
        # No monitor (probe_interval_s 0): the simulation scrapes the pods itself.
        self.procs = [build(config, picker) for _ in range(replicas)]
        self.now = 0.0
        for proc in self.procs:
            # The router sees what a real one sees: its own estimate of each pod's queue
            # (each pick priced by the TTFT model, drained on the simulated clock),
            # corrected by the scrapes every scrape_interval_s.
            proc.load.use_clock(lambda: self.now)
            rates = getattr(proc.picker, "rates", None)  # the cost pipeline's prefix rates
            if rates is not None:
                rates.clock = lambda: self.now
        # Each replica's precise index (KV events on), on the simulated clock.
        self.precise: list[PreciseIndex] = []
        for proc in self.procs:
            routing = proc.processor.precise
            if routing is not None:
                routing.index.clock = lambda: self.now  # confirm_s in simulated time
                self.precise.append(routing.index)
        self.learners: list[Learner] = []  # set by share()
        self.load_shared = False
        if not settings.unbounded_cache:
            # What the fleet monitor does on its first scrape of vllm:cache_config_info:
            # bound each pod's index by the pod's real KV capacity.
            s = config.settings
            blocks = int(settings.num_gpu_blocks * settings.block_size * s.bytes_per_token)
            for proc in self.procs:
                for slot in range(n_pods):
                    proc.fleet.capacity_tokens[slot] = settings.num_gpu_blocks * settings.block_size
                    proc.index.set_capacity(slot, blocks // s.block_bytes)
        self.slot_of = {p.key: i for i, p in enumerate(self.procs[0].fleet.pods)}
        shared = self._new_cache(n_pods) if settings.pooled_cache else None
        self.pods = [
            SimPod(
                slot,
                shared if shared is not None else self._new_cache(1),
                settings.pod_model(slot),
                self,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=settings.max_num_seqs,
                tpot_ms=settings.tpot_ms,
                lora=self._new_slots(),
            )
            for slot in range(n_pods)
        ]
        # KV events not yet delivered, per pod: (the instant they were published, events).
        self.kv_batch: dict[int, tuple[float, list[Event]]] = {}
        self.kv_delivered = 0
        for slot in range(n_pods):
            self._events_on(slot)
        # kv_usage is over the nominal capacity (the pooled cache over all of it).
        self.usage_blocks = settings.num_gpu_blocks * (n_pods if settings.pooled_cache else 1)
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        # Time each pod spent in the fleet, for load balance over the pods present.
        self.joined_at = [0.0] * n_pods
        self.present_s = [0.0] * n_pods
        self.next_scrape = 0.0
        self.scrapes = 0
        self.records: list[RequestRecord] = []
        # request index -> (action, would_pick, the router's estimate of saved tokens)
        self.actions: dict[int, tuple[str, int, int]] = {}
        # request index -> (replica, what its access log entry will say): pinned ones.
        self.answers: dict[int, tuple[int, Observation]] = {}
        self.bypassed = self.rejected = self.rerouted = 0
        self.fallback_rr = 0
        self.watch: Watch | None = None
        self.tick: Callable[[], None] = lambda: None

    # -- KV events (precise routing) -------------------------------------------------
    def _events_on(self, slot: int) -> None:
        """The pod publishes its KV events and the router trusts its stream (as the
        monitor and ``KvEvents`` do on the first scrape and a connected stream)."""
        if not self.precise:
            return
        s = self.settings
        tokens = None if s.unbounded_cache else s.num_gpu_blocks * s.block_size
        for index in self.precise:
            index.set_engine_cache(slot, s.block_size, tokens)
            index.set_live(slot, True)
        self.pods[slot].cache.events = _CacheEvents(self, slot)

    def _publish(self, slot: int, event: Event) -> None:
        """One step's events of a pod go as one batch, ``event_delay_s`` later."""
        batch = self.kv_batch.get(slot)
        if batch is None or batch[0] != self.now:
            events: list[Event] = []
            self.kv_batch[slot] = (self.now, events)
            self.push(self.now + self.settings.event_delay_s, _KV_EVENTS, (slot, events))
        else:
            events = batch[1]
        events.append(event)

    def _deliver(self, slot: int, events: list[Event]) -> None:
        batch = self.kv_batch.get(slot)
        if batch is not None and batch[1] is events:
            del self.kv_batch[slot]
        self.kv_delivered += len(events)
        for index in self.precise:
            index.apply(slot, events)

    def committed(self, job: Job, blocks: range) -> None:
        """BlockStored of the blocks the step cached, as vLLM builds it (see
        ``sim.engine._report_stored``): the engine's keys, the parent's, the blocks'
        token ids under the sim tokenizer (only these blocks are encoded), block 0's salt,
        the adapter's name."""
        if not self.precise or job.cache is not self.pods[job.slot].cache:
            return  # events off, or a request draining into a cache the pod left behind
        size = self.settings.block_size
        start, end = blocks.start * size, blocks.stop * size
        prompt = job.prompt
        if isinstance(prompt, bytes):
            ids = encode_utf8(prompt[start * BYTES_PER_TOKEN : end * BYTES_PER_TOKEN])
        else:
            ids = prompt[start:end]
        parent = job.keys[blocks.start - 1] if blocks.start else None
        hashes: list[int | bytes] = list(job.keys[blocks.start : blocks.stop])
        salt = job.salt if blocks.start == 0 else None
        stored = Stored(hashes, parent, ids, size, "GPU", job.adapter, salt, len(hashes))
        self._publish(job.slot, stored)

    def lora_stats(self) -> dict[str, Any]:
        """Adapter loads and evictions over the pods (LoRA off: {})."""
        slots = [pod.lora for pod in self.pods if pod.lora is not None]
        if not slots:
            return {}
        return {
            "lora_loads": sum(s.loads for s in slots),
            "lora_evictions": sum(s.evictions for s in slots),
        }

    def precise_stats(self) -> dict[str, Any]:
        """What the first replica's precise index made of the events (none: {})."""
        if not self.precise:
            return {}
        index = self.precise[0]
        routing = self.procs[0].processor.precise
        views = routing.views if routing is not None else 0
        unkeyed = routing.unkeyed if routing is not None else 0
        agreed = routing.guess_agreed if routing is not None else 0
        compared = agreed + (routing.guess_differed if routing is not None else 0)
        pods = index.pods.values()
        return {
            "kv_events_delivered": self.kv_delivered,
            "precise_views": views,
            "precise_unkeyed": unkeyed,
            # How often the approximate index guessed the events' deepest pods alike.
            "guess_agreed": round(agreed / compared, 4) if compared else None,
            "guess_only_blocks": round(routing.guess_only_blocks) if routing else 0,
            "events_only_blocks": round(routing.events_only_blocks) if routing else 0,
            "speculative_confirmed": index.confirmed,
            "speculative_expired": index.expired,
            "blocks_stored": sum(v.stored for v in pods),
            "blocks_removed": sum(v.removed for v in pods),
            "blocks_orphaned": sum(v.orphans for v in pods),
        }

    def _new_slots(self) -> AdapterSlots | None:
        """A pod's adapter slots (--enable-lora --max-loras), on the simulated clock."""
        s = self.settings
        if not s.max_loras:
            return None
        load_ms = s.lora_load_ms
        if load_ms is None:
            load_ms = self.model.adapter_load_ms
        return AdapterSlots(s.max_loras, load_ms, clock=lambda: self.now)

    def _new_cache(self, pods: int) -> PrefixCache:
        s = self.settings
        blocks = _UNBOUNDED_BLOCKS if s.unbounded_cache else s.num_gpu_blocks * pods
        return PrefixCache(s.block_size, blocks)

    # -- the loop ---------------------------------------------------------------------
    def push(self, at: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, kind, self.seq, payload))

    def run(self) -> None:
        for slot in self.workload.initially_absent:
            self._remove(slot)
        for event in self.workload.events:
            self.push(event.at_s, _FLEET, event)
        for i, r in enumerate(self.workload.requests):
            self.push(r.arrival_s, _ARRIVAL, i)
        heap = self.heap
        interval = self.settings.scrape_interval_s
        while heap:
            at, kind, _, payload = heapq.heappop(heap)
            if kind == _ANSWERED:
                # The router's report of an answer changes no pod: applied in its turn,
                # it neither makes a scrape due nor moves the clock a scrape reads.
                replica, obs = payload
                self.procs[replica].observer.record(obs)
                continue
            if at >= self.next_scrape:
                # Pods change only at events, so their state now is their state at
                # the scrape instant(s) since the last event.
                self._scrape()
                self.next_scrape = (int(at / interval) + 1) * interval
            self.now = at
            if kind == _STEP_END:
                slot, epoch = payload
                self._schedule(slot, self.pods[slot].end_step(at, epoch))
            elif kind == _ENTER:
                self._enter(payload)
            elif kind == _KV_EVENTS:
                self._deliver(*payload)
            elif kind == _WAKE:
                pod = self.pods[payload]
                pod.wake_pending = False
                self._schedule(payload, pod.poke(at))
            elif kind == _ARRIVAL:
                self._route_new(payload)
            elif kind == _SHARED:
                sender, placement = payload
                for replica, learner in enumerate(self.learners):
                    if replica != sender:
                        learner.apply((placement,))
            else:
                self._fleet_event(payload)

    def _schedule(self, slot: int, end: float | None) -> None:
        if end is not None:
            self.push(end, _STEP_END, (slot, self.pods[slot].epoch))

    def _scrape(self) -> None:
        """What the fleet monitor's scrape of each pod's /metrics tells the router: the
        engine's running and waiting counts and KV use, which correct the router's own
        estimate (an idle pod has no prefill left)."""
        self.scrapes += 1
        views = self.procs[:1] if self.load_shared else self.procs
        base = self.settings.base_model
        for pod in self.pods:
            kv = min(1.0, pod.cache.used_blocks / self.usage_blocks)
            lora = pod.lora
            # vllm:lora_requests_info's newest sample: the slots, and the adapters of the
            # requests past their first token (vLLM names no other).
            info = (
                None
                if lora is None or not lora.reporting  # as vLLM: no sample before a request
                else LoraInfo(lora.max_loras, tuple(lora.named), tuple(lora.named), lora.deferred())
            )
            ttft = (pod.first_tokens, pod.first_token_s)
            for proc in views:
                proc.load.observed(pod.slot, pod.running, len(pod.waiting), kv, info, base, ttft)

    # -- replicas sharing placements ----------------------------------------------------
    def share(self, delay_s: float) -> None:
        """Replicas share what they place, as ``router.share_url`` makes them: each
        placement reaches the others' index and session map through the production
        ``Learner`` ``delay_s`` later (Redis pub/sub: the publisher's batching, then the
        network). The load view is common to all replicas instead (``common_load``):
        in production each replica adds what it learned to its own."""
        self.common_load()
        self.learners = []
        for replica, proc in enumerate(self.procs):
            remember = getattr(proc.picker, "remember", None)
            self.learners.append(Learner(proc.fleet, proc.index, remember))
            proc.processor.sharing = _Shared(self, replica, delay_s)

    def common_load(self) -> None:
        """One load view for every replica: the first replica's accounting counts and
        drains every replica's picks (one list of ``PodLoad``)."""
        first = self.procs[0]
        for proc in self.procs:
            proc.fleet.load = first.fleet.load
            proc.processor.load = first.load
        self.load_shared = True

    # -- routing ----------------------------------------------------------------------
    def _route_new(self, index: int) -> None:
        r = self.workload.requests[index]
        self._route(index, r, index % len(self.procs), None)

    def _route(self, index: int, r: Request, replica: int, job: Job | None) -> None:
        """Route a request exactly as the ext_proc server does, and send it on."""
        proc = self.procs[replica]
        headers = {
            ":path": r.path,
            ":method": "POST",
            "content-type": "application/json",
            "content-length": str(len(r.body)),
            **r.headers,
        }
        ctx = proc.processor.on_headers(headers, False)
        outcome = proc.processor.on_body(ctx, r.body)
        if outcome.reject_status:
            self._reject()
            return
        would = outcome.would_pick
        self.actions[index] = (
            outcome.action,
            self.slot_of[would.key] if would else -1,
            outcome.saved_tokens,
        )
        if outcome.pod is not None:
            slot = self.slot_of[outcome.pod.key]
            if self.settings.access_log_s is not None:
                # What Envoy's access log will report of it (observe.py), once answered.
                obs = Observation(outcome.mode, outcome.action, outcome.pod.key)
                obs.lora_pick = outcome.lora_pick
                self.answers[index] = (replica, obs)
        else:
            self.bypassed += 1
            fallback = self._fallback(proc)
            if fallback is None:
                self._reject()
                return
            slot = fallback
        if job is None:
            # The engine parses the body it receives: the router's rewrite, if any.
            try:
                lora_base = self.settings.base_model if self.settings.max_loras else None
                prompt = engine_prompt(
                    r.path, outcome.body or r.body, self.settings.block_size, lora_base
                )
            except PromptError:
                self._reject()
                return
            if self.pods[slot].cache.blocks_for(prompt.tokens + r.output_tokens) > (
                self.pods[slot].cache.num_gpu_blocks
            ):
                self._reject()  # vLLM refuses what can never fit
                return
            job = _job(index, r, prompt, replica)
            if self.precise:  # the events' token ids come from the prompt
                job.prompt, job.salt = prompt.prompt, prompt.salt
        job.slot = slot
        if self.watch is not None:
            held = [
                p.cache.match_keys(job.keys, job.tokens) if p.present else -1 for p in self.pods
            ]
            self.watch(job.index, slot, held)
        # The API server's share (t0, and p a prompt token) before the engine's queue.
        self.push(self.now + self.model.server_ms(job.tokens) / 1000, _ENTER, (slot, job))

    def _fallback(self, proc: App) -> int | None:
        """Envoy's default route (LEAST_REQUEST): the available pod with the fewest
        requests in flight, ties broken round-robin (deterministic: all pods are
        compared, not two random ones)."""
        fleet = proc.fleet
        n = len(fleet.pods)
        self.fallback_rr += 1
        best: int | None = None
        best_load = 0
        for k in range(n):
            slot = (self.fallback_rr + k) % n
            if not (fleet.available >> slot) & 1:
                continue
            views = self.procs[:1] if self.load_shared else self.procs
            inflight = sum(p.fleet.load[slot].inflight for p in views)
            if best is None or inflight < best_load:
                best, best_load = slot, inflight
        return best

    def _reject(self) -> None:
        self.rejected += 1
        self.tick()

    def _enter(self, payload: tuple[int, Job]) -> None:
        slot, job = payload
        pod = self.pods[slot]
        if not pod.present:  # the pod left while the request was on its way
            self._reroute(job)
            return
        self._schedule(slot, pod.enter(job, self.now))
        if pod.plan is None and not pod.wake_pending:
            pod.wake_pending = True
            self.push(self.now, _WAKE, slot)

    def _reroute(self, job: Job) -> None:
        self.rerouted += 1
        self._route(job.index, self.workload.requests[job.index], job.replica, job)

    # -- fleet events -----------------------------------------------------------------
    def _fleet_event(self, event: FleetEvent) -> None:
        if event.action == "remove":
            self._remove(event.slot)
        elif event.action == "add":
            self._add(event.slot)
        elif event.action == "clear":
            self._clear(event.slot)
        else:
            raise ValueError(f"unknown fleet event action {event.action!r}")

    def _remove(self, slot: int) -> None:
        """The pod leaves: the router stops choosing it and forgets what it held; its
        queued requests are routed again (as a retry would); admitted ones drain."""
        for proc in self.procs:
            proc.fleet.set_available(slot, False)
            proc.index.drop_pod(slot)
        for index in self.precise:
            index.drop_pod(slot)
        pod = self.pods[slot]
        if pod.present:
            self.present_s[slot] += self.now - self.joined_at[slot]
        pod.present = False
        for job in pod.take_waiting():
            self._reroute(job)

    def _add(self, slot: int) -> None:
        """The pod joins (or comes back) with an empty cache."""
        pod = self.pods[slot]
        if pod.present:
            return  # already in the fleet: nothing changes
        if not self.settings.pooled_cache:
            pod.cache.events = None  # what the old one drops is no longer the pod's
            pod.cache = self._new_cache(1)  # draining requests release into their own
        pod.present = True
        if pod.lora is not None and not pod.running:
            pod.lora = self._new_slots()  # a new process: no adapter loaded
        self.joined_at[slot] = self.now
        for proc in self.procs:
            proc.index.add_pod(slot)
            proc.fleet.set_available(slot, True)
        self._events_on(slot)

    def _clear(self, slot: int) -> None:
        """The pod's cache loses every block no running request holds, as a restart
        empties it, and the router is not told: only the pod's KV events say so."""
        pod = self.pods[slot]
        if pod.present and not self.settings.pooled_cache:
            pod.cache.reset()

    # -- what pods report (the Listener) -----------------------------------------------
    def finished(self, job: Job, now: float) -> None:
        slot = job.slot
        r = self.workload.requests[job.index]
        action, would, estimated = self.actions.pop(job.index, ("", -1, 0))
        answer = self.answers.pop(job.index, None)
        if answer is not None and self.settings.access_log_s is not None:
            answer[1].status = 200
            self.push(now + self.settings.access_log_s, _ANSWERED, answer)
        self.records.append(
            RequestRecord(
                arrival_s=r.arrival_s,
                pod=slot,
                family=r.family,
                session=r.session,
                prompt_tokens=job.tokens,
                cached_tokens=job.cached,
                queue_s=job.first_step_s - job.enter_s,
                ttft_s=job.first_token_s - r.arrival_s,
                finish_s=now,
                output_tokens=job.output_tokens,
                action=action,
                would_pick=would,
                estimated_saved_tokens=estimated,
            )
        )
        self.tick()
        if self.settings.pooled_cache:
            # Blocks freed in the shared cache may unblock another pod's queue.
            for pod in self.pods:
                if pod.slot != slot and pod.waiting:
                    self._schedule(pod.slot, pod.poke(now))


class _CacheEvents:
    """A pod cache's ``CacheEvents``: what it evicts goes out as BlockRemoved."""

    def __init__(self, run: _Run, slot: int) -> None:
        self.run = run
        self.slot = slot

    def removed(self, hashes: Sequence[int]) -> None:
        self.run._publish(self.slot, Removed(list(hashes), "GPU"))

    def cleared(self) -> None:  # a "clear" fleet event emptied it
        self.run._publish(self.slot, Cleared())


class _Shared:
    """A replica's ``PlacementSink``: its placements reach the others after a delay."""

    def __init__(self, run: _Run, replica: int, delay_s: float) -> None:
        self.run = run
        self.replica = replica
        self.delay_s = delay_s

    def note(
        self, pod: str, blocks: Sequence[int], tenant: str, session: str | None, tokens: int
    ) -> None:
        placement = Placement(pod, blocks, tenant, session, tokens)
        self.run.push(self.run.now + self.delay_s, _SHARED, (self.replica, placement))


def _job(index: int, r: Request, prompt: EnginePrompt, replica: int) -> Job:
    return Job(
        index=index,
        arrival_s=r.arrival_s,
        tokens=prompt.tokens,
        keys=prompt.keys,
        output_tokens=max(1, r.output_tokens),
        replica=replica,
        adapter=prompt.adapter,
    )


class _progress:
    """A tqdm bar when tqdm is importable, else a counter on stderr; nothing when off."""

    def __init__(self, total: int, name: str, enabled: bool) -> None:
        self.total, self.name, self.enabled = total, name, enabled
        self.bar: Any = None
        self.done = 0
        self.last = 0.0

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        try:
            from tqdm import tqdm
        except ImportError:
            return self._count
        self.bar = tqdm(total=self.total, desc=self.name, unit="req", mininterval=0.5)
        return self._update

    def _update(self) -> None:
        self.bar.update(1)

    def _count(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= 1.0 or self.done == self.total:
            self.last = now
            print(f"\r{self.name}: {self.done}/{self.total} requests", end="", file=sys.stderr)
            if self.done == self.total:
                print(file=sys.stderr)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
