"""Every live benchmark in one command: ``bench.live`` for each workload of the suite (cut
to ``--limit`` requests), then ``bench.overhead`` with every variant (the peers included).

    python -m bench.live_all [--limit 800] [--workloads seed800,mooncake,...]
                             [--routers ace,envoy_rr,sglang,vllm] [--no-overhead]
                             [--live-args "--concurrency 16"] [--overhead-args "--rate-duration 2"]

Writes ``bench/results/live-<workload>.json`` per workload and
``bench/results/overhead-all.json`` (``bench/results/overhead.json`` stays the default
run of ``python -m bench.overhead``). A failing step is reported and the others still run;
the exit status is 1 if any failed. With the defaults (seed800 and burst32k whole, the
others cut to 800 requests) this takes about 10 minutes on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable

from bench import live, overhead

SUITE = ("seed800", "mooncake", "azure-code", "azure-conv", "hot-prefix", "churn", "burst32k")
OVERHEAD_OUT = "bench/results/overhead-all.json"


def steps(args: argparse.Namespace) -> list[tuple[str, Callable[[list[str]], int], list[str]]]:
    """(name, main function, argv) of each benchmark to run, in order."""
    out: list[tuple[str, Callable[[list[str]], int], list[str]]] = []
    extra = shlex.split(args.live_args)
    for name in args.workloads:
        argv = ["--workload", name, "--limit", str(args.limit), "--routers", args.routers, *extra]
        out.append((f"live {name}", live.main, argv))
    if not args.no_overhead:
        argv = ["--variants", "all", "--out", OVERHEAD_OUT, *shlex.split(args.overhead_args)]
        out.append(("overhead", overhead.main, argv))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.live_all", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--limit", type=int, default=800, help="requests per workload (800)")
    ap.add_argument(
        "--workloads",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(SUITE),
        help=f"default: {','.join(SUITE)}",
    )
    ap.add_argument("--routers", default=",".join(live.ROUTERS), help="for bench.live")
    ap.add_argument("--live-args", default="", help="more bench.live flags, one string")
    ap.add_argument("--overhead-args", default="", help="more bench.overhead flags, one string")
    ap.add_argument("--no-overhead", action="store_true", help="only the live runs")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.limit < 1:
        ap.error("--limit must be at least 1")

    failed: list[str] = []
    started = time.monotonic()
    for name, run, step_argv in steps(args):
        print(f"\n=== {name}: {shlex.join(step_argv)}", flush=True)
        try:
            code = run(step_argv)
        except SystemExit as exc:  # argparse errors in a step
            code = exc.code if isinstance(exc.code, int) else 2
        except Exception as exc:  # one broken step must not cost the others
            print(f"error: {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
        if code:
            failed.append(name)
    wall = time.monotonic() - started
    print(f"\n=== done in {wall:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
