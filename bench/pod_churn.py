"""Decision cost and metrics as pods come and go: slots reused against slots kept forever.

    python -m bench.pod_churn [--departed 0,100,1000,10000] [--iterations 2000]

Kubernetes gives every new pod a new IP, and a discovered pod's id is its IP, so over
months of autoscaling and rolling restarts one gateway sees thousands of distinct pods.
Here a fleet of 8 pods, warm as in ``bench.decision`` (4K-token chats, warm hits), sees
extra pods join and leave through discovery (``Discovery.sync``), each a new pod that
takes a few requests while it is in. After each count of departed pods: the fleet's
slots, the decision's p50 (``bench.decision``'s "total": header and body phase up to the
answer's wire bytes) and the size of the router's ``/metrics`` exposition, with slot
reuse (the default: ``FleetState.free_slots_kept`` departed pods' slots wait, then the
longest gone is reused) and without it (every slot kept for its pod forever, as before
slots were reused), the two side by side in one process, their timings interleaved.
Writes bench/results/pod_churn.json.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from typing import Any

from prometheus_client import generate_latest

from ace_extproc import mutate, server
from ace_extproc.config import Pod
from ace_extproc.processor import Processor
from ace_extproc.routing.discovery import Discovery
from bench import record
from bench.decision import HEADERS, chat_body, warm_app

TOKENS = 4096
REQUESTS_PER_VISIT = 9  # while an extra pod is in: about one lands on it (1 in 9 pods)
ROUNDS = 5  # timing rounds, the variants alternating


class Variant:
    def __init__(self, name: str, reuse: bool) -> None:
        self.name = name
        app, self.bodies = warm_app(TOKENS, 8)
        self.proc = app.processor
        if not reuse:
            self.proc.fleet.free_slots_kept = sys.maxsize
        dest = self.proc.fleet.pods[0].destination
        self.discovery = Discovery(app.fleet, app.index, dest)
        self.dest = dest
        self.departed = 0
        self.rng = random.Random(1)
        self.samples: list[float] = []

    def churn_to(self, departed: int) -> None:
        """Extra pods join, take a few requests and leave, until ``departed`` have."""
        proc = self.proc
        while self.departed < departed:
            i = self.departed
            pod = Pod(self.dest, f"10-8-{i // 250}-{i % 250}", f"10.8.{i // 250}.{i % 250}", 8000)
            self.discovery.sync([pod])
            for _ in range(REQUESTS_PER_VISIT):
                body = chat_body(self.rng, 256)
                proc.on_body(proc.on_headers(HEADERS, False), body)
            self.discovery.sync([])
            self.departed += 1

    def time_decisions(self, iterations: int) -> None:
        proc, bodies = self.proc, self.bodies
        clock = time.perf_counter_ns
        for k in range(iterations):
            t = clock()
            c = proc.on_headers(HEADERS, False)
            out = proc.on_body(c, bodies[k % len(bodies)])
            mutate.body_decided(out, c.client_upstream).SerializeToString()
            self.samples.append((clock() - t) / 1000.0)

    def row(self, proc: Processor) -> dict[str, Any]:
        exposition = generate_latest(proc.telemetry.registry)
        row = {
            "slots": len(proc.fleet.pods),
            "decision_p50_us": round(statistics.median(self.samples), 1),
            "metrics_bytes": len(exposition),
            "metrics_series": sum(
                1 for line in exposition.splitlines() if line and not line.startswith(b"#")
            ),
        }
        self.samples = []
        return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--departed", default="0,100,1000,10000")
    ap.add_argument("--iterations", type=int, default=2000, help="timed decisions per point")
    ap.add_argument("--out", default="bench/results/pod_churn.json")
    args = ap.parse_args(argv)
    counts = sorted({int(n) for n in args.departed.split(",")})

    variants = [Variant("reuse", True), Variant("no_reuse", False)]
    server.tune_gc()
    rows: list[dict[str, Any]] = []
    print(f"decision p50 at {TOKENS} tokens, 8 pods, as extra pods come and go (each new)")
    columns = (("departed", 9), ("variant", 9), ("slots", 6), ("p50 us", 7), ("metrics KB", 11))
    print(" ".join(f"{name:>{width}}" for name, width in columns), f"{'series':>7}")
    for n in counts:
        for v in variants:
            v.churn_to(n)
        for _ in range(ROUNDS):
            for v in variants:
                v.time_decisions(max(1, args.iterations // ROUNDS))
        for v in variants:
            row = {"departed": n, "variant": v.name, **v.row(v.proc)}
            rows.append(row)
            print(
                f"{n:>9} {v.name:>9} {row['slots']:>6} {row['decision_p50_us']:>7.1f} "
                f"{row['metrics_bytes'] / 1000:>11.1f} {row['metrics_series']:>7}"
            )
    doc = {
        "command": record.command("bench.pod_churn", argv),
        "python": platform.python_version(),
        "tokens": TOKENS,
        "requests_per_visit": REQUESTS_PER_VISIT,
        "rows": rows,
    }
    record.write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
