"""``bench.live`` over several seeds of a workload, each replayed more than once: one live
run moves a router's cached share by a few points (which conversations collide on which
pod depends on timing), so a comparison between routers needs several.

    python -m bench.live_seeds [--workload seed800] [--seeds 0,1,2,3] [--repeats 2]
                               [--routers ace,sglang,vllm] [--limit 800]
                               [--router-setting KEY=VALUE ...] [--time-scale 0.01]
                               [--tag NAME]

Each run is a plain ``bench.live`` run (fresh pods per router), written to
``bench/results/live-seeds/<workload>[-<tag>]-seed<S>-run<R>.json``; the summary (per
router: each seed's mean cached share, the mean over all runs, the lowest and highest run,
and the ceiling of each seed from ``bench.ceiling``; and the simulated pods' TTFT p50 and
p99, the median over the runs and the range of the p99, since one run's tail is noisy) goes to
``bench/results/seeds-live-<workload>[-<tag>].json``. ``--router-setting`` is passed to
``bench.live`` (ace-extproc's ``router:`` settings), and so is ``--time-scale`` (the pods'
clock: slower pods make machine time a smaller share of the engines' TTFT); ``--tag`` names
such a variant's files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import live

RUNS = Path("bench/results/live-seeds")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def summarize(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per router: cached share by seed (mean of its runs), over all runs, and the range;
    the engines' TTFT p50 and p99 over the runs that report it (median, p99's range)."""
    seeds = sorted({d["options"]["seed"] for d in docs})
    routers = list(dict.fromkeys(name for d in docs for name in d["routers"]))
    out: dict[str, Any] = {"seeds": seeds, "runs": len(docs), "ceiling": {}, "routers": {}}
    for d in docs:
        out["ceiling"][str(d["options"]["seed"])] = d["workload"]["cached_share_ceiling"]
    for name in routers:
        shares = {
            s: [
                d["routers"][name]["cached_share"]
                for d in docs
                if d["options"]["seed"] == s
                and d["routers"].get(name, {}).get("cached_share") is not None
            ]
            for s in seeds
        }
        every = [x for xs in shares.values() for x in xs]
        if not every:
            continue
        out["routers"][name] = {
            "by_seed": {str(s): round(statistics.fmean(xs), 4) for s, xs in shares.items() if xs},
            "mean": round(statistics.fmean(every), 4),
            "lowest": round(min(every), 4),
            "highest": round(max(every), 4),
        }
        ttfts = [t for d in docs if (t := d["routers"].get(name, {}).get("engine_ttft_ms"))]
        if ttfts:
            p99s = [t["p99"] for t in ttfts]
            out["routers"][name]["engine_ttft_ms"] = {
                "runs": len(ttfts),
                "p50_median": round(statistics.median(t["p50"] for t in ttfts), 1),
                "p99_median": round(statistics.median(p99s), 1),
                "p99_lowest": round(min(p99s), 1),
                "p99_highest": round(max(p99s), 1),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.live_seeds", description=__doc__)
    ap.add_argument("--workload", default="seed800")
    ap.add_argument("--seeds", type=_ints, default=[0, 1, 2, 3])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--routers", default="ace,sglang,vllm")
    ap.add_argument("--limit", type=int, default=800)
    ap.add_argument("--router-setting", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--time-scale", type=float, help="the pods' clock (bench.live's default)")
    ap.add_argument("--tag", default="", help="a suffix for this variant's files")
    args = ap.parse_args(argv)
    if args.repeats < 1 or not args.seeds:
        ap.error("--repeats must be at least 1 and --seeds name one seed or more")
    name = f"{args.workload}-{args.tag}" if args.tag else args.workload
    extra = [x for item in args.router_setting for x in ("--router-setting", item)]
    if args.time_scale is not None:
        extra += ["--time-scale", str(args.time_scale)]
    docs = []
    for seed in args.seeds:
        for run in range(args.repeats):
            out = RUNS / f"{name}-seed{seed}-run{run}.json"
            code = live.main(
                ["--workload", args.workload, "--limit", str(args.limit), "--seed", str(seed),
                 "--routers", args.routers, "--out", str(out), *extra]
            )  # fmt: skip
            if code == 0:
                docs.append(json.loads(out.read_text()))
    if not docs:
        return 1
    summary = summarize(docs)
    print(f"\n{args.workload}: cached share over {len(docs)} live runs, seeds {args.seeds}")
    w = max([10, *(len(router) + 1 for router in summary["routers"])])
    print(f"{'router':<{w}}" + "".join(f"{'seed ' + str(s):>9}" for s in summary["seeds"])
          + f"{'mean':>8}{'lowest':>8}{'highest':>8}")  # fmt: skip
    ceiling = summary["ceiling"]
    print(f"{'ceiling':<{w}}" + "".join(f"{ceiling[str(s)]:>9.1%}" for s in summary["seeds"]))
    for router, r in summary["routers"].items():
        cells = "".join(f"{r['by_seed'].get(str(s), float('nan')):>9.1%}" for s in summary["seeds"])
        print(f"{router:<{w}}{cells}{r['mean']:>8.1%}{r['lowest']:>8.1%}{r['highest']:>8.1%}")
    timed = {k: r["engine_ttft_ms"] for k, r in summary["routers"].items() if "engine_ttft_ms" in r}
    if timed:
        print("\nthe pods' TTFT on their simulated clock, ms: median over the runs (p99's range)")
        print(f"{'router':<{w}}{'runs':>6}{'p50':>9}{'p99':>9}{'lowest':>9}{'highest':>9}")
        for router, t in timed.items():
            print(
                f"{router:<{w}}{t['runs']:>6}{t['p50_median']:>9.0f}{t['p99_median']:>9.0f}"
                f"{t['p99_lowest']:>9.0f}{t['p99_highest']:>9.0f}"
            )
    path = Path(f"bench/results/seeds-live-{name}.json")
    command = "python -m bench.live_seeds " + " ".join(sys.argv[1:] if argv is None else argv)
    path.write_text(json.dumps({"command": command.strip(), **summary}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
