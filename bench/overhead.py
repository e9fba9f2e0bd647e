"""Gateway overhead: the latency and throughput cost of Envoy + ext_proc, per variant.

    python -m bench.overhead [--requests 2000] [--rounds 10] [--duration 3]
                             [--sizes 16384,225280] [--variants direct,trivial,...]

All variants run at once, each its own Envoy (and ext_proc server) on its own ports,
in front of the same single simulated engine pod (no sleeping, one output token):
  direct           client -> Envoy -> engine, no ext_proc filter: the baseline
  trivial          + bench/trivial_extproc.py: the floor for a Python ext_proc doing
                   the same exchanges (headers SEND, body BUFFERED, body rewritten)
  ace-buffered     + ace-extproc, buffered body (2 exchanges)
  ace-full-duplex  + ace-extproc, FULL_DUPLEX_STREAMED body (1 round trip)
Latency: sequential keep-alive requests from one aiohttp client, the variants taking
turns in rounds whose order alternates, so machine noise hits all alike; "added" is
variant minus direct. ``--requests`` is per variant at 16 KB; larger bodies get
proportionally fewer (at least 500). Throughput: requests/s at a fixed concurrency,
with wrk when it is installed (a Python client would saturate a core itself), else
aiohttp. CPU: utime+stime per request of the ext_proc server, Envoy and the engine,
from /proc, in both phases. Writes bench/results/overhead.json.
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
from ace_extproc import envoy_config
from ace_extproc.config import Config
from ace_extproc.stack import SERVED_BY, Stack, StackError, StackOptions, envoy_binary

# (ext_proc server, processing mode) per variant.
VARIANTS: dict[str, tuple[str | None, str]] = {
    "direct": (None, "buffered"),
    "trivial": ("trivial", "buffered"),
    "ace-buffered": ("ace", "buffered"),
    "ace-full-duplex": ("ace", "full_duplex"),
}
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
  io.write(string.format("BENCH %d %d %d %d\\n", summary.requests, summary.duration,
    e.status, e.connect + e.read + e.write + e.timeout))
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
    admin: str
    server_pid: int | None
    envoy_pid: int
    engine_pid: int

    def cpu(self) -> list[float]:
        """CPU seconds so far of each of PROCS."""
        server = cpu_s(self.server_pid) if self.server_pid else 0.0
        return [server, cpu_s(self.envoy_pid), cpu_s(self.engine_pid)]

    async def counter(self, http: aiohttp.ClientSession, pattern: str) -> int:
        """The sum of Envoy's stats whose names match the regex ``pattern``."""
        params = {"format": "json", "filter": pattern}
        async with http.get(f"http://{self.admin}/stats", params=params) as resp:
            stats = (await resp.json())["stats"]
        return sum(int(s.get("value", 0)) for s in stats)

    async def received(self, http: aiohttp.ClientSession) -> int:
        """Requests Envoy has taken in, once those in flight have finished (or been
        cut by the client): the engine and the ext_proc spent CPU on all of them."""
        for _ in range(100):
            if not await self.counter(http, r"^http\.ace_ingress\.downstream_rq_active$"):
                break
            await asyncio.sleep(0.1)
        return await self.counter(http, r"^http\.ace_ingress\.downstream_rq_total$")


class Bench(Stack):
    """Stack's process handling (logs, readiness, stop on exit) for one engine pod and
    an Envoy, with or without an ext_proc server, per variant."""

    async def start_pod(self) -> Config:
        # One pod: trivial pins it, ace-extproc picks it (the only one), direct balances
        # onto it, so every variant hands the same engine process the same work.
        fleet = config_mod.default_fleet(1, self.options.first_pod_port)
        path = self.workdir / "fleet.yaml"
        path.write_text(yaml.safe_dump(config_mod.fleet_to_dict(fleet)))
        await self._start_pods(fleet)
        return config_mod.load(path)

    async def start_variant(self, name: str, config: Config, ports: list[int]) -> Variant:
        server, mode = VARIANTS[name]
        listen, admin, grpc_addr = (f"127.0.0.1:{p}" for p in ports)
        pod = config.fleet.pods[0]
        if server == "trivial":
            argv = [str(TRIVIAL), "--listen", grpc_addr, "--cluster", pod.cluster]
            await self._spawn(f"{name}-server", sys.executable, *argv, "--served-by", pod.key)
        elif server == "ace":
            fleet = str(self.workdir / "fleet.yaml")
            argv = ["-m", "ace_extproc.cli", "serve", "--fleet", fleet, "--listen", grpc_addr]
            await self._spawn(f"{name}-server", sys.executable, *argv)
        if server:
            await self._wait_tcp(f"{name}-server", "127.0.0.1", ports[2])
        # The ext_proc cluster is rendered from settings.listen.
        cfg = replace(config, settings=replace(config.settings, listen=grpc_addr))
        rendered = envoy_config.render_yaml(
            cfg, listen=listen, admin=admin, processing_mode=mode, ext_proc=server is not None
        )
        path = self.workdir / f"envoy-{name}.yaml"
        path.write_text(rendered)
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
            await self._wait_http(http, url, name, json=ping, header=SERVED_BY if server else None)
        server_proc = self.procs.get(f"{name}-server")
        return Variant(
            name,
            url,
            admin,
            server_proc.pid if server_proc else None,
            self.procs[f"envoy-{name}"].pid,
            self.procs[pod.id].pid,
        )


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


async def load_wrk(url: str, script: Path, connections: int, duration: int) -> tuple[int, float]:
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "10s",
        "-s", str(script), url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out = (await proc.communicate())[0].decode(errors="replace")
    line = next((x for x in out.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise BenchError(f"wrk failed on {url}:\n{out}")
    requests, duration_us, status_errors, _socket_errors = map(int, line.split()[1:])
    if status_errors:  # socket errors are expected: wrk cuts connections when time is up
        raise BenchError(f"{url}: {status_errors} of {requests} answers were not 2xx")
    return requests, duration_us / 1e6


async def load_aiohttp(url: str, body: bytes, connections: int, duration: int) -> tuple[int, float]:
    done = 0
    start = time.monotonic()
    deadline = start + duration
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def worker() -> None:  # stops issuing at the deadline; none is cut
            nonlocal done
            while time.monotonic() < deadline:
                async with http.post(url, data=body, headers=HEADERS) as resp:
                    await resp.read()
                if resp.status != 200:
                    raise BenchError(f"{url}: HTTP {resp.status}")
                done += 1

        await asyncio.gather(*(worker() for _ in range(connections)))
    return done, time.monotonic() - start


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
            for v in variants if i % 2 == 0 else variants[::-1]:
                cell = cells[v.name, size]
                before, received = v.cpu(), await v.received(http)
                if args.load_client == "wrk":
                    done, elapsed = await load_wrk(v.url, script, args.connections, args.duration)
                else:
                    done, elapsed = await load_aiohttp(
                        v.url, bodies[size], args.connections, args.duration
                    )
                cell.load_received = await v.received(http) - received
                _add_cpu(cell.load_cpu_s, before, v.cpu())
                cell.load_requests, cell.load_s = done, elapsed
        for v in variants:
            # A request passed on without the ext_proc's answer (fail-open on an error or
            # a timeout, a rejected mutation) would make a variant look faster than it is.
            failed = await v.counter(
                http, r"ext_proc\..*(failure_mode_allowed|rejected_header_mutations)$"
            )
            if failed:
                raise BenchError(f"{v.name}: {failed} requests skipped the ext_proc's answer")


async def measure(args: argparse.Namespace, bench: Bench) -> dict[tuple[str, int], Cell]:
    config = await bench.start_pod()
    ports = free_ports(3 * len(args.variants))
    variants = [
        await bench.start_variant(name, config, ports[3 * i : 3 * i + 3])
        for i, name in enumerate(args.variants)
    ]
    bodies = {size: chat_body(size) for size in args.sizes}
    cells = {(v.name, size): Cell() for v in variants for size in args.sizes}
    await latency_phase(args, variants, bodies, cells)
    await load_phase(args, variants, bodies, cells, bench.workdir)
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
        has_server = VARIANTS[name][0] is not None
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
            per_size[str(size)] = row
        variants[name] = {"body_bytes": per_size}
    return variants


def _num(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_table(args: argparse.Namespace, variants: dict[str, Any]) -> None:
    print(
        f"\nEnvoy --concurrency {ENVOY_CONCURRENCY}. Latency: sequential keep-alive requests "
        f"(aiohttp), {args.rounds} alternating rounds; +: minus direct. Throughput: "
        f"{args.load_client}, {args.connections} connections, {args.duration} s. "
        "CPU: us per request."
    )
    cpu_head = "".join(f"{p:>9}" for p in PROCS)
    for size in args.sizes:
        title = f"body {size} bytes"
        print(f"\n{title:<60}{'CPU, sequential':>27}  {'CPU, loaded':>27}")
        print(
            f"{'variant':<16}{'p50 ms':>8}{'p99 ms':>8}{'+p50 ms':>9}{'+p99 ms':>9}"
            f"{'req/s':>8}  {cpu_head}  {cpu_head}"
        )
        for name in args.variants:
            r = variants[name]["body_bytes"][str(size)]
            cpu = [
                "".join(_num(r[k][p], 9, 0) for p in PROCS)
                for k in ("cpu_us_per_req", "cpu_us_per_req_loaded")
            ]
            print(
                f"{name:<16}{_num(r['p50_ms'], 8)}{_num(r['p99_ms'], 8)}"
                f"{_num(r['added_p50_ms'], 9)}{_num(r['added_p99_ms'], 9)}"
                f"{_num(r['rps'], 8, 0)}  {cpu[0]}  {cpu[1]}"
            )


def _csv(kind: type, choices: tuple[str, ...] = ()) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"bad value(s) {bad or text!r}")
        return items

    return parse


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=2000, help="per variant at 16 KB")
    ap.add_argument("--rounds", type=int, default=10, help="alternating latency rounds")
    ap.add_argument("--duration", type=int, default=3, help="seconds of load per variant")
    ap.add_argument("--connections", type=int, default=32, help="concurrency of the load")
    ap.add_argument("--sizes", type=_csv(int), default=[16384, 225280], help="body bytes")
    ap.add_argument("--variants", type=_csv(str, tuple(VARIANTS)), default=list(VARIANTS))
    ap.add_argument("--no-wrk", action="store_true", help="load with aiohttp even if wrk is here")
    ap.add_argument("--out", default="bench/results/overhead.json")
    args = ap.parse_args(argv)
    if min(args.sizes) < 256 or args.requests < 1 or args.rounds < 1 or args.duration < 1:
        ap.error("sizes must be >= 256 bytes; requests, rounds and duration >= 1")
    args.load_client = "wrk" if shutil.which("wrk") and not args.no_wrk else "aiohttp"

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
    print_table(args, variants)
    result = {
        "command": shlex.join(["python", "-m", "bench.overhead", *argv]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "envoy_concurrency": ENVOY_CONCURRENCY,
        "engine": "1 simulated pod: ace-extproc sim --time-scale 0 --max-tokens-default 1",
        "latency_client": f"aiohttp, sequential keep-alive, {args.rounds} alternating rounds",
        "load_client": f"{args.load_client}, {args.connections} connections, {args.duration} s",
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
