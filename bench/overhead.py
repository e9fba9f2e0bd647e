"""Gateway overhead: the latency and throughput cost of Envoy + ext_proc, per variant.

    python -m bench.overhead [--requests 2000] [--rounds 10] [--duration 3]
                             [--sizes 16384,225280] [--variants direct,trivial,...|all]
                             [--connections 32] [--connections-by-size 225280=150]
                             [--rates 16384=200,400,700,1000 --rates 225280=50,100,150,200]

All variants run at once, each on its own ports, in front of the same single simulated
engine pod (no sleeping, one output token):
  direct           client -> Envoy -> engine, no ext_proc filter: the baseline
  trivial          + bench/trivial_extproc.py: the floor for a Python ext_proc doing
                   the same exchanges (headers SEND, body BUFFERED, body rewritten)
  ace-buffered     + ace-extproc, buffered body (2 exchanges), as shipped: each
                   response reported on Envoy's gRPC access log (batched, one stream
                   per Envoy worker)
  ace-no-observe   the same without observing responses: what observing costs
  ace-observe-stream  the same observing as before the access log: an observe-only
                   ext_proc filter, a second stream per request (response headers,
                   not waited on)
  ace-pure-python  ace-buffered on the pure-Python path (ACE_EXTPROC_PURE_PYTHON=1):
                   what the C fast path saves end to end
  ace-full-duplex  + ace-extproc, FULL_DUPLEX_STREAMED body (1 round trip)
  ace-precise      ace-buffered with precise routing: the pod publishes KV events, the
                   server tokenizes each body with a real tokenizer (docs/kv-events.md)
  sglang           client -> SGLang Model Gateway -> engine (no Envoy), --peer-policy
  vllm             client -> vLLM Router -> engine (no Envoy); its cache_aware policy
                   also POSTs every body to the engine's render endpoint first
The default is the eight Envoy variants; ``--variants all`` adds the peers that are
installed (``bench/peers.py``), a peer named but not installed is skipped with the reason.
For the peers, the "envoy" CPU column is the peer router's process (the proxy).

Three phases, in each of which the variants take turns (order alternating) so that
machine noise hits all alike; "added" (+) is variant minus direct in the same phase:
1. Latency: sequential keep-alive requests from one aiohttp client, in rounds.
   ``--requests`` is per variant at 16 KB; larger bodies get proportionally fewer (at
   least 500).
2. Fixed concurrency: requests/s and latency p50/p99 at ``--connections`` (per body size
   with ``--connections-by-size``; default 150 for the 220 KB body), with wrk when it is
   installed (a Python client would saturate a core itself), else aiohttp.
3. Fixed rates (open loop): for each body size given in ``--rates``, requests dispatched
   on a fixed schedule for ``--rate-duration`` s by an asyncio client, each its own task,
   whatever the answers do (Debian's wrk has no -R), so a gateway that falls behind shows
   as latency (no coordinated omission). Latency counts from the dispatch (timers have
   1 ms resolution; the worst lag of a dispatch behind schedule is reported). A rate is
   *sustained* when no request fails, at least 90% of the rate is answered, and p99 stays
   within ``--p99-bound-ms`` (default 100 ms); a variant that could not keep up with a
   rate (< 90% answered) is not tried at higher ones. Reported: p50/p99 and added p50/p99
   per rate, and the highest rate sustained. Each variant's series starts with an
   unrecorded 0.5 s at the first rate, and each fixed-concurrency run with an unrecorded
   1 s at the same concurrency (filling connection pools, which a cold start under 150
   concurrent 220 KB requests otherwise overflows).
The peers run with ``--disable-circuit-breaker``: with one engine there is nothing to fail
over to, and an open breaker would fail the following phases too (Envoy's clusters have no
outlier detection either).
CPU: utime+stime per request of the ext_proc server, the proxy and the engine, from /proc,
in phases 1 and 2. Writes bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import uvloop
import yaml

from ace_extproc import config as config_mod
from ace_extproc import envoy_config, native
from ace_extproc.config import Config
from ace_extproc.stack import TRACE_HEADER, StackError, StackOptions, envoy_binary
from bench import peers, tokenize_cost

# (ext_proc server, processing mode, how responses are observed) per Envoy variant: the
# default set. ace as shipped observes on Envoy's access log ("access-log", batched);
# "stream" is the observe-only filter it replaced (a second stream a request), "off"
# neither. The trivial floor has the routing exchange only.
VARIANTS: dict[str, tuple[str | None, str, str]] = {
    "direct": (None, "buffered", "off"),
    "trivial": ("trivial", "buffered", "off"),
    "ace-buffered": ("ace", "buffered", "access-log"),
    "ace-no-observe": ("ace", "buffered", "off"),
    "ace-observe-stream": ("ace", "buffered", "stream"),
    "ace-pure-python": ("ace-pure", "buffered", "access-log"),
    "ace-full-duplex": ("ace", "full_duplex", "access-log"),
    # Precise routing: the pod publishes KV events and the server follows them with a
    # real tokenizer (the tiny engine model's, else one trained for the tests), so each
    # request is rendered, tokenized (the same body: its pieces cached) and keyed.
    "ace-precise": ("ace-precise", "buffered", "access-log"),
}
# ace-buffered with one native piece on Python instead (``native/__init__.py``): what
# that piece saves end to end. Named by ``--variants``, not in the default set.
ABLATIONS: dict[str, tuple[str | None, str, str]] = {
    f"ace-without-{piece}": (f"ace-without-{piece}", "buffered", "access-log")
    for piece in native.PIECES
}
ENVOY_VARIANTS = {**VARIANTS, **ABLATIONS}
# Peer routers in front of the same engine, without Envoy: named by ``--variants``.
ALL_VARIANTS = (*VARIANTS, *peers.PEERS, *ABLATIONS)
# Defaults of the loaded phases: the 220 KB body at concurrency 150; open-loop rates.
CONNECTIONS_BY_SIZE = {225280: 150}
RATES = {16384: [200, 400, 700, 1000], 225280: [50, 100, 150, 200]}
RATE_CONNECTIONS = 512  # the open-loop client's connection pool
RATE_WARMUP_S = 0.5  # unrecorded, at a size's first rate, before each variant's series
LOAD_WARMUP_S = 1  # unrecorded, at the same concurrency, before each fixed-concurrency run
REQUEST_TIMEOUT_S = 10
# One engine: a peer's circuit breaker has nothing to fail over to, and once open it fails
# every request of the following phases fast. Envoy's clusters have no outlier detection
# and circuit breakers far above these loads, so this keeps the comparison like for like.
PEER_FLAGS = ("--disable-circuit-breaker",)
# Two workers, as `ace-extproc up` runs Envoy: one per core of the 2-core bench machine.
ENVOY_CONCURRENCY = 2
MODEL = "sim-llama"
PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}
WARMUP = 30  # unrecorded requests per variant and size before the rounds
TRIVIAL = Path(__file__).with_name("trivial_extproc.py")
# wrk cannot POST a file; this script loads the body and prints a parseable summary.
WRK_LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = io.open([[{body}]], "rb"):read("*a")
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.status, e.connect + e.read + e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------ inputs


def chat_body(size: int) -> bytes:
    """A chat request of exactly ``size`` bytes: a long system prompt and a question."""
    rng = random.Random(size)
    vocab = ["the", "cache", "prefix", "router", "token", "engine", "pod", "latency", "block"]

    def encode(system: str) -> bytes:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Which pod holds this prefix warm?"},
        ]
        return msgspec.json.encode({"model": MODEL, "max_tokens": 1, "messages": messages})

    room = size - len(encode(""))
    words: list[str] = []
    length = -1
    while length < room:
        words.append(rng.choice(vocab))
        length += len(words[-1]) + 1
    return encode(" ".join(words)[:room])


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free ports below Linux's ephemeral range (32768+), so no
    outgoing connection takes one before its server binds it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return list(range(base, base + n))
    raise BenchError("no free ports")


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The Prometheus series ``names`` in ``text``, each summed over its label sets."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in out:
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            rest = rest[rest.index("}") + 1 :]
        out[name] += float(rest.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ processes


# Processes whose CPU time is counted, in the order of Variant.cpu().
PROCS = ("ext_proc", "envoy", "engine")


@dataclass
class Variant:
    name: str
    url: str
    admin: str | None  # Envoy's admin address; None for a peer router (no Envoy)
    server_pid: int | None
    envoy_pid: int  # the proxy: Envoy, or the peer router
    engine_pid: int
    engine_url: str = ""

    def cpu(self) -> list[float]:
        """CPU seconds so far of each of PROCS."""
        server = cpu_s(self.server_pid) if self.server_pid else 0.0
        return [server, cpu_s(self.envoy_pid), cpu_s(self.engine_pid)]

    async def counter(self, http: aiohttp.ClientSession, pattern: str) -> int:
        """The sum of Envoy's stats whose names match the regex ``pattern`` (0 without
        Envoy)."""
        if self.admin is None:
            return 0
        params = {"format": "json", "filter": pattern}
        async with http.get(f"http://{self.admin}/stats", params=params) as resp:
            stats = (await resp.json())["stats"]
        return sum(int(s.get("value", 0)) for s in stats)

    async def received(self, http: aiohttp.ClientSession) -> int:
        """Requests Envoy has taken in, once those in flight have finished (or been
        cut by the client): the engine and the ext_proc spent CPU on all of them.
        Without Envoy (a peer router): requests the engine has finished."""
        if self.admin is None:
            return await self._engine_finished(http)
        for _ in range(100):
            if not await self.counter(http, r"^http\.ace_ingress\.downstream_rq_active$"):
                break
            await asyncio.sleep(0.1)
        return await self.counter(http, r"^http\.ace_ingress\.downstream_rq_total$")

    async def _engine_finished(self, http: aiohttp.ClientSession) -> int:
        names = (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:request_success_total",
        )
        for _ in range(100):
            async with http.get(f"{self.engine_url}/metrics") as resp:
                values = metric_sums(await resp.text(), names)
            if not values[names[0]] + values[names[1]]:
                break
            await asyncio.sleep(0.1)
        return int(values[names[2]])


class Bench(peers.PeerStack):
    """Stack's process handling (logs, readiness, stop on exit) for one engine pod and,
    per variant, an Envoy with or without an ext_proc server, or a peer router."""

    # Per variant that observes by access log: Envoy's entries written and dropped.
    access_log: dict[str, dict[str, int]]

    async def start_pod(self) -> Config:
        # One pod: trivial pins it, ace-extproc picks it (the only one), direct balances
        # onto it, so every variant hands the same engine process the same work.
        fleet = config_mod.default_fleet(1, self.options.first_pod_port)
        # The pod publishes its KV events (for ace-precise; the others ignore them).
        fleet = self._publishing(fleet)
        path = self.workdir / "fleet.yaml"
        doc = config_mod.fleet_to_dict(fleet)
        del doc["destinations"][0]["tokenizer"]  # approximate, as shipped
        path.write_text(yaml.safe_dump(doc))
        doc["destinations"][0]["tokenizer"] = str(tokenize_cost.model_dir(None))
        (self.workdir / "fleet-precise.yaml").write_text(yaml.safe_dump(doc))
        await self._start_pods(fleet)
        # As the servers will read it: their environment is ours plus the options'.
        return config_mod.load(path, env={**os.environ, **self.options.env})

    async def start_variant(
        self, name: str, config: Config, ports: list[int], peer_policy: str = "cache_aware"
    ) -> Variant:
        pod = config.fleet.pods[0]
        if name in peers.PEERS:
            base = await self.start_peer(
                name, ports[0], ports[1], [pod.base_url], peer_policy, PEER_FLAGS
            )
            return Variant(
                name,
                f"{base}{PATH}",
                None,
                None,
                self.procs[name].pid,
                self.procs[pod.id].pid,
                pod.base_url,
            )
        server, mode, observe = ENVOY_VARIANTS[name]
        listen, admin, grpc_addr = (f"127.0.0.1:{p}" for p in ports)
        if server == "trivial":
            argv = [str(TRIVIAL), "--listen", grpc_addr, "--cluster", pod.cluster]
            await self._spawn(f"{name}-server", sys.executable, *argv, "--served-by", pod.key)
        elif server is not None and server.startswith("ace"):
            name_ = "fleet-precise.yaml" if server == "ace-precise" else "fleet.yaml"
            fleet = str(self.workdir / name_)
            argv = ["-m", "ace_extproc.cli", "serve", "--fleet", fleet, "--listen", grpc_addr]
            argv += ["--metrics-listen", "off", "--admin-listen", "off"]  # several variants
            # env execs the server in its own place: the pid measured is the server's.
            pure = ["env", "ACE_EXTPROC_PURE_PYTHON=1"] if server == "ace-pure" else []
            if server.startswith("ace-without-"):
                kept = [p for p in native.PIECES if p != server.removeprefix("ace-without-")]
                pure = ["env", f"ACE_EXTPROC_NATIVE={','.join(kept)}"]
            await self._spawn(f"{name}-server", *pure, sys.executable, *argv)
        if server:
            await self._wait_tcp(f"{name}-server", "127.0.0.1", ports[2])
        # The ext_proc cluster is rendered from settings.listen.
        settings = msgspec.structs.replace(
            config.settings, listen=grpc_addr, observe_responses=observe != "off"
        )
        cfg = replace(config, settings=settings)
        doc = envoy_config.render(
            cfg, listen=listen, admin=admin, processing_mode=mode, ext_proc=server is not None
        )
        if observe == "stream":
            observe_by_stream(doc, settings)
        path = self.workdir / f"envoy-{name}.yaml"
        path.write_text(json.dumps(doc, indent=1))  # JSON is YAML to Envoy
        await self._spawn(
            f"envoy-{name}", envoy_binary(), "-c", str(path), "--disable-hot-restart",
            "-l", "warning", "--concurrency", str(ENVOY_CONCURRENCY),
        )  # fmt: skip
        url = f"http://{listen}{PATH}"
        async with aiohttp.ClientSession() as http:
            await self._wait_http(http, f"http://{admin}/ready", f"envoy-{name}")
            # The response header comes from the ext_proc's metadata: proof it took part.
            ping = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}],
            }
            await self._wait_http(
                http, url, name, json=ping, header=TRACE_HEADER if server else None
            )
        server_proc = self.procs.get(f"{name}-server")
        return Variant(
            name,
            url,
            admin,
            server_proc.pid if server_proc else None,
            self.procs[f"envoy-{name}"].pid,
            self.procs[pod.id].pid,
            pod.base_url,
        )


def observe_by_stream(doc: dict[str, Any], settings: config_mod.Settings) -> None:
    """``doc`` (a rendered bootstrap) observing responses as before the access log: the
    observe-only ext_proc filter after the routing one, response headers only, with the
    attributes it asked for then; no access log to ace-extproc."""
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm = hcm["typed_config"]
    hcm["access_log"] = [
        log for log in hcm["access_log"] if log["name"] != "envoy.access_loggers.http_grpc"
    ]
    legacy = envoy_config._observe_filter(msgspec.structs.replace(settings, usage_capture=False))
    legacy["typed_config"]["response_attributes"] = [
        "upstream.address",
        "response.code",
        "response.flags",
    ]
    hcm["http_filters"].insert(1, legacy)


# ------------------------------------------------------------------ clients


async def sequential(http: aiohttp.ClientSession, url: str, body: bytes, n: int) -> list[float]:
    """End-to-end milliseconds of ``n`` requests, one after another on one connection."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        async with http.post(url, data=body, headers=HEADERS) as resp:
            await resp.read()
        out.append((clock() - start) / 1e6)
        if resp.status != 200:
            raise BenchError(f"{url}: HTTP {resp.status}")
    return out


@dataclass
class Load:
    """What one fixed-concurrency run measured."""

    requests: int  # answered 2xx
    seconds: float
    errors: int  # non-2xx answers and timeouts
    p50_ms: float | None
    p99_ms: float | None
    timeouts: int = 0  # of the errors: no answer within REQUEST_TIMEOUT_S


async def load_wrk(url: str, script: Path, connections: int, duration: int) -> Load:
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", f"{REQUEST_TIMEOUT_S}s",
        "-s", str(script), url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out = (await proc.communicate())[0].decode(errors="replace")
    line = next((x for x in out.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise BenchError(f"wrk failed on {url}:\n{out}")
    requests, duration_us, status_errors, _socket_errors, timeouts, p50_us, p99_us = map(
        int, line.split()[1:]
    )
    # Socket errors are expected: wrk cuts connections when time is up.
    return Load(
        requests - status_errors,
        duration_us / 1e6,
        status_errors + timeouts,
        p50_us / 1e3 if requests else None,
        p99_us / 1e3 if requests else None,
        timeouts,
    )


async def _answered(http: aiohttp.ClientSession, url: str, body: bytes) -> bool:
    """POST ``body``; True when it came back 200 (errors and timeouts are False)."""
    try:
        async with http.post(url, data=body, headers=HEADERS) as resp:
            await resp.read()
        return resp.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def load_aiohttp(url: str, body: bytes, connections: int, duration: int) -> Load:
    latencies: list[float] = []
    errors = 0
    start = time.monotonic()
    deadline = start + duration
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def worker() -> None:  # stops issuing at the deadline; none is cut
            nonlocal errors
            while time.monotonic() < deadline:
                sent = time.perf_counter()
                if await _answered(http, url, body):
                    latencies.append((time.perf_counter() - sent) * 1e3)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(connections)))
    elapsed = time.monotonic() - start
    p50 = percentile(latencies, 0.50) if latencies else None
    p99 = percentile(latencies, 0.99) if latencies else None
    return Load(len(latencies), elapsed, errors, p50, p99)


@dataclass
class RateRun:
    """One open-loop run at a fixed rate."""

    rate: float
    sent: int
    latencies_ms: list[float]  # of the answered requests, from when each was dispatched
    errors: int  # non-200 answers, connection errors and timeouts
    seconds: float  # from the first scheduled send to the last answer
    client_lag_ms: float  # worst delay of a dispatch behind its schedule (the client's lag)

    def achieved(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds > 0 else 0.0

    def sustained(self, p99_bound_ms: float) -> bool:
        return (
            self.errors == 0
            and self.achieved() >= 0.9 * self.rate
            and bool(self.latencies_ms)
            and percentile(self.latencies_ms, 0.99) <= p99_bound_ms
        )


async def open_loop(
    http: aiohttp.ClientSession, url: str, body: bytes, rate: float, duration: float
) -> RateRun:
    """Send ``rate`` requests a second for ``duration`` seconds on a fixed schedule,
    whether or not earlier ones have been answered."""
    clock = time.perf_counter  # uvloop's loop.time() has a 1 ms resolution
    n = max(1, round(rate * duration))
    latencies: list[float] = []
    errors = 0
    lag = 0.0

    async def one(dispatched: float) -> None:
        nonlocal errors
        if await _answered(http, url, body):
            latencies.append((clock() - dispatched) * 1e3)
        else:
            errors += 1

    start = clock() + 0.01
    tasks = []
    for i in range(n):
        scheduled = start + i / rate
        delay = scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        dispatched = clock()
        lag = max(lag, dispatched - scheduled)
        tasks.append(asyncio.create_task(one(dispatched)))
    await asyncio.gather(*tasks)
    return RateRun(rate, n, latencies, errors, clock() - start, lag * 1e3)


# ------------------------------------------------------------------ measuring


@dataclass
class Cell:
    """One variant at one body size."""

    latencies_ms: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=lambda: [0.0] * len(PROCS))
    load_requests: int = 0  # answered in load_s (the throughput)
    load_s: float = 0.0
    load_received: int = 0  # taken in by Envoy, incl. those cut at the end (for CPU)
    load_cpu_s: list[float] = field(default_factory=lambda: [0.0] * len(PROCS))
    load_connections: int = 0
    load_errors: int = 0
    load_timeouts: int = 0
    load_p50_ms: float | None = None
    load_p99_ms: float | None = None
    rates: list[RateRun] = field(default_factory=list)  # ascending; stops at the first failure
    unanswered: int = 0  # passed on without the ext_proc's answer (the figures flatter it)


def _add_cpu(total: list[float], before: list[float], after: list[float]) -> None:
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        total[i] += a - b


def requests_for(requests: int, size: int) -> int:
    # Bodies above 16 KB get proportionally fewer requests (the engine's own time grows
    # with the body), but never under 500, so that p99 still rests on a few samples.
    return min(requests, max(500, requests * 16384 // size))


async def latency_phase(
    args: argparse.Namespace,
    variants: list[Variant],
    bodies: dict[int, bytes],
    cells: dict[tuple[str, int], Cell],
) -> None:
    sessions = {
        v.name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for v in variants
    }
    try:
        for v in variants:
            for size in args.sizes:
                await sequential(sessions[v.name], v.url, bodies[size], WARMUP)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for size in args.sizes:
                n = -(-requests_for(args.requests, size) // args.rounds)
                for v in order:
                    cell = cells[v.name, size]
                    before = v.cpu()
                    cell.latencies_ms += await sequential(sessions[v.name], v.url, bodies[size], n)
                    _add_cpu(cell.cpu_s, before, v.cpu())
    finally:
        for s in sessions.values():
            await s.close()


async def load_phase(
    args: argparse.Namespace,
    variants: list[Variant],
    bodies: dict[int, bytes],
    cells: dict[tuple[str, int], Cell],
    workdir: Path,
) -> None:
    async with aiohttp.ClientSession() as http:
        for i, size in enumerate(args.sizes):
            script = workdir / f"post-{size}.lua"
            body_path = workdir / f"body-{size}.json"
            body_path.write_bytes(bodies[size])
            script.write_text(WRK_LUA.format(body=body_path))
            connections = args.connections_by_size.get(size, args.connections)
            for v in variants if i % 2 == 0 else variants[::-1]:
                cell = cells[v.name, size]
                if args.load_client == "wrk":  # fills the proxy's upstream connection pool
                    await load_wrk(v.url, script, connections, LOAD_WARMUP_S)
                else:
                    await load_aiohttp(v.url, bodies[size], connections, LOAD_WARMUP_S)
                before, received = v.cpu(), await v.received(http)
                if args.load_client == "wrk":
                    load = await load_wrk(v.url, script, connections, args.duration)
                else:
                    load = await load_aiohttp(v.url, bodies[size], connections, args.duration)
                cell.load_received = await v.received(http) - received
                _add_cpu(cell.load_cpu_s, before, v.cpu())
                cell.load_requests, cell.load_s = load.requests, load.seconds
                cell.load_connections, cell.load_errors = connections, load.errors
                cell.load_timeouts = load.timeouts
                cell.load_p50_ms, cell.load_p99_ms = load.p50_ms, load.p99_ms


async def rate_phase(
    args: argparse.Namespace,
    variants: list[Variant],
    bodies: dict[int, bytes],
    cells: dict[tuple[str, int], Cell],
) -> None:
    """Open-loop runs at each rate of ``args.rates`` (ascending), variants interleaved; a
    variant that could not keep up with a rate (< 90% answered) is not tried higher."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    sessions = {
        v.name: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=RATE_CONNECTIONS), timeout=timeout
        )
        for v in variants
    }
    try:
        for size in args.sizes:
            rates = sorted(args.rates.get(size, []))
            for v in variants if rates else []:  # opens the client's connections
                await open_loop(sessions[v.name], v.url, bodies[size], rates[0], RATE_WARMUP_S)
            keeping_up = {v.name for v in variants}
            for j, rate in enumerate(rates):
                for v in variants if j % 2 == 0 else variants[::-1]:
                    if v.name not in keeping_up:
                        continue
                    run = await open_loop(
                        sessions[v.name], v.url, bodies[size], rate, args.rate_duration
                    )
                    cells[v.name, size].rates.append(run)
                    if run.achieved() < 0.9 * rate:
                        keeping_up.discard(v.name)
    finally:
        for s in sessions.values():
            await s.close()


async def check_ext_proc_answers(
    variants: list[Variant],
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Requests each variant passed on without the ext_proc's answer (fail-open on an
    error or a timeout, a rejected mutation): they make a variant look faster than it
    is, so the report marks the variant rather than the whole run being lost; and the
    access-log entries each variant's Envoy wrote and dropped."""
    unanswered: dict[str, int] = {}
    access_log: dict[str, dict[str, int]] = {}
    async with aiohttp.ClientSession() as http:
        for v in variants:
            pattern = r"ext_proc\..*(failure_mode_allowed|rejected_header_mutations)$"
            if failed := await v.counter(http, pattern):
                print(f"warning: {v.name}: {failed} requests skipped the ext_proc's answer")
                unanswered[v.name] = failed
            if ENVOY_VARIANTS.get(v.name, (None, "", ""))[2] != "access-log":
                continue
            # Envoy drops entries where its stream to ace-extproc is backed up (a saturated
            # server): those cost the server nothing, so they are reported with the figures.
            written = await v.counter(http, r"^access_logs\.grpc_access_log\.logs_written$")
            dropped = await v.counter(http, r"^access_logs\.grpc_access_log\.logs_dropped$")
            if not written:
                raise BenchError(f"{v.name}: Envoy wrote no access log to ace-extproc")
            access_log[v.name] = {"written": written, "dropped": dropped}
    return unanswered, access_log


async def measure(args: argparse.Namespace, bench: Bench) -> dict[tuple[str, int], Cell]:
    config = await bench.start_pod()
    ports = free_ports(3 * len(args.variants))
    variants = [
        await bench.start_variant(name, config, ports[3 * i : 3 * i + 3], args.peer_policy)
        for i, name in enumerate(args.variants)
    ]
    bodies = {size: chat_body(size) for size in args.sizes}
    cells = {(v.name, size): Cell() for v in variants for size in args.sizes}
    await latency_phase(args, variants, bodies, cells)
    await load_phase(args, variants, bodies, cells, bench.workdir)
    await rate_phase(args, variants, bodies, cells)
    unanswered, bench.access_log = await check_ext_proc_answers(variants)
    for name, failed in unanswered.items():
        for size in args.sizes:
            cells[name, size].unanswered = failed  # counted for the run, not per size
    return cells


# ------------------------------------------------------------------ report


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _per_request_us(cpu: list[float], requests: int, has_server: bool) -> dict[str, Any]:
    per_req = [round(c / max(requests, 1) * 1e6, 1) for c in cpu]
    out: dict[str, Any] = dict(zip(PROCS, per_req, strict=True))
    if not has_server:
        out["ext_proc"] = None
    return out


def summarize(args: argparse.Namespace, cells: dict[tuple[str, int], Cell]) -> dict[str, Any]:
    variants: dict[str, Any] = {}
    for name in args.variants:
        has_server = name in ENVOY_VARIANTS and ENVOY_VARIANTS[name][0] is not None
        per_size: dict[str, Any] = {}
        for size in args.sizes:
            c = cells[name, size]
            base = cells.get(("direct", size))
            row: dict[str, Any] = {
                "p50_ms": round(percentile(c.latencies_ms, 0.50), 3),
                "p99_ms": round(percentile(c.latencies_ms, 0.99), 3),
                "added_p50_ms": None,
                "added_p99_ms": None,
                "rps": round(c.load_requests / c.load_s, 1),
                "requests": len(c.latencies_ms),
                "load_requests": c.load_requests,
                "cpu_us_per_req": _per_request_us(c.cpu_s, len(c.latencies_ms), has_server),
                "cpu_us_per_req_loaded": _per_request_us(c.load_cpu_s, c.load_received, has_server),
            }
            if base is not None:
                for q, key in ((0.50, "added_p50_ms"), (0.99, "added_p99_ms")):
                    added = percentile(c.latencies_ms, q) - percentile(base.latencies_ms, q)
                    row[key] = round(added, 3)
            row.update(_loaded(c, base))
            row["rates"] = [_rate_row(run, base, args.p99_bound_ms) for run in c.rates]
            sustained = [run.rate for run in c.rates if run.sustained(args.p99_bound_ms)]
            row["max_sustained_rps"] = max(sustained) if sustained else None
            per_size[str(size)] = row
        variants[name] = {"body_bytes": per_size}
    return variants


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _loaded(c: Cell, base: Cell | None) -> dict[str, Any]:
    """The fixed-concurrency phase's latency, and what it adds to direct's."""
    return {
        "load_connections": c.load_connections,
        "load_errors": c.load_errors,
        "load_timeouts": c.load_timeouts,
        "unanswered": c.unanswered,
        "load_p50_ms": _round(c.load_p50_ms),
        "load_p99_ms": _round(c.load_p99_ms),
        "load_added_p50_ms": _minus(c.load_p50_ms, base.load_p50_ms) if base else None,
        "load_added_p99_ms": _minus(c.load_p99_ms, base.load_p99_ms) if base else None,
    }


def _rate_row(run: RateRun, base: Cell | None, p99_bound_ms: float) -> dict[str, Any]:
    lat = run.latencies_ms
    p50 = percentile(lat, 0.50) if lat else None
    p99 = percentile(lat, 0.99) if lat else None
    direct = next((r for r in base.rates if r.rate == run.rate), None) if base else None
    d50 = percentile(direct.latencies_ms, 0.50) if direct and direct.latencies_ms else None
    d99 = percentile(direct.latencies_ms, 0.99) if direct and direct.latencies_ms else None
    return {
        "rate": run.rate,
        "sent": run.sent,
        "answered": len(lat),
        "errors": run.errors,
        "achieved_rps": round(run.achieved(), 1),
        "p50_ms": _round(p50),
        "p99_ms": _round(p99),
        "added_p50_ms": _minus(p50, d50),
        "added_p99_ms": _minus(p99, d99),
        "client_lag_ms": round(run.client_lag_ms, 1),
        "sustained": run.sustained(p99_bound_ms),
    }


def _num(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_table(args: argparse.Namespace, variants: dict[str, Any]) -> None:
    print(
        f"\nEnvoy --concurrency {ENVOY_CONCURRENCY}. Latency: sequential keep-alive requests "
        f"(aiohttp), {args.rounds} alternating rounds; +: minus direct. Throughput: "
        f"{args.load_client}, {args.duration} s at the fixed concurrency of each size "
        "(below). CPU: us per request; for sglang/vllm the envoy column is the peer router."
    )
    cpu_head = "".join(f"{p:>9}" for p in PROCS)
    for size in args.sizes:
        title = f"body {size} bytes"
        print(f"\n{title:<64}{'CPU, sequential':>27}  {'CPU, loaded':>27}")
        print(
            f"{'variant':<20}{'p50 ms':>8}{'p99 ms':>8}{'+p50 ms':>9}{'+p99 ms':>9}"
            f"{'req/s':>8}  {cpu_head}  {cpu_head}"
        )
        for name in args.variants:
            r = variants[name]["body_bytes"][str(size)]
            cpu = [
                "".join(_num(r[k][p], 9, 0) for p in PROCS)
                for k in ("cpu_us_per_req", "cpu_us_per_req_loaded")
            ]
            print(
                f"{name:<20}{_num(r['p50_ms'], 8)}{_num(r['p99_ms'], 8)}"
                f"{_num(r['added_p50_ms'], 9)}{_num(r['added_p99_ms'], 9)}"
                f"{_num(r['rps'], 8, 0)}  {cpu[0]}  {cpu[1]}"
            )
        _print_loaded(args, variants, size)
        _print_rates(args, variants, size)


def _print_loaded(args: argparse.Namespace, variants: dict[str, Any], size: int) -> None:
    rows = [variants[name]["body_bytes"][str(size)] for name in args.variants]
    print(
        f"\nbody {size} bytes, fixed concurrency {rows[0]['load_connections']} "
        f"({args.load_client}, {args.duration} s)"
    )
    print(
        f"{'variant':<20}{'req/s':>8}{'errors':>8}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'+p50 ms':>9}{'+p99 ms':>9}"
    )
    for name, r in zip(args.variants, rows, strict=True):
        print(
            f"{name:<20}{_num(r['rps'], 8, 0)}{r['load_errors']:>8}"
            f"{_num(r['load_p50_ms'], 8)}{_num(r['load_p99_ms'], 8)}"
            f"{_num(r['load_added_p50_ms'], 9)}{_num(r['load_added_p99_ms'], 9)}"
        )


def _print_rates(args: argparse.Namespace, variants: dict[str, Any], size: int) -> None:
    if not args.rates.get(size):
        return
    print(
        f"\nbody {size} bytes, fixed rates (open loop, aiohttp, {args.rate_duration} s each; "
        f"latency from the dispatch; sustained: no errors, >= 90% answered, "
        f"p99 <= {args.p99_bound_ms:g} ms)"
    )
    print(
        f"{'variant':<20}{'rate':>6}{'req/s':>8}{'errors':>8}{'p50 ms':>8}{'p99 ms':>9}"
        f"{'+p50 ms':>9}{'+p99 ms':>9}{'lag ms':>8}  sustained"
    )
    for name in args.variants:
        r = variants[name]["body_bytes"][str(size)]
        for x in r["rates"]:
            print(
                f"{name:<20}{x['rate']:>6g}{_num(x['achieved_rps'], 8, 0)}{x['errors']:>8}"
                f"{_num(x['p50_ms'], 8)}{_num(x['p99_ms'], 9)}"
                f"{_num(x['added_p50_ms'], 9)}{_num(x['added_p99_ms'], 9)}"
                f"{_num(x['client_lag_ms'], 8, 1)}  {'yes' if x['sustained'] else 'NO'}"
            )
    best = ", ".join(
        f"{name} {variants[name]['body_bytes'][str(size)]['max_sustained_rps'] or 'none'}"
        for name in args.variants
    )
    print(f"highest rate sustained (req/s): {best}")


def _csv(kind: type, choices: tuple[str, ...] = ()) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"bad value(s) {bad or text!r}")
        return items

    return parse


def _size_map(kind: type) -> Any:
    """``SIZE=V,SIZE=V`` -> {size: kind(V)}."""

    def parse(text: str) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for item in filter(None, text.split(",")):
            size, sep, value = item.partition("=")
            try:
                out[int(size)] = kind(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected SIZE=VALUE, got {item!r}") from None
            if not sep:
                raise argparse.ArgumentTypeError(f"expected SIZE=VALUE, got {item!r}")
        return out

    return parse


def _size_rates(text: str) -> dict[int, list[float]]:
    """``SIZE=R,R,R`` -> {size: [rates]}."""
    size, sep, rates = text.partition("=")
    try:
        parsed = {int(size): [float(r) for r in rates.split(",") if r]}
    except ValueError:
        parsed = {}
    if not sep or not parsed or not all(r > 0 for r in parsed[int(size)]):
        raise argparse.ArgumentTypeError(f"expected SIZE=RATE,RATE,..., got {text!r}")
    return parsed


def _pick_variants(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The variants to run ("all": every Envoy variant and every installed peer) and the
    peers skipped, with why."""
    if "all" in names:
        names = [*VARIANTS, *peers.PEERS]
    picked: list[str] = []
    skipped: dict[str, str] = {}
    for name in dict.fromkeys(names):
        reason = peers.unavailable(name) if name in peers.PEERS else None
        if reason:
            skipped[name] = reason
        else:
            picked.append(name)
    return picked, skipped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=2000, help="per variant at 16 KB")
    ap.add_argument("--rounds", type=int, default=10, help="alternating latency rounds")
    ap.add_argument("--duration", type=int, default=3, help="seconds of load per variant")
    ap.add_argument("--connections", type=int, default=32, help="concurrency of the load")
    ap.add_argument(
        "--connections-by-size",
        type=_size_map(int),
        default=CONNECTIONS_BY_SIZE,
        metavar="SIZE=N,...",
        help="concurrency of the load for these body sizes (default: 225280=150)",
    )
    ap.add_argument("--sizes", type=_csv(int), default=[16384, 225280], help="body bytes")
    ap.add_argument(
        "--variants",
        type=_csv(str, (*ALL_VARIANTS, "all")),
        default=list(VARIANTS),
        help=f"some of {','.join(ALL_VARIANTS)}, or all (default: the Envoy variants)",
    )
    ap.add_argument(
        "--rates",
        action="append",
        type=_size_rates,
        metavar="SIZE=R,R,...",
        help="open-loop rates (requests/s) for a body size; repeatable "
        "(default: 16384=200,400,700,1000 and 225280=50,100,150,200)",
    )
    ap.add_argument("--no-rates", action="store_true", help="skip the fixed-rate phase")
    ap.add_argument("--rate-duration", type=float, default=3.0, help="seconds per rate")
    ap.add_argument("--p99-bound-ms", type=float, default=100.0, help="sustained: p99 within")
    ap.add_argument("--peer-policy", default="cache_aware", help="the peer routers' --policy")
    ap.add_argument("--no-wrk", action="store_true", help="load with aiohttp even if wrk is here")
    ap.add_argument("--out", default="bench/results/overhead.json")
    args = ap.parse_args(argv)
    if min(args.sizes) < 256 or args.requests < 1 or args.rounds < 1 or args.duration < 1:
        ap.error("sizes must be >= 256 bytes; requests, rounds and duration >= 1")
    if args.rate_duration <= 0 or args.p99_bound_ms <= 0:
        ap.error("rate duration and p99 bound must be positive")
    args.load_client = "wrk" if shutil.which("wrk") and not args.no_wrk else "aiohttp"
    if args.no_rates:
        args.rates = {}
    elif args.rates is None:
        args.rates = RATES
    else:
        args.rates = {size: rates for pairs in args.rates for size, rates in pairs.items()}
    args.variants, skipped = _pick_variants(args.variants)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=sys.stderr)
    if not args.variants:
        ap.error("no variant left to run")

    bench = Bench(
        StackOptions(
            first_pod_port=free_ports(1)[0],
            time_scale=0,  # no simulated waiting: the engine costs only its own CPU work
            sim_args=["--max-tokens-default", "1"],
            env={"ACE_SALT_SECRET": "bench-overhead"},
        )
    )

    async def run() -> dict[tuple[str, int], Cell]:
        try:
            return await measure(args, bench)
        finally:
            await bench.stop()

    started = time.monotonic()
    try:
        cells = uvloop.run(run())
    except (BenchError, StackError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    variants = summarize(args, cells)
    for name, counts in bench.access_log.items():
        variants[name]["access_log_entries"] = counts
    print_table(args, variants)
    for name, counts in bench.access_log.items():
        print(
            f"{name}: access log entries written {counts['written']}, dropped {counts['dropped']}"
        )
    result = {
        "command": shlex.join(["python", "-m", "bench.overhead", *argv]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "envoy_concurrency": ENVOY_CONCURRENCY,
        "engine": "1 simulated pod: ace-extproc sim --time-scale 0 --max-tokens-default 1",
        "latency_client": f"aiohttp, sequential keep-alive, {args.rounds} alternating rounds",
        "load_client": f"{args.load_client}, {args.connections} connections, {args.duration} s",
        "load_connections_by_size": {str(k): v for k, v in args.connections_by_size.items()},
        "rate_client": (
            f"aiohttp open loop, {args.rate_duration} s per rate, latency from each request's "
            f"dispatch; sustained: no errors, >= 90% answered, "
            f"p99 <= {args.p99_bound_ms:g} ms"
        ),
        "peers": {
            name: {"version": peers.version(name), "policy": args.peer_policy}
            for name in args.variants
            if name in peers.PEERS
        },
        "skipped": skipped,
        "wall_s": round(time.monotonic() - started, 1),
        "variants": variants,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
