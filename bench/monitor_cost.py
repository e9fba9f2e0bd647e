"""What watching the pods costs the event loop the request path runs on.

    python -m bench.monitor_cost [--pods 8,64,200] [--seconds 4]

The fleet monitor scrapes every pod's ``/metrics`` (100 ms) and probes its
``/health`` (1 s) on the server's own event loop (uvloop where installed, as the
server), so each of its requests takes loop time a decision then waits for. For each
fleet size: simulated pods in a separate process (one ``SimServer`` a pod, vLLM's
metric names), a ``FleetMonitor`` watching them in this process, and a 1 ms ticker on
the same loop standing in for the request path; how late the ticker wakes (the delay
a decision arriving then would see), this process's CPU (the ticker's own included)
and the pods scraped a second. Each size runs with the default
``monitor_max_requests_per_s`` and then unbounded (``--budgets``; ``none`` leaves the
setting out, for code that predates it). Writes bench/results/monitor_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import sys
import time
from typing import Any

from ace_extproc.config import Settings, sim_fleet
from ace_extproc.routing.fleet import FleetState
from ace_extproc.routing.index import BlockIndex
from ace_extproc.routing.monitor import FleetMonitor
from bench import record

PODS_PROCESS = """
import asyncio, sys
from ace_extproc.sim.app import SimConfig, SimServer

async def main(count):
    pods = [SimServer(SimConfig(pod_id=f"pod-{i}", time_scale=0.0)) for i in range(count)]
    for pod in pods:
        await pod.start()
    print(" ".join(str(pod.port) for pod in pods), flush=True)
    await asyncio.Event().wait()

asyncio.run(main(int(sys.argv[1])))
"""
TICK_S = 0.001


def run(coro: Any) -> Any:
    """On uvloop where installed, as the server runs (``server._serve_forever``)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - optional speed-up
        return asyncio.run(coro)
    return uvloop.run(coro)


async def watch(ports: list[str], budget: float | None, seconds: float) -> dict[str, Any]:
    fleet = FleetState(sim_fleet([f"127.0.0.1:{port}" for port in ports]))
    extra = {} if budget is None else {"monitor_max_requests_per_s": budget}
    monitor = FleetMonitor(fleet, BlockIndex(100), Settings(**extra))  # type: ignore[arg-type]
    await monitor.start()
    try:
        await asyncio.sleep(1.5)  # past the first round, connections open
        scrapes, cpu, start = monitor.scrapes, time.process_time(), time.monotonic()
        lateness: list[float] = []
        clock = time.perf_counter
        while time.monotonic() - start < seconds:
            t = clock()
            await asyncio.sleep(TICK_S)
            lateness.append((clock() - t - TICK_S) * 1000)
        elapsed = time.monotonic() - start
        cpu_share = (time.process_time() - cpu) / elapsed
        scrapes_per_s = (monitor.scrapes - scrapes) / elapsed
    finally:
        await monitor.stop()
    lateness.sort()

    def q(p: float) -> float:
        return round(lateness[min(len(lateness) - 1, int(p * len(lateness)))], 2)

    return {
        "late_ms": {"p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": q(1.0)},
        "cpu_share": round(cpu_share, 3),
        "scrapes_per_s": round(scrapes_per_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--pods", default="8,64,200")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument(
        "--budgets", default="default,0", help="monitor_max_requests_per_s values; none: unset"
    )
    ap.add_argument("--out", default="bench/results/monitor_cost.json")
    args = ap.parse_args(argv)
    budgets: list[float | None] = [
        None if b == "none" else Settings().monitor_max_requests_per_s if b == "default"
        else float(b)
        for b in args.budgets.split(",")
    ]  # fmt: skip
    rows = []
    print("ticker lateness (ms) on the monitor's event loop, this process's CPU, scrapes/s")
    for count in [int(n) for n in args.pods.split(",")]:
        pods = subprocess.Popen(
            [sys.executable, "-c", PODS_PROCESS, str(count)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert pods.stdout is not None
            ports = pods.stdout.readline().split()
            for budget in budgets:
                figures = run(watch(ports, budget, args.seconds))
                row = {"pods": count, "budget": budget, **figures}
                rows.append(row)
                late = row["late_ms"]
                print(
                    f"pods {count:>4}  budget {budget if budget is not None else '-':>6}  "
                    f"late p50 {late['p50']:>6.2f}  p99 {late['p99']:>6.2f}  "
                    f"max {late['max']:>7.2f}  cpu {row['cpu_share']:>5.0%}  "
                    f"scrapes/s {row['scrapes_per_s']:>6.0f}"
                )
        finally:
            pods.kill()
            pods.wait()
    doc = {
        "command": record.command("bench.monitor_cost", argv),
        "python": platform.python_version(),
        "tick_ms": TICK_S * 1000,
        "rows": rows,
    }
    record.write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
