"""Build workloads and print their shape.

    python -m bench.workloads [NAME ...] [--seed 0] [--limit N] [--rate R] [--speed S]
                              [--path FILE] [--json]

With no name, every built-in workload. Prints, per workload, the build time,
requests, sessions, families, prompt-token quantiles, the TTFT context buckets,
the best-case prefix reuse (one engine, unbounded cache, 512-byte blocks) and the
prefill load on an 8-pod fleet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from . import NAMES, get
from .base import TraceError
from .shape import summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__)
    ap.add_argument("names", nargs="*", help=f"from: {', '.join(NAMES)}, trace:PATH")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, help="keep the first N requests")
    ap.add_argument("--rate", type=float, help="requests/s")
    ap.add_argument("--speed", type=float, help="trace time compression (traces only)")
    ap.add_argument("--path", help="the trace file (traces only)")
    ap.add_argument("--json", action="store_true", help="one JSON object a line")
    args = ap.parse_args(argv)
    names = args.names or list(NAMES)
    for name in names:
        t = time.perf_counter()
        try:
            workload = get(
                name,
                seed=args.seed,
                limit=args.limit,
                rate=args.rate,
                path=args.path,
                speed=args.speed,
            )
        except (TraceError, ValueError, OSError) as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            return 2
        build_s = time.perf_counter() - t
        summary = {"build_s": round(build_s, 2), **dataclasses.asdict(summarize(workload))}
        if args.json:
            print(json.dumps(summary))
        else:
            print(f"{name}: {workload.description}")
            for key, value in summary.items():
                if key != "name":
                    print(f"  {key:<20} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
