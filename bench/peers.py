"""The routers users would pick instead of ace-extproc, started in front of engine pods.

    sglang    SGLang Model Gateway:  python -m sglang_router.launch_router ... (PyPI sglang-router)
    vllm      vLLM Router:           vllm-router ...                          (PyPI vllm-router)
    smg       Shepherd Model Gateway, the SGLang router's successor: smg launch ... (PyPI smg)
    envoy_rr  Envoy alone, its default cluster balanced ROUND_ROBIN (no ext_proc)

The peers are Rust binaries in wheels, never a runtime dependency: the package's
``bench`` extra, and ``make engines`` puts all three in ``.engines/venv``; each is looked
for next to this interpreter, then there, then on the PATH. What each needs from a worker (see
/work/shared/reference/peers.md): SGLang registers a worker once it answers ``GET /health``
(it also reads ``/get_model_info``, ``/server_info`` and warns that it has no tokenizer:
harmless, its cache_aware policy matches on characters). The vLLM router waits until every
worker answers ``GET /health`` before it listens, and its cache_aware policy calls
``POST /v1/chat/completions/render`` (or ``/v1/completions/render``) on *every* worker for
*every* request, to match on token ids. The simulated pod answers all of these.

Seen here (sglang-router 0.3.2): on a reused keep-alive connection SGLang's router delivers
a streamed answer's body ~40 ms late (its first chunk waits for the client's delayed ACK of
the headers: Nagle's algorithm on its downstream socket; curl shows it too, non-streamed
answers do not), which shows in its TTFT and latency in ``bench.live``.

``PeerStack`` is ``Stack``'s process handling (logs, readiness, stopping, children dying with
this process) for simulated pods plus one of these fronts.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import shutil
import sys
import time
from pathlib import Path

import aiohttp
import yaml

from ace_extproc import config as config_mod
from ace_extproc import envoy_config
from ace_extproc.config import Config
from ace_extproc.stack import Stack, StackError, envoy_binary
from ace_extproc.vllm_pods import engines_dir

PEERS = ("sglang", "vllm", "smg")
# The PyPI distribution of each peer: what `pip install` names and what is reported.
DISTRIBUTIONS = {"sglang": "sglang-router", "vllm": "vllm-router", "smg": "smg"}
INSTALL_HINT = "make engines, or pip install sglang-router vllm-router smg"
MODEL = "sim-llama"
PING = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}


def _engines_bin() -> Path:
    return engines_dir() / "venv" / "bin"


def _binary(name: str) -> str | None:
    # Next to this interpreter first: a venv's scripts are there even when it is not active.
    for folder in (Path(sys.executable).parent, _engines_bin()):
        if (folder / name).is_file():
            return str(folder / name)
    return shutil.which(name)


def _sglang_python() -> str | None:
    """An interpreter that has the sglang_router module: this one, else the engines'."""
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable
    engines = _engines_bin() / "python"
    if engines.exists() and list(
        engines_dir().glob("venv/lib/python*/site-packages/sglang_router")
    ):
        return str(engines)
    return None


def unavailable(name: str) -> str | None:
    """Why peer ``name`` cannot run here, or None when it can."""
    if name == "sglang":
        if _sglang_python() is None:
            return f"the sglang_router module is not installed ({INSTALL_HINT})"
        return None
    if name in ("vllm", "smg"):
        binary = "vllm-router" if name == "vllm" else "smg"
        return None if _binary(binary) else f"no {binary} executable ({INSTALL_HINT})"
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")


def version(name: str) -> str | None:
    dist = DISTRIBUTIONS[name]
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    stem = dist.replace("-", "_")
    for info in engines_dir().glob(f"venv/lib/python*/site-packages/{stem}-*.dist-info"):
        return info.name[len(stem) + 1 : -len(".dist-info")]
    return None


def peer_argv(
    name: str,
    port: int,
    metrics_port: int,
    worker_urls: list[str],
    policy: str = "cache_aware",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The command line of peer ``name`` listening on 127.0.0.1:``port``; ``extra`` are
    more flags (the peers take the same ones for what the benchmarks change)."""
    common = [
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        *extra,
    ]  # fmt: skip
    if name == "sglang":
        # No in-flight requests at shutdown: do not wait the default 180 s for them.
        tail = ["--log-level", "warn", "--shutdown-grace-period-secs", "1"]
        python = _sglang_python()
        if python is None:
            raise StackError(f"sglang: {unavailable('sglang')}")
        return [python, "-m", "sglang_router.launch_router", *common, *tail]
    if name == "vllm":
        binary = _binary("vllm-router")
        if binary is None:
            raise StackError(f"vllm: {unavailable('vllm')}")
        return [binary, *common, "--log-level", "warning"]
    if name == "smg":
        binary = _binary("smg")
        if binary is None:
            raise StackError(f"smg: {unavailable('smg')}")
        tail = ["--log-level", "warn", "--shutdown-grace-period-secs", "1"]
        return [binary, "launch", *common, *tail]
    raise ValueError(f"unknown peer {name!r}")


class PeerStack(Stack):
    """Simulated pods and a front other than ace-extproc: plain Envoy or a peer router.

    Only ``options.first_pod_port``, ``time_scale``, ``sim_args``, ``env``, ``workdir`` and
    ``startup_timeout_s`` are used; ``start()`` (the ace-extproc stack) is not."""

    async def start_pods(self, pods: int) -> Config:
        """``pods`` simulated pods on consecutive ports from ``options.first_pod_port``."""
        fleet = config_mod.default_fleet(pods, self.options.first_pod_port)
        path = self.workdir / "fleet.yaml"
        path.write_text(yaml.safe_dump(config_mod.fleet_to_dict(fleet)))
        await self._start_pods(fleet)
        return config_mod.load(path)

    async def start_plain_envoy(
        self, config: Config, listen: str, admin: str, lb_policy: str = "ROUND_ROBIN"
    ) -> str:
        """Envoy without ext_proc in front of ``config``'s pods; returns its base URL."""
        name = "envoy"
        rendered = envoy_config.render_yaml(
            config, listen=listen, admin=admin, ext_proc=False, lb_policy=lb_policy
        )
        path = self.workdir / f"{name}.yaml"
        path.write_text(rendered)
        await self._spawn(
            name, envoy_binary(), "-c", str(path), "--disable-hot-restart",
            "-l", "warning", "--concurrency", "2",
        )  # fmt: skip
        url = f"http://{listen}"
        async with aiohttp.ClientSession() as http:
            await self._wait_http(http, f"http://{admin}/ready", name)
            await self._wait_http(http, f"{url}/v1/chat/completions", name, json=PING)
        return url

    async def start_peer(
        self,
        name: str,
        port: int,
        metrics_port: int,
        worker_urls: list[str],
        policy: str = "cache_aware",
        extra: tuple[str, ...] = (),
    ) -> str:
        """Peer router ``name`` in front of ``worker_urls``; returns its base URL once a
        request has gone through it (and, for SGLang, every worker is registered)."""
        reason = unavailable(name)
        if reason:
            raise StackError(f"{name}: {reason}")
        argv = peer_argv(name, port, metrics_port, worker_urls, policy, extra)
        await self._spawn(name, *argv)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            if name in ("sglang", "smg"):
                # It listens at once and registers workers in the background.
                await self._wait_workers(http, f"{url}/readiness", name, len(worker_urls))
            else:
                await self._wait_http(http, f"{url}/health", name)
            await self._wait_http(http, f"{url}/v1/chat/completions", name, json=PING)
        return url

    async def _wait_workers(
        self, http: aiohttp.ClientSession, url: str, what: str, count: int
    ) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    body = await resp.json(content_type=None) if resp.status == 200 else {}
                    healthy = body.get("healthy_workers") if isinstance(body, dict) else None
                    if healthy == count:
                        return
                    last = f"HTTP {resp.status}, healthy_workers={healthy}"
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.1)
        raise StackError(
            f"{what}: {count} workers not ready at {url} ({last}); logs in {self.workdir}"
        )

    async def stop(self) -> None:
        # The fronts first (no new requests reach the pods), then Stack's order.
        for name in PEERS:
            await self.stop_process(name)
        await super().stop()
