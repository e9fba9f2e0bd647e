"""End to end in endpoint mode: the real Envoy with one ``override_host`` cluster of all
pods, ace-extproc naming ``ip:port,fallback,...`` (the Gateway API Inference
Extension's endpoint-picker form), simulated pods. Retries must go down the list."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from msgspec.structs import replace

from ace_extproc import config as cfg
from ace_extproc import envoy_config as ec
from ace_extproc import stack as stack_mod
from ace_extproc.config import Pod
from ace_extproc.stack import Stack, StackOptions
from tests.conftest import envoy_validate
from tests.test_e2e import Client, cached, conversation, options, running, trace

pytestmark = pytest.mark.envoy

GIE = "x-gateway-destination-endpoint"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Client]:
    with running(options(upstream_mode="endpoint")) as client:
        yield client


def pods(client: Client) -> dict[str, Pod]:
    assert client.stack.config is not None
    return {p.id: p for p in client.stack.config.fleet.pods}


def received(client: Client, among: list[Pod]) -> list[dict[str, Any]]:
    """Requests the given pods recorded (the sim's --record), each tagged with its pod."""

    async def fetch() -> list[Any]:
        return list(
            await asyncio.gather(*(client._get(f"{p.base_url}/debug/requests") for p in among))
        )

    got = client.run(fetch())
    return [
        {**r, "pod": p.id}
        for p, recs in zip(among, got, strict=True)
        for r in recs
        if r["path"].startswith("/v1/")
    ]


def clear(client: Client, among: list[Pod]) -> None:
    async def delete() -> None:
        await asyncio.gather(*(client._delete(f"{p.base_url}/debug/requests") for p in among))

    client.run(delete())


def envoy_stat(client: Client, name: str) -> int:
    async def get() -> str:
        url = f"http://{client.stack.options.admin}/stats?filter=^{name}$"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return await resp.text()

    text = client.run(get()).strip()
    return int(text.rsplit(":", 1)[1]) if text else 0


def test_a_conversation_sticks_to_one_pod_named_by_ip_port(endpoint: Client) -> None:
    by_id = pods(endpoint)
    endpoint.clear_records()
    served, hits = [], []
    for turn in range(4):
        status, headers, body = endpoint.chat(conversation(turn, "endpoint-billing"))
        assert status == 200, body
        served.append(headers["x-ace-served-by"])
        assert headers["x-sim-pod"] == headers["x-ace-served-by"].split("/")[1]
        hits.append(cached(body))
        assert trace(headers)["action"] == ("miss" if turn == 0 else "hit")
    assert len(set(served)) == 1
    assert hits[0] == 0 and all(h > 500 for h in hits[1:])  # the engine's own figure
    pod = by_id[served[0].split("/")[1]]
    (*_, last) = endpoint.records()[pod.id]
    # What the pod was sent: the GIE header and x-ace-upstream agree, primary first,
    # then the picker's fallbacks (other pods of the fleet).
    listed = last["headers"][GIE].split(",")
    assert last["headers"]["x-ace-upstream"] == last["headers"][GIE]
    assert listed[0] == pod.address and len(listed) >= 2
    assert set(listed) <= {p.address for p in by_id.values()} and len(set(listed)) == len(listed)


def test_client_supplied_endpoint_headers_never_pin(endpoint: Client) -> None:
    by_id = pods(endpoint)
    msgs = conversation(2, "endpoint-pinning")
    _, first, _ = endpoint.chat(msgs)
    chosen = first["x-ace-served-by"].split("/")[1]
    other = next(p for i, p in by_id.items() if i != chosen)
    forged = {"x-ace-upstream": other.address, GIE: other.address}
    for _ in range(4):  # ace-extproc decides: its value replaces the (stripped) client's
        _, headers, _ = endpoint.chat(msgs, **forged)
        assert headers["x-sim-pod"] == chosen
    # Shadow: ace-extproc names nothing, so only early stripping keeps override_host
    # from honouring the client's header.
    shadow = {"x-ace-skill-override": "prefix_kv_cache=shadow", **forged}
    landed = Counter(endpoint.chat(msgs, **shadow)[1]["x-sim-pod"] for _ in range(12))
    assert len(landed) > 1, landed


def test_ext_proc_killed_fails_open_through_the_fallback_policy(endpoint: Client) -> None:
    by_id = pods(endpoint)
    endpoint.run(endpoint.stack.stop_process("ace-extproc", signal.SIGKILL))
    try:
        forged = {"x-ace-upstream": by_id["pod-3"].address, GIE: by_id["pod-3"].address}
        landed: Counter[str] = Counter()
        for i in range(12):
            status, headers, _ = endpoint.chat(conversation(0, f"open-{i % 3}"), **forged)
            assert status == 200
            assert "x-ace-pinned" not in headers
            landed[headers["x-sim-pod"]] += 1
        assert len(landed) > 1, landed  # least_request picks; the forged header does not
    finally:
        endpoint.run(endpoint.stack.start_ext_proc())


def test_retries_land_on_the_listed_fallback_pod() -> None:
    # No pod monitor: ace-extproc keeps believing the stopped pod is up and names it first.
    with running(options(upstream_mode="endpoint", router={"probe_interval_s": 0})) as client:
        by_id = pods(client)
        by_address = {p.address: p for p in by_id.values()}
        msgs = conversation(1, "failover")
        status, headers, _ = client.chat(msgs)
        assert status == 200
        primary = by_id[headers["x-sim-pod"]]
        client.run(client.stack.stop_process(primary.id))
        alive = [p for p in by_id.values() if p != primary]
        clear(client, alive)  # (Client.clear_records would ask the stopped pod too)
        retries_before = envoy_stat(client, "cluster.ace_default.sim.upstream_rq_retry")

        served = []
        for _ in range(4):
            status, headers, body = client.chat(msgs)
            assert status == 200, body
            assert headers["x-ace-pinned"] == primary.key  # still named first
            # ... and the header naming who served says who did: the retry's pod.
            assert headers["x-ace-served-by"] == by_id[headers["x-sim-pod"]].key != primary.key
            served.append(headers["x-sim-pod"])
        got = received(client, alive)
        assert len(got) == 4  # each request reached exactly one live pod, once
        for record in got:
            listed = record["headers"][GIE].split(",")
            assert listed[0] == primary.address
            # The first retry goes to the second entry: the picker's first fallback.
            assert record["pod"] == by_address[listed[1]].id
        assert sorted(served) == sorted(r["pod"] for r in got)
        retries = envoy_stat(client, "cluster.ace_default.sim.upstream_rq_retry")
        assert retries - retries_before >= 4

        # The first fallback down too: the second retry takes the third entry.
        listed = got[0]["headers"][GIE].split(",")
        assert len(listed) >= 3, listed
        first_fallback = by_address[listed[1]]
        client.run(client.stack.stop_process(first_fallback.id))
        alive.remove(first_fallback)
        clear(client, alive)
        status, headers, _ = client.chat(msgs)
        assert status == 200
        (record,) = received(client, alive)
        assert record["headers"][GIE].split(",")[:3] == listed[:3]
        assert headers["x-sim-pod"] == record["pod"] == by_address[listed[2]].id


def test_up_gives_the_server_and_envoy_one_upstream_mode(tmp_path: Path) -> None:
    """``ace-extproc up --fleet f --upstream-mode endpoint``: both read a copy of the
    fleet file with ``router.upstream_mode`` set; the user's file is left alone."""
    fleet = tmp_path / "mine.yaml"
    original = (
        "destinations:\n  - {id: d, base_url: 'http://10.0.0.1:8000'}\nrouter: {mode: shadow}\n"
    )
    fleet.write_text(original)
    parser = argparse.ArgumentParser()
    stack_mod.add_arguments(parser)
    args = parser.parse_args(["--fleet", str(fleet), "--upstream-mode", "endpoint"])
    assert args.upstream_mode == "endpoint"
    stack = Stack(StackOptions(fleet_path=str(fleet), workdir=tmp_path / "work"))
    (tmp_path / "work").mkdir()
    copy = stack._with_router(fleet, {"upstream_mode": "endpoint"})
    config = cfg.load(copy, env={})
    assert config.settings.upstream_mode == "endpoint"
    assert config.settings.mode is cfg.Mode.SHADOW  # the rest of router: kept
    assert fleet.read_text() == original


def test_an_original_dst_cluster_needs_no_hosts_and_routes_to_the_named_endpoint(
    tmp_path: Path,
) -> None:
    """router.endpoint_cluster: original_dst: the destination's cluster lists no hosts
    (no headless Service to resolve); Envoy connects to the ip:port ace-extproc names,
    one endpoint (a list would not parse)."""
    router = {"endpoint_cluster": "original_dst"}
    with running(options(upstream_mode="endpoint", router=router)) as client:
        assert client.stack.config is not None
        doc = ec.render(client.stack.config)
        names = {p.destination for p in client.stack.config.fleet.pods}
        dests = [c for c in doc["static_resources"]["clusters"] if c["name"] != "ace_extproc"]
        assert len(dests) == len(names) >= 1, [c["name"] for c in dests]
        for dest in dests:
            assert dest["type"] == "ORIGINAL_DST" and "load_assignment" not in dest
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(doc))
        envoy_validate(path)
        by_id = pods(client)
        client.clear_records()
        served = set()
        for turn in range(3):
            status, headers, body = client.chat(conversation(turn, "original-dst"))
            assert status == 200, body
            served.add(headers["x-sim-pod"])
            # (No x-ace-served-by: ORIGINAL_DST's hosts carry no pod metadata.)
            assert headers["x-ace-pinned"].split("/")[1] == headers["x-sim-pod"]
        assert len(served) == 1
        (pod_id,) = served
        (*_, last) = client.records()[pod_id]
        assert last["headers"][GIE] == by_id[pod_id].address  # one endpoint, no list
    shadow = cfg.Config(
        client.stack.config.fleet,
        replace(client.stack.config.settings, mode=cfg.Mode.SHADOW),
    )
    with pytest.raises(cfg.ConfigError, match=r"original_dst.*prod"):
        ec.render(shadow)
