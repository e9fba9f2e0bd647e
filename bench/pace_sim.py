"""Each pod's pace, fixed (the TTFT model's) against learned (``router.learn_pace``),
side by side in the fleet simulation: the same workload, policy (``ace``) and
requests, on fleets whose pods run as their model says or slower than it.

    python -m bench.pace_sim --workload all --seeds 3       # every workload and fleet
    python -m bench.pace_sim --workload mooncake --fleets half-3x

Fleets (``FLEETS``, ``SimSettings.pod_slowdown``): ``as-modelled`` (no pod slower: what
learning costs where there is nothing to learn), ``all-1.5x`` and ``all-2x`` (every
pod slower than its model: a fleet calibrated on other hardware, the real-engine
tier's machine on a busy afternoon), ``half-2x`` and ``half-3x`` (every other pod
slower: two GPU generations in one pool, throttled or shared hosts).

Per variant: TTFT p50/p99/mean, the share of prompt tokens the engines reported
cached, and the pace each pod learned. The figures of one seed move by several
points from a single pick sent elsewhere; ``--seeds N`` averages N. Writes
``bench/results/pace-sim.json`` (merged per workload); ``--markdown`` prints its table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any

from bench import workloads
from bench.fleetsim import SimSettings
from bench.precise_sim import DEFAULT_LIMITS, UNSEEDED, mean_of, run_workload

OUT = Path("bench/results/pace-sim.json")
FLEETS: dict[str, SimSettings] = {
    "as-modelled": SimSettings(),
    "all-1.5x": SimSettings(pod_slowdown=(1.5,)),
    "all-2x": SimSettings(pod_slowdown=(2.0,)),
    "half-2x": SimSettings(pod_slowdown=(1.0, 2.0)),
    "half-3x": SimSettings(pod_slowdown=(1.0, 3.0)),
}
VARIANTS: dict[str, dict[str, Any]] = {"fixed": {"learn_pace": False}, "learned": {}}


def markdown(doc: dict[str, Any]) -> str:
    """The file's figures as one Markdown table: learned beside fixed, and the ratios."""
    rows = [
        "| workload | fleet | p50 ms fixed / learned | p99 ms fixed / learned "
        "| p99 fixed/learned | mean ms fixed / learned | saved % fixed / learned "
        "| paces learned |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, entry in doc.get("workloads", {}).items():
        label = name + (f" (first {entry['limit']})" if entry.get("limit") else "")
        for fleet, v in entry["fleets"].items():
            f, lr = v["fixed"], v["learned"]
            paces = lr.get("pace") or []
            span = f"{min(paces):.2f}-{max(paces):.2f}" if paces else "-"
            rows.append(
                f"| {label} | {fleet} | {f['ttft_p50_ms']:.0f} / {lr['ttft_p50_ms']:.0f} "
                f"| {f['ttft_p99_ms']:.0f} / {lr['ttft_p99_ms']:.0f} "
                f"| {f['ttft_p99_ms'] / max(lr['ttft_p99_ms'], 1e-9):.2f}x "
                f"| {f['ttft_mean_ms']:.0f} / {lr['ttft_mean_ms']:.0f} "
                f"| {f['prefill_saved_ratio'] * 100:.1f} / {lr['prefill_saved_ratio'] * 100:.1f} "
                f"| {span} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fixed vs learned pod pace, per workload.")
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(workloads.NAMES)}, all")
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--limit", type=int, help="the first N requests of each workload")
    ap.add_argument("--fleets", default=",".join(FLEETS), help=", ".join(FLEETS))
    ap.add_argument("--seed", type=int, default=0, help="the workload generator's seed")
    ap.add_argument("--seeds", type=int, default=1, help="N seeds from --seed, figures their mean")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--markdown", action="store_true", help="print --out's table; run nothing")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.out).read_text())))
        return 0
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    unknown = [f for f in args.fleets.split(",") if f and f not in FLEETS]
    if unknown:
        ap.error(f"unknown fleet(s) {', '.join(unknown)}; known: {', '.join(FLEETS)}")
    names = list(workloads.NAMES) if args.workload == "all" else [args.workload]
    fleets = {f: FLEETS[f] for f in args.fleets.split(",") if f}
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    doc.update(
        {
            "command": "python -m bench.pace_sim "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": date.today().isoformat(),
            "python": platform.python_version(),
            "pods": args.pods,
            "fleets": {f: asdict(s) for f, s in fleets.items()},
        }
    )
    doc.setdefault("workloads", {})
    for name in names:
        limit = args.limit or DEFAULT_LIMITS.get(name)
        seeds = range(args.seed, args.seed + (1 if name in UNSEEDED else args.seeds))
        runs = [
            run_workload(workloads.get(name, limit=limit, seed=s), args.pods, fleets, VARIANTS)
            for s in seeds
        ]
        doc["workloads"][name] = {"limit": limit, "seeds": len(seeds), "fleets": mean_of(runs)}
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
