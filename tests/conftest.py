import asyncio
import contextlib
import importlib
import os
import random
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

if TYPE_CHECKING:
    from ace_extproc.app import App
    from ace_extproc.config import Config
    from ace_extproc.processor import Processor
    from ace_extproc.routing.policies import PolicyFactory
    from ace_extproc.stack import Stack

# gRPC's fork handlers restart its threads in each child this process forks, and a
# child that then closes its inherited descriptors before exec (as subprocess does)
# can abort in gRPC's poller ("epoll_wait error: Bad file descriptor", SIGABRT). The
# tests use gRPC in process and then fork servers and pods; no forked child uses
# gRPC before exec, so they run without fork support. Set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def peer_metadata(salt_secret: bytes) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata Envoy sends on each ext_proc stream (peer.py), for a server
    configured with ``salt_secret``: a test client standing in for Envoy needs it."""
    from ace_extproc import peer
    from ace_extproc.config import Settings

    token = peer.token(Settings(salt_secret=salt_secret))
    assert token is not None
    return ((peer.METADATA_KEY, token),)


def put_fields(fields: Any, values: dict[str, str | float]) -> None:
    """``values`` into a protobuf Struct's ``fields`` (dynamic metadata), as Envoy
    forwards the ``ace`` namespace."""
    for key, value in values.items():
        if isinstance(value, str):
            fields[key].string_value = value
        else:
            fields[key].number_value = value


def free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture
def port() -> int:
    return free_port()


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_handed_out: set[int] = set()


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free ports below Linux's ephemeral range (32768+), so that no
    outgoing connection can take one between this check and the server binding it,
    and none handed out before in this run (two calls before either binds would
    otherwise be able to get the same one)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        ports = range(base, base + n)
        if _handed_out.isdisjoint(ports) and all(_is_free(p) for p in ports):
            _handed_out.update(ports)
            return list(ports)
    raise RuntimeError("no free ports")


def children(pid: int) -> set[int]:
    """All descendants of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def memory_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's memory from /proc: ``VmRSS`` now, ``VmHWM`` its peak."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def up_command(pods: int = 2, *extra: str) -> tuple[str, list[str], dict[str, str]]:
    """``ace-extproc up`` on free ports: its listen address, argv and environment."""
    ports = free_ports(pods + 3)
    listen = f"127.0.0.1:{ports[pods]}"
    argv = [
        sys.executable, "-m", "ace_extproc.cli", "up", "--pods", str(pods),
        "--listen", listen, "--admin", f"127.0.0.1:{ports[pods + 1]}",
        "--ext-proc", f"127.0.0.1:{ports[pods + 2]}", "--time-scale", "0.001", *extra,
    ]  # fmt: skip
    return listen, argv, {**os.environ, "ACE_STACK_FIRST_POD_PORT": str(ports[0])}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def make_app(
    config: "Config", picker: "PolicyFactory | None" = None, *, watch: bool = False
) -> "App":
    """The composition root's parts for ``config``; without ``watch``, as a process with
    no probes builds them (no monitor, so no load accounting: a test sets load itself)."""
    from msgspec.structs import replace

    from ace_extproc.app import build
    from ace_extproc.config import Config

    if not watch:
        config = Config(config.fleet, replace(config.settings, probe_interval_s=0))
    return build(config, picker)


def make_processor(config: "Config", picker: "PolicyFactory | None" = None) -> "Processor":
    """``make_app(config, picker).processor``: the decision alone."""
    return make_app(config, picker).processor


def load_speedups() -> ModuleType:
    """The C extension. A pure-Python build opts out explicitly
    (``ACE_EXTPROC_PURE_PYTHON=1``: its tests skip); anywhere else a missing
    extension fails, so CI cannot silently lose it."""
    if os.environ.get("ACE_EXTPROC_PURE_PYTHON") == "1":
        # Even where the extension was built: the request path runs without it.
        pytest.skip("ACE_EXTPROC_PURE_PYTHON=1: the native code is off", allow_module_level=True)
    return importlib.import_module("ace_extproc.native._speedups")


def envoy_validate(path: Path) -> None:
    """The real Envoy's ``--mode validate`` accepts the bootstrap at ``path``."""
    from ace_extproc.stack import envoy_binary

    proc = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"envoy rejected {path.name}:\n{proc.stdout}{proc.stderr}"


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """``app`` served on a free local port, yielded, until the block ends."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def running_stack(stack: "Stack") -> Iterator[asyncio.AbstractEventLoop]:
    """A started stack (``ace-extproc up``'s) and the event loop that drives it; every
    process it started stopped after."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(stack.start())
        yield loop
    finally:
        loop.run_until_complete(stack.stop())
        loop.close()


# The bytes the in-process simulated pods wrote: what a client must get through Envoy.
SENT = web.RequestKey("sent", list)


@dataclass
class Sent:
    """What each simulated pod wrote back, per response, in order."""

    by_pod: dict[str, list[bytes]] = field(default_factory=dict)
    _open: dict[int, list[bytes]] = field(default_factory=dict)

    def middleware(self, pod_id: str) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def capture(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            request[SENT] = chunks = []
            resp = await handler(request)
            if isinstance(resp, web.Response) and resp.body is not None:
                assert isinstance(resp.body, bytes)
                chunks.append(resp.body)
            if request.path.startswith("/v1/"):
                self.by_pod.setdefault(pod_id, []).append(b"".join(chunks))
            return resp

        return capture


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    """Records every streamed write of the in-process pods (aiohttp's
    ``StreamResponse.write``) under the request being answered."""
    record = Sent()
    original = web.StreamResponse.write

    async def write(self: web.StreamResponse, data: Any) -> None:
        req = getattr(self, "_req", None)
        if req is not None and SENT in req:
            req[SENT].append(bytes(data))
        await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    return record
