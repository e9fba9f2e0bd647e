"""The composition root: everything one ace-extproc process runs, built once, in the
order each part needs the others, and handed what it uses.

The decision path (``processor`` → ``request`` → ``prefix`` → the picker →
``mutate``) holds nothing that runs in the background: it reads the fleet's state
and the index, and writes its picks to the load accounting, the placement log and
the sharing queue. The monitor, discovery and sharing loops change that state from
the same event loop, between requests; ``start`` and ``stop`` run them. Nothing is
filled in after construction.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ace_extproc.config import Config, ttft_models
from ace_extproc.drains import DrainFile
from ace_extproc.observe import Observer
from ace_extproc.processor import Processor
from ace_extproc.routing import BlockIndex, FleetState, Policy, policies
from ace_extproc.routing.discovery import Discovery, for_destination
from ace_extproc.routing.fleet import ADDED, RETIRED
from ace_extproc.routing.homes import ResponseHomes, ResponseHomesMetrics
from ace_extproc.routing.kv_events import KvEvents
from ace_extproc.routing.load import LoadAccounting
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.routing.outlier import OutlierDetector
from ace_extproc.routing.placements import PrefixPlacements
from ace_extproc.routing.policies import PolicyFactory
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.routing.precise_metrics import PreciseMetrics
from ace_extproc.routing.precise_routing import PreciseRouting
from ace_extproc.routing.replicas import Learner, ReplicaSync
from ace_extproc.telemetry import Telemetry
from ace_extproc.tenants import Tenants

log = logging.getLogger("ace_extproc")


@dataclass(frozen=True, slots=True)
class App:
    config: Config
    fleet: FleetState  # the pods, their health, drains and load
    index: BlockIndex  # which pod holds which prefix block
    picker: Policy
    load: LoadAccounting
    processor: Processor  # the decision, per request
    telemetry: Telemetry
    observer: Observer  # what became of the responses: passive health, reuse
    placements: PrefixPlacements  # where recent prefixes went (the admin API's)
    drains: DrainFile
    monitor: FleetMonitor | None  # probes and scrapes; None with probe_interval_s <= 0
    discoveries: tuple[Discovery, ...]  # pods found at run time
    sharing: ReplicaSync | None  # placements shared with the other replicas
    kv_events: KvEvents | None  # the engines' KV event streams (precise routing)
    homes: ResponseHomes  # the pods holding stored Responses-API responses

    async def start(self) -> None:
        """Start what runs in the background. Sharing connects in the background: Redis
        may come up later."""
        if self.monitor is not None:
            await self.monitor.start()
        # After the monitor, which follows the pods discovery adds and removes.
        for discovery in self.discoveries:
            await discovery.start()
        if self.sharing is not None:
            await self.sharing.start()
        if self.kv_events is not None:
            await self.kv_events.start()

    @property
    def discovered(self) -> bool:
        """Every discovery has synced once: the pods are known (readiness)."""
        return all(d.synced.is_set() for d in self.discoveries)

    async def until_discovered(self) -> None:
        """Return once ``discovered``."""
        await asyncio.gather(*(d.synced.wait() for d in self.discoveries))

    async def stop(self) -> None:
        """Stop it; the pods discovery found stay as they are."""
        for discovery in self.discoveries:
            await discovery.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.sharing is not None:
            await self.sharing.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()


def build(config: Config, picker: PolicyFactory | None = None) -> App:
    """Every part, constructed; nothing started. ``picker`` overrides the policy the
    settings name (the benchmark's baselines)."""
    s = config.settings
    fleet = FleetState(config.fleet)
    index = BlockIndex(s.index_blocks_per_pod)
    _size_index_by_destination(config, fleet, index)
    chosen = (picker or policies.build(s))(fleet, index)
    # The accounting runs where scrapes correct it: without them it would only grow.
    watching = s.probe_interval_s > 0
    load = LoadAccounting(fleet, s, active=watching)
    # Precise routing: the pods of destinations with a tokenizer follow their events.
    precise_index = PreciseIndex(s.precise.confirm_s)
    precise = PreciseRouting(
        precise_index,
        fleet,
        config.fleet.destinations,
        offloaded_cost=s.precise.offloaded_cost,
        speculate=s.precise.speculate,
        guess=index,
    )
    kv_events = None
    if precise.tokenizers:
        kv_events = KvEvents(
            fleet, precise_index, frozenset(precise.tokenizers), rebuild_s=s.precise.rebuild_s
        )
    homes = ResponseHomes(fleet, s.responses_remembered, s.responses_ttl_s)
    monitor = FleetMonitor(fleet, index, s, load, precise_index, homes) if watching else None
    discoveries = tuple(
        for_destination(fleet, index, d)
        for d in config.fleet.destinations
        if d.discovery is not None
    )
    sharing = None
    if s.share_url:
        learner = Learner(fleet, index, getattr(chosen, "remember", None), load, homes)
        sharing = ReplicaSync(
            learner, s.share_url, s.block_bytes, s.share_channel, password=s.share_password
        )
    outliers = OutlierDetector(fleet, s.passive_health)
    observer = Observer(fleet, outliers, homes, sharing, s.usage_capture)
    placements = PrefixPlacements()
    telemetry = Telemetry(s, fleet, index, monitor, ledger=observer.ledger, sharing=sharing)
    if kv_events is not None or precise.failed:
        telemetry.registry.register(PreciseMetrics(kv_events, precise))
    telemetry.registry.register(ResponseHomesMetrics(homes))
    processor = Processor(
        s,
        fleet,
        chosen,
        Tenants(s.tenants, s.salt_secret),
        telemetry,
        load,
        ttft_models(config.fleet, s),
        placements=placements,
        sharing=sharing,
        precise=precise if kv_events is not None else None,
        homes=homes,
    )

    def forget(slot: int, change: str) -> None:
        if change == RETIRED:  # another pod takes the slot: forget the one that left
            telemetry.retire_slot(slot)
            observer.ledger.by_pod.pop(fleet.pods[slot].key, None)
            placements.forget_slot(slot)

    fleet.on_change.append(forget)
    # An operator's drains, before the first request (and as discovered pods join).
    drains = DrainFile(s.drain_file, fleet)
    drains.load()
    return App(
        config,
        fleet,
        index,
        chosen,
        load,
        processor,
        telemetry,
        observer,
        placements,
        drains,
        monitor,
        discoveries,
        sharing,
        kv_events,
        homes,
    )


def _size_index_by_destination(config: Config, fleet: FleetState, index: BlockIndex) -> None:
    """A destination's configured KV size bounds its pods' index until they report one
    (the monitor then sets it from the engine's own); a retired slot's index goes."""
    s = config.settings
    tokens_per_block = s.block_bytes / s.bytes_per_token
    blocks = {
        d.id: max(1, int(d.kv_capacity_tokens / tokens_per_block))
        for d in config.fleet.destinations
        if d.kv_capacity_tokens
    }

    def bound(slot: int) -> None:
        if fleet.capacity_tokens[slot] is None:
            configured = blocks.get(fleet.pods[slot].destination)
            if configured is not None:
                index.set_capacity(slot, configured)

    def changed(slot: int, change: str) -> None:
        if change == ADDED:
            bound(slot)
        if change == RETIRED:
            index.retire_pod(slot)

    for slot in range(len(fleet.pods)):
        bound(slot)
    fleet.on_change.append(changed)
