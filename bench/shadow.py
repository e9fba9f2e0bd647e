"""Does shadow mode predict what prod then delivers?

    python -m bench.shadow [--workload seed800|all] [--pods 8] [--limit N]

Replays a workload twice on the simulated fleet, each time on fresh pods:

* shadow: every request takes Envoy's default route (least request); ace-extproc
  still decides, and records the prefill its pick would have saved (the same
  estimate it puts in ``x-ace-trace-prefix-kv-cache`` and its metrics). The engines
  report what default routing really reused.
* prod: the same requests, pinned by ace-extproc; the engines report the reuse.

The shadow run's prediction of prod's reuse is checked against what prod then
measured: ``error = (predicted - measured) / measured`` must stay within
``TOLERANCE``. The gain a team would see by switching is measured minus default.
Writes bench/results/shadow.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import workloads
from bench.baselines import POLICIES
from bench.fleetsim import SimSettings, simulate
from bench.fleetsim.metrics import RunResult

TOLERANCE = 0.10  # the prediction of prod's cached-token share, relative


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def compare(workload: workloads.Workload, pods: int, settings: SimSettings) -> dict[str, Any]:
    runs: dict[str, RunResult] = {
        mode: simulate(
            workload, POLICIES["ace"], pods=pods, settings=settings, mode=mode, progress=False
        )
        for mode in ("shadow", "prod")
    }
    shadow, prod = runs["shadow"].records, runs["prod"].records
    prompt = sum(r.prompt_tokens for r in shadow)
    default_cached = sum(r.cached_tokens for r in shadow)
    predicted = sum(r.estimated_saved_tokens for r in shadow)
    prod_prompt = sum(r.prompt_tokens for r in prod)
    measured = sum(r.cached_tokens for r in prod)
    prod_estimated = sum(r.estimated_saved_tokens for r in prod)
    predicted_share = _share(predicted, prompt)
    measured_share = _share(measured, prod_prompt)
    error = (predicted_share - measured_share) / measured_share if measured_share else 0.0
    return {
        "workload": workload.name,
        "pods": pods,
        "requests": len(shadow),
        "default_cached_share": round(_share(default_cached, prompt), 4),
        "shadow_predicted_share": round(predicted_share, 4),
        "prod_measured_share": round(measured_share, 4),
        "prod_estimated_share": round(_share(prod_estimated, prod_prompt), 4),
        "predicted_gain": round(predicted_share - _share(default_cached, prompt), 4),
        "measured_gain": round(measured_share - _share(default_cached, prompt), 4),
        "relative_error": round(error, 4),
        "within_tolerance": abs(error) <= TOLERANCE,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seed800", help="a workload name, or 'all'")
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--limit", type=int, help="first N requests only")
    ap.add_argument("--out", default="bench/results/shadow.json")
    args = ap.parse_args(argv)
    names = workloads.NAMES if args.workload == "all" else (args.workload,)
    rows = [
        compare(workloads.get(name, limit=args.limit), args.pods, SimSettings()) for name in names
    ]
    print(
        f"cached share of prompt tokens, {args.pods} pods; shadow's prediction of prod "
        f"(tolerance +-{TOLERANCE:.0%} relative)"
    )
    print(f"{'workload':>11} {'default':>8} {'predicted':>9} {'prod':>7} {'error':>7}  verdict")
    for r in rows:
        verdict = "within" if r["within_tolerance"] else "OUTSIDE"
        print(
            f"{r['workload']:>11} {r['default_cached_share']:>8.1%} "
            f"{r['shadow_predicted_share']:>9.1%} {r['prod_measured_share']:>7.1%} "
            f"{r['relative_error']:>+7.1%}  {verdict}"
        )
    command = f"python -m bench.shadow --workload {args.workload}"
    if args.limit:
        command += f" --limit {args.limit}"
    if args.pods != 8:
        command += f" --pods {args.pods}"
    doc = {"command": command, "tolerance": TOLERANCE, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
