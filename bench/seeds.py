"""The same comparison over several seeds of a workload: which policy wins on average,
and by how much one seed's luck moves each of them.

    python -m bench.seeds --workload seed800 [--seeds 0,1,2,3] [--pods 4]
                          [--num-gpu-blocks 8192] [--policies ace,sglang_cache_aware]
                          [--replicas 1] [--scrape-interval 0.1] [--no-access-log]
                          [--out bench/results/seeds-<workload>.json]

One seed places a few dozen conversations on a few pods, so whether two of them collide
on one pod's cache is partly luck, and a single run can favour any policy by a point or
more. Each seed regenerates the workload (its sessions, lengths and arrivals); every
policy sees the same requests per seed, as in ``bench.report``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from typing import Any

from bench import record, workloads
from bench.baselines import resolve
from bench.fleetsim import SimSettings
from bench.report import add_router_view_options, router_view, run_policy
from bench.workloads.base import scaled_out

FIGURES = (
    "prefill_saved_ratio",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "imbalance",
    "compute_s",
)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.seeds", description=__doc__)
    ap.add_argument("--workload", required=True, help=", ".join(workloads.NAMES))
    ap.add_argument("--seeds", type=_seeds, default=[0, 1, 2, 3])
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--num-gpu-blocks", type=int, help="KV blocks per pod (16 tokens each)")
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--policies", default="ace,sglang_cache_aware,gie_scorers,session_hash")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument(
        "--late-pods",
        type=int,
        default=0,
        help="this many of the pods join a third of the way through (a scale-out)",
    )
    add_router_view_options(ap)
    ap.add_argument("--out", help="default: bench/results/seeds-<workload>[-<pods>pods].json")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.pods < 1 or args.replicas < 1:
        ap.error("pods and replicas must be >= 1")
    try:
        for p in policies:
            resolve(p)
    except ValueError as exc:  # a ConfigError too
        ap.error(str(exc))
    settings = SimSettings()
    if args.num_gpu_blocks:
        settings = replace(settings, num_gpu_blocks=args.num_gpu_blocks)
    settings = router_view(ap, args, settings)

    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for seed in args.seeds:
        try:
            workload = workloads.get(args.workload, seed=seed, limit=args.limit)
            if args.late_pods:
                workload = scaled_out(workload, args.pods, args.late_pods)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for p in policies:
            print(f"seed {seed}: {p} ...", file=sys.stderr, flush=True)
            try:
                s = run_policy(workload, p, args.pods, settings, False, args.replicas)
            except ValueError as exc:  # e.g. fleet events on slots this run lacks
                print(f"error: {exc}", file=sys.stderr)
                return 2
            runs[p].append({"seed": seed, **{k: s[k] for k in FIGURES}})

    print(
        f"{args.workload}, {args.pods} pods"
        + (f" x {args.num_gpu_blocks} blocks" if args.num_gpu_blocks else "")
        + (f", {args.replicas} replicas" if args.replicas > 1 else "")
        + (f", {args.late_pods} joining a third of the way" if args.late_pods else "")
        + (f", scrapes {settings.scrape_interval_s} s apart" if args.scrape_interval else "")
        + (", no access log" if args.no_access_log else "")
        + f", seeds {','.join(map(str, args.seeds))}"
    )
    # Means over the seeds; compute is the engines' (all pods), against the first policy's.
    first = statistics.fmean(r["compute_s"] for r in runs[policies[0]])
    print(
        f"{'policy':<24}{'prefill saved % by seed':<34}{'mean':>7}{'TTFT mean':>10}{'p50':>7}"
        f"{'p99 ms':>8}{'imb':>6}{'compute':>9}"
    )
    for p, rs in runs.items():
        saved = [r["prefill_saved_ratio"] * 100 for r in rs]
        cells = " ".join(f"{x:5.1f}" for x in saved)
        mean = statistics.fmean(r["ttft_mean_ms"] for r in rs)
        p50 = statistics.fmean(r["ttft_p50_ms"] for r in rs)
        p99 = statistics.fmean(r["ttft_p99_ms"] for r in rs)
        imb = statistics.fmean(r["imbalance"] for r in rs)
        compute = statistics.fmean(r["compute_s"] for r in rs) / first if first else 0.0
        print(
            f"{p:<24}{cells:<34}{statistics.fmean(saved):>7.1f}{mean:>10.1f}{p50:>7.1f}"
            f"{p99:>8.0f}{imb:>6.2f}{compute:>8.2f}x"
        )
    shape = f"-{args.pods}pods" if args.pods != 8 or args.num_gpu_blocks else ""
    shape += f"-scrape{round(settings.scrape_interval_s * 1000)}ms" if args.scrape_interval else ""
    shape += "-no-access-log" if args.no_access_log else ""
    shape += f"-late{args.late_pods}" if args.late_pods else ""
    doc = {
        "command": record.command("bench.seeds", argv),
        "workload": args.workload,
        "pods": args.pods,
        "num_gpu_blocks": settings.num_gpu_blocks,
        "replicas": args.replicas,
        "late_pods": args.late_pods,
        "scrape_interval_s": settings.scrape_interval_s,
        "access_log_s": settings.access_log_s,
        "seeds": args.seeds,
        "policies": runs,
    }
    record.write(args.out or f"bench/results/seeds-{args.workload}{shape}.json", doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
