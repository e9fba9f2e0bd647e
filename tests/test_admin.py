"""The admin API over real gRPC, driven through ``ace-extproc ctl`` (in process and as a
subprocess), next to the real ext_proc server taking requests as Envoy sends them."""

import asyncio
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import msgspec
import pytest
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from ace_extproc import cli, server
from ace_extproc.admin import parse_prefix_ref, resolve_pod
from ace_extproc.app import App, build
from ace_extproc.config import (
    Config,
    ConfigError,
    Destination,
    Fleet,
    Pod,
    Settings,
    parse_fleet,
    parse_settings,
    sim_fleet,
)
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.placements import PrefixPlacements
from tests.conftest import free_port, peer_metadata


def make_config(listen: str, admin: str, pods: int = 3, **kw: Any) -> Config:
    fleet = sim_fleet([f"127.0.0.1:{9001 + i}" for i in range(pods)])
    kw.setdefault("probe_interval_s", 0.0)  # no pods answer here
    return Config(fleet, Settings(listen=listen, admin_listen=admin, salt_secret=b"s", **kw))


def chat(doc: str) -> bytes:
    return msgspec.json.encode(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": f"{doc} " * 400},
                {"role": "user", "content": "q"},
            ],
        }
    )


ENVOY = peer_metadata(b"s")  # what Envoy rendered from the same secret sends


async def route(target: str, body: bytes) -> tuple[str, str, str]:
    """Send one request as Envoy does (buffered); ``(pod key, prefix_key, cache_prefix_id)``."""
    hs = [
        (":path", "/v1/chat/completions"),
        (":method", "POST"),
        ("content-type", "application/json"),
    ]
    headers = ext_pb.ProcessingRequest(
        request_headers=ext_pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])
        )
    )
    body_msg = ext_pb.ProcessingRequest(request_body=ext_pb.HttpBody(body=body, end_of_stream=True))
    async with grpc.aio.insecure_channel(target) as channel:
        call = ext_grpc.ExternalProcessorStub(channel).Process(metadata=ENVOY)
        await call.write(headers)
        await asyncio.wait_for(call.read(), 5)
        await call.write(body_msg)
        answer = await asyncio.wait_for(call.read(), 5)
        await call.done_writing()
    common = answer.request_body.response
    sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    _, dest, pod = sets["x-ace-upstream"].split(".")
    fields = answer.dynamic_metadata.fields["ace"].struct_value.fields
    rewritten = msgspec.json.decode(common.body_mutation.body)
    return f"{dest}/{pod}", fields["prefix_key"].string_value, rewritten["cache_prefix_id"]


Scenario = Callable[[str, str, App], Awaitable[Any]]


def with_server(cfg: Config, scenario: Scenario) -> Any:
    app = build(cfg)

    async def main() -> Any:
        srv, _health = await server.start(app)
        try:
            return await scenario(cfg.settings.listen, cfg.settings.admin_listen, app)
        finally:
            await srv.stop(0)
            await app.stop()

    return asyncio.run(main())


class Ctl:
    """``ace-extproc ctl`` in process (through the CLI's ``main``), off the event loop:
    the admin server answers on the loop this test awaits on."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    async def __call__(self, admin: str, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = await asyncio.to_thread(cli.main, ["ctl", "--admin", admin, *argv])
        out, err = self.capsys.readouterr()
        return rc, out, err

    async def json(self, admin: str, *argv: str) -> Any:
        rc, out, err = await self(admin, "--json", *argv)
        assert rc == 0, err
        return json.loads(out)


@pytest.fixture
def ctl(capsys: pytest.CaptureFixture[str]) -> Ctl:
    return Ctl(capsys)


def addresses() -> tuple[str, str]:
    return f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"


# ------------------------------------------------------------------ the API


def test_pods_and_drain_stop_new_picks_until_undrained(ctl: Ctl) -> None:
    listen, admin = addresses()

    async def scenario(listen: str, admin: str, processor: App) -> None:
        rc, out, _ = await ctl(admin, "pods")
        assert rc == 0
        lines = out.splitlines()
        assert lines[0].split()[:3] == ["POD", "ADDRESS", "STATE"]
        assert [line.split()[:3] for line in lines[1:]] == [
            [f"sim/pod-{i}", f"127.0.0.1:{9001 + i}", "healthy"] for i in range(3)
        ]

        placed = {doc: (await route(listen, chat(doc)))[0] for doc in map(str, range(12))}
        counts = {pod: list(placed.values()).count(pod) for pod in set(placed.values())}
        busy = max(counts, key=lambda p: counts[p])
        warm = next(doc for doc, pod in placed.items() if pod == busy)
        before = {p["key"]: p for p in (await ctl.json(admin, "pods"))["pods"]}
        assert before[busy]["index"]["blocks_held"] > 0
        assert sum(p["load"]["inflight"] for p in before.values()) == 0  # no monitor

        rc, out, _ = await ctl(admin, "drain", busy)
        assert rc == 0 and f"{busy} drained" in out and "2 pod(s) of sim" in out
        pods = {p["key"]: p for p in (await ctl.json(admin, "pods"))["pods"]}
        assert pods[busy]["state"] == "draining"
        assert (pods[busy]["drained"], pods[busy]["healthy"], pods[busy]["available"]) == (
            True,
            True,
            False,
        )
        assert pods[busy]["index"] == before[busy]["index"]  # the index is kept
        rc, out, _ = await ctl(admin, "pods")
        assert any(line.startswith(busy) and " draining " in line for line in out.splitlines())

        # A drained pod gets no new picks: not its warm prefix, not new prefixes.
        after = [(await route(listen, chat(doc)))[0] for doc in [warm, *map(str, range(12, 30))]]
        assert busy not in after
        rc, out, _ = await ctl(admin, "drain", busy)
        assert rc == 0 and "already draining" in out

        rc, out, _ = await ctl(admin, "undrain", busy)
        assert rc == 0 and f"{busy} undrained: it takes new requests" in out
        again = [(await route(listen, chat(doc)))[0] for doc in map(str, range(30, 60))]
        assert busy in again
        rc, out, _ = await ctl(admin, "undrain", busy)
        assert rc == 0 and "was not drained" in out

    with_server(make_config(listen, admin), scenario)


def test_drain_accepts_a_pod_id_or_address_and_warns_when_none_is_left(ctl: Ctl) -> None:
    listen, admin = addresses()

    async def scenario(listen: str, admin: str, processor: App) -> None:
        resp = await ctl.json(admin, "drain", "pod-0")
        assert resp["pod"]["key"] == "sim/pod-0" and resp["changed"] is True
        assert resp["destination_available"] == 1
        rc, out, _ = await ctl(admin, "drain", "127.0.0.1:9002")
        assert rc == 0 and "sim/pod-1 drained" in out
        assert "warning: no pod of sim takes new requests" in out
        assert processor.fleet.available == 0
        # Undrained while down: still out until healthy.
        processor.fleet.set_available(0, False)
        rc, out, _ = await ctl(admin, "undrain", "sim/pod-0")
        assert rc == 0 and "but is down" in out
        assert not processor.fleet.is_available(0)
        processor.fleet.set_available(0, True)
        assert processor.fleet.is_available(0)
        # A pod that left the fleet is listed only on request.
        processor.fleet.remove_pod(1)
        assert [p["key"] for p in (await ctl.json(admin, "pods"))["pods"]] == ["sim/pod-0"]
        pods = (await ctl.json(admin, "pods", "--all"))["pods"]
        assert [(p["key"], p["state"]) for p in pods] == [
            ("sim/pod-0", "healthy"),
            ("sim/pod-1", "removed"),
        ]

    with_server(make_config(listen, admin, pods=2), scenario)


def test_lookup_by_prefix_key_and_cache_prefix_id(ctl: Ctl) -> None:
    listen, admin = addresses()

    async def scenario(listen: str, admin: str, processor: App) -> None:
        pod, key, cache_prefix_id = await route(listen, chat("lookup"))
        await route(listen, chat("lookup"))
        assert cache_prefix_id == f"ace-kv-anon-{key}"

        rc, out, _ = await ctl(admin, "lookup", key)
        assert rc == 0
        assert out.splitlines()[0].startswith(f"prefix {key}: 2 picks, the last ")
        assert [line.split() for line in out.splitlines()[2:]] == [
            [pod, processor.fleet.pods[processor.fleet.slot_of(pod)].address, "healthy", "*"]
        ]
        resp = await ctl.json(admin, "lookup", f"ace-kv-anon-{key.upper()}")
        assert (resp["found"], resp["recording"], resp["tenant"], resp["prefix_key"]) == (
            True,
            True,
            "anon",
            key,
        )
        assert resp["picks"] == 2 and [p["pod"]["key"] for p in resp["placements"]] == [pod]
        assert resp["placements"][0]["last"] is True

        rc, out, _ = await ctl(admin, "lookup", "0123456789abcdef")
        assert rc == 1 and "not routed by this server recently" in out
        rc, out, _ = await ctl(admin, "--json", "lookup", "0123456789abcdef")
        assert rc == 1 and json.loads(out)["found"] is False

    with_server(make_config(listen, admin), scenario)


def test_config_reads_back_as_the_running_configuration(ctl: Ctl) -> None:
    listen, admin = addresses()
    cfg = make_config(listen, admin, mode=parse_settings({"mode": "shadow"}).mode)

    async def scenario(listen: str, admin: str, processor: App) -> None:
        rc, out, _ = await ctl(admin, "config")
        assert rc == 0 and out.startswith(f"# ace-extproc 0.1.0, mode shadow, admin API on {admin}")
        doc = yaml.safe_load(out)
        assert parse_fleet(doc) == cfg.fleet
        settings = parse_settings(doc["router"], env={"ACE_SALT_SECRET": "s"})
        assert settings == cfg.settings
        assert "salt_secret" not in out
        resp = await ctl.json(admin, "config")
        assert (resp["mode"], resp["admin_listen"]) == ("shadow", admin)
        assert yaml.safe_load(resp["yaml"]) == doc

    with_server(cfg, scenario)


# ----------------------------------------------------------------- failures


def test_unknown_pod_and_malformed_key_are_one_line_errors(ctl: Ctl) -> None:
    listen, admin = addresses()

    async def scenario(listen: str, admin: str, processor: App) -> None:
        for argv in (["drain", "nope"], ["undrain", "sim/pod-9"]):
            rc, out, err = await ctl(admin, *argv)
            assert rc == 1 and out == ""
            assert err.startswith("error: no pod ") and err.count("\n") == 1
        rc, out, err = await ctl(admin, "lookup", "ace-kv-anon-xyz")
        assert rc == 1 and out == "" and err.count("\n") == 1
        assert "neither a prefix key" in err
        assert processor.fleet.drained == 0

    with_server(make_config(listen, admin), scenario)


def test_admin_off_listens_nowhere(ctl: Ctl) -> None:
    listen = f"127.0.0.1:{free_port()}"
    admin = f"127.0.0.1:{free_port()}"

    async def scenario(listen: str, _admin: str, processor: App) -> None:
        assert (await route(listen, chat("off")))[0].startswith("sim/")
        rc, out, err = await ctl(admin, "pods")
        assert rc == 3 and out == "" and err.count("\n") == 1
        assert err.startswith(f"error: cannot reach the ace-extproc admin API at {admin}")

    with_server(make_config(listen, "off"), scenario)


def test_unreachable_from_a_subprocess_is_one_line_without_a_traceback() -> None:
    admin = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "ace_extproc.cli", "ctl", "--admin", admin, "--timeout", "2"]
    proc = subprocess.run([*argv, "pods"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: cannot reach the ace-extproc admin API at {admin}")


def test_subprocess_ctl_against_the_running_server() -> None:
    listen, admin = addresses()

    async def run(*argv: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ace_extproc.cli", "ctl", "--admin", admin, *argv,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def scenario(listen: str, admin: str, processor: App) -> None:
        rc, out, err = await run("pods", "--json")
        assert rc == 0, err
        assert [p["key"] for p in json.loads(out)["pods"]] == [
            "sim/pod-0",
            "sim/pod-1",
            "sim/pod-2",
        ]
        rc, out, err = await run("drain", "sim/pod-2")
        assert (rc, err) == (0, "") and "sim/pod-2 drained" in out
        assert processor.fleet.is_drained(2) and not processor.fleet.is_available(2)

    with_server(make_config(listen, admin), scenario)


def _bindable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        # As a restarted server binds: a connection the server closed first leaves the
        # port in TIME_WAIT, which only a listener still there should count against.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
        return True


def test_the_admin_api_stops_with_the_server_and_serves_a_unix_socket(ctl: Ctl, tmp_path) -> None:
    listen, admin = addresses()

    async def scenario(listen: str, admin: str, processor: App) -> None:
        assert not _bindable(admin)
        rc, _, _ = await ctl(admin, "pods")
        assert rc == 0

    with_server(make_config(listen, admin), scenario)
    assert _bindable(admin)  # stopped with the ext_proc server

    sock = f"unix:{tmp_path / 'admin.sock'}"

    async def over_unix(listen: str, admin: str, processor: App) -> None:
        resp = await ctl.json(admin, "config")
        assert resp["admin_listen"] == sock

    with_server(make_config(f"127.0.0.1:{free_port()}", sock), over_unix)


def test_a_taken_admin_port_costs_only_the_admin_api(ctl: Ctl, caplog) -> None:
    first_listen, admin = addresses()
    second_listen = f"127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, "ace_extproc.admin")

    async def main() -> None:
        first, _ = await server.start(build(make_config(first_listen, admin)))
        # A second server on the same admin port must not share it (SO_REUSEPORT would
        # let the kernel hand each call to either process): it runs without one.
        second, _ = await server.start(build(make_config(second_listen, admin)))
        try:
            assert f"cannot listen on {admin}" in caplog.text
            assert (await route(second_listen, chat("taken")))[0].startswith("sim/")
            for _ in range(5):  # fresh connections all reach the first server
                resp = await ctl.json(admin, "config")
                assert yaml.safe_load(resp["yaml"])["router"]["listen"] == first_listen
        finally:
            await second.stop(0)
            await first.stop(0)

    asyncio.run(main())


# ------------------------------------------------------------------ pieces


def test_prefix_placements_are_a_bounded_lru() -> None:
    placements = PrefixPlacements(capacity=2)
    placements.note("a" * 16, 1)
    placements.note("b" * 16, 0)
    placements.note("a" * 16, 3)  # a is now the most recent
    placements.note("c" * 16, 2)  # evicts b
    assert placements.get("b" * 16) is None and len(placements) == 2
    mask, picks, last, age = placements.get("A" * 16)
    assert (mask, picks, last) == (0b1010, 2, 3) and 0 <= age < 5


def test_parse_prefix_ref() -> None:
    assert parse_prefix_ref(" 0123456789ABCDEF ") == ("", "0123456789abcdef")
    assert parse_prefix_ref("ace-kv-team-a.1-0123456789abcdef") == ("team-a.1", "0123456789abcdef")
    for bad in ("", "0123", "ace-kv--0123456789abcdef", "ace-kv-t-0123456789abcdeg", "x" * 16):
        with pytest.raises(ValueError):
            parse_prefix_ref(bad)


def test_resolve_pod_refuses_ambiguous_names() -> None:
    a = Destination("a", "vllm", "http://10.0.0.1:8000", (Pod("a", "pod-0", "10.0.0.1", 8000),))
    b = Destination("b", "vllm", "http://10.0.0.2:8000", (Pod("b", "pod-0", "10.0.0.2", 8000),))
    fleet = FleetState(Fleet((a, b)))
    assert resolve_pod(fleet, "b/pod-0") == 1
    assert resolve_pod(fleet, "10.0.0.2:8000") == 1
    with pytest.raises(Exception, match="names several pods"):
        resolve_pod(fleet, "pod-0")
    fleet.remove_pod(0)  # pods in the fleet win over pods that left
    assert resolve_pod(fleet, "pod-0") == 1


def test_admin_listen_setting() -> None:
    assert Settings().admin_listen == "127.0.0.1:9091"
    for ok in ("off", "unix:/run/ace/admin.sock", "[::1]:9091", "0.0.0.0:0"):
        assert parse_settings({"admin_listen": ok}).admin_listen == ok
    for bad in ("9091", "localhost", "unix:", "127.0.0.1:99999"):
        with pytest.raises(ConfigError, match=r"router\.admin_listen"):
            parse_settings({"admin_listen": bad})
    args = cli.build_parser().parse_args(["serve", "--admin-listen", "unix:/tmp/a.sock"])
    assert server.load_config(args).settings.admin_listen == "unix:/tmp/a.sock"


def test_drains_survive_a_restart(ctl: Ctl, tmp_path: Any) -> None:
    """router.drain_file: a drain is an operator's decision, which a restart (or the
    supervisor's restart after a crash) must not undo; nor a corrupt file stop a start."""
    drains = tmp_path / "drains.json"

    async def drain(listen: str, admin: str, processor: App) -> None:
        rc, _, err = await ctl(admin, "drain", "sim/pod-1")
        assert rc == 0, err

    async def check(listen: str, admin: str, processor: App) -> list[str]:
        pods = await ctl.json(admin, "pods")
        return [p["key"] for p in pods["pods"] if p["drained"]]

    listen, admin = addresses()
    with_server(make_config(listen, admin, drain_file=str(drains)), drain)
    assert json.loads(drains.read_text()) == {"drained": ["sim/pod-1"]}
    listen, admin = addresses()
    assert with_server(make_config(listen, admin, drain_file=str(drains)), check) == ["sim/pod-1"]

    async def undrain(listen: str, admin: str, processor: App) -> None:
        rc, _, err = await ctl(admin, "undrain", "sim/pod-1")
        assert rc == 0, err

    listen, admin = addresses()
    with_server(make_config(listen, admin, drain_file=str(drains)), undrain)
    listen, admin = addresses()
    assert with_server(make_config(listen, admin, drain_file=str(drains)), check) == []
    drains.write_text("{not json")
    listen, admin = addresses()
    assert with_server(make_config(listen, admin, drain_file=str(drains)), check) == []


def test_a_drained_pod_found_later_is_drained_as_it_joins(tmp_path: Any) -> None:
    from ace_extproc.config import Pod
    from ace_extproc.drains import DrainFile
    from ace_extproc.routing import FleetState

    path = tmp_path / "drains.json"
    path.write_text(json.dumps({"drained": ["sim/pod-7"]}))
    fleet = FleetState(sim_fleet(["127.0.0.1:9001"]))
    DrainFile(str(path), fleet).load()
    slot = fleet.add_pod(Pod("sim", "pod-7", "10.0.0.7", 8000))
    assert fleet.is_drained(slot) and not fleet.is_drained(0)
