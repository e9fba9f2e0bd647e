"""IPv6 pods: discovery finds them (AAAA records, IPv6 EndpointSlices), so the monitor
must reach them, the observer must recognise Envoy's name for them, and the fleet file
must round-trip them."""

from __future__ import annotations

import asyncio
import time

import yarl

from ace_extproc.config import PassiveHealth, Pod, Settings, fleet_to_dict, parse_fleet, sim_fleet
from ace_extproc.observe import Observer
from ace_extproc.routing.discovery import DnsDiscovery
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.routing.outlier import OutlierDetector
from ace_extproc.sim.app import SimConfig, SimServer


def test_an_ipv6_pod_is_bracketed_wherever_it_is_an_address() -> None:
    pod = Pod("d", "fd00--7", "fd00::7", 8000)
    assert pod.address == "[fd00::7]:8000"
    url = yarl.URL(pod.base_url + "/health")
    assert (url.host, url.port) == ("fd00::7", 8000)
    assert Pod("d", "p", "10.0.0.7", 8000).address == "10.0.0.7:8000"
    assert Pod("d", "p", "llama.svc", 8000).base_url == "http://llama.svc:8000"


def test_ip_literals_are_read_in_their_canonical_spelling() -> None:
    """Envoy reports ``[fd00::7]:8000``; a fleet file may spell it ``[FD00:0::7]``."""
    fleet = parse_fleet(
        {
            "destinations": [
                {
                    "id": "d",
                    "provider": "vllm",
                    "base_url": "http://[FD00:0:0::7]:8000",
                    "pods": [{"id": "a", "base_url": "http://[FD00:0::7]:8000"}],
                }
            ]
        }
    )
    (pod,) = fleet.pods
    assert (pod.host, pod.address) == ("fd00::7", "[fd00::7]:8000")
    assert parse_fleet(fleet_to_dict(fleet)) == fleet  # and the file round-trips


def test_dns_discovery_canonicalises_what_the_resolver_returns() -> None:
    fs = FleetState(sim_fleet(["127.0.0.1:9000"]))

    async def resolver(host: str, port: int) -> list[str]:
        return ["FD00:0:0::7", "fd00::8%eth0", "10.0.0.9"]

    d = DnsDiscovery(fs, BlockIndex(10), "sim", "llm.svc", 8000, resolver=resolver)
    asyncio.run(d.refresh())
    assert sorted(fs.pods[s].address for s in d.slots.values()) == [
        "10.0.0.9:8000",
        "[fd00::7]:8000",
        "[fd00::8]:8000",
    ]


def test_the_monitor_probes_and_scrapes_an_ipv6_pod() -> None:
    """Before brackets, ``http://::1:port`` was no URL: the pod was never probed or
    scraped, so it looked healthy and idle whatever it did."""

    async def main() -> None:
        async with SimServer(SimConfig(pod_id="v6", time_scale=0.0), host="::1") as pod:
            fleet = FleetState(sim_fleet([f"[::1]:{pod.port}"]))
            settings = Settings(scrape_interval_s=0.05, probe_interval_s=0.05)
            monitor = FleetMonitor(fleet, BlockIndex(100), settings)
            await monitor.start()
            try:
                deadline = time.monotonic() + 5
                while monitor.scrapes == 0 or fleet.capacity_tokens[0] is None:
                    assert time.monotonic() < deadline, "the ipv6 pod was never scraped"
                    await asyncio.sleep(0.02)
                assert fleet.is_available(0) and not monitor.is_down(0)
            finally:
                await monitor.stop()
            # And the observer finds it by the address Envoy reports for it.
            observer = Observer(fleet, OutlierDetector(fleet, PassiveHealth()))
            assert observer.slot_at(f"[::1]:{pod.port}") == 0

    asyncio.run(asyncio.wait_for(main(), 10))
