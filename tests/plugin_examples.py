"""Plug-ins a user might write, named by import path in the tests' fleet.yaml."""

from __future__ import annotations

from dataclasses import dataclass

from ace_extproc.routing import FleetState, RoutingRequest
from ace_extproc.routing.pipeline import Candidates


@dataclass(frozen=True)
class OnlyPods:
    """A filter: keep only the pods named (by id), e.g. one zone's."""

    pods: tuple[str, ...] = ()

    def __call__(self, request: RoutingRequest, candidates: int, fleet: FleetState) -> int:
        keep = 0
        for slot, pod in enumerate(fleet.pods):
            if pod.id in self.pods:
                keep |= 1 << slot
        return candidates & keep


@dataclass(frozen=True)
class Penalty:
    """A scorer: milliseconds added on the pods named, e.g. ones being upgraded."""

    pods: tuple[str, ...] = ()
    ms: float = 1000.0

    def __call__(self, c: Candidates) -> list[float]:
        pods = c.fleet.pods
        return [self.ms if pods[slot].id in self.pods else 0.0 for slot in c.slots]
