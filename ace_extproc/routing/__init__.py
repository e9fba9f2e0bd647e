"""Routing: the fleet's pods (``fleet``), what each holds warm (``index``), where new
prefixes go (``rendezvous``), and the policies that choose (``picker``)."""

from ace_extproc.routing.fleet import FleetState, PodLoad
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.picker import Pick, Policy, PrefixAffinityPicker, RoutingRequest

__all__ = [
    "BlockIndex",
    "FleetState",
    "Pick",
    "PodLoad",
    "Policy",
    "PrefixAffinityPicker",
    "RoutingRequest",
]
