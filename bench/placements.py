"""Where a policy put the requests, and what the pods then held: a diagnostic of one
workload in the fleet simulation, for when one variant saves less than another and
the figures alone do not say why.

    python -m bench.placements --workload conv-burst
    python -m bench.placements --workload churn --fleet kv-tight --variants approximate,precise@50ms

Each variant (``bench.precise_sim``'s) runs on the same requests. At every pick the
simulation says how much of the prompt each pod holds cached (``simulate``'s
``watch``), so a loss splits in two:

- ``best held``: the prompt tokens the best-placed pod held at the pick. Lower than
  another variant's: the pods held less worth finding (placements that scattered or
  crowded histories, a cache evicting more);
- ``left``: what the best pod held beyond the chosen one's. Higher: the picks passed
  warm pods by (queue, the slack, a wrong belief about what they held).

Then each family's cached tokens (which family the difference is in), and per pod:
its share of the prompt tokens, its new placements (picks no match
steered, ``miss``) and the blocks its cache evicted; and the picks by action. A
crowded pod shows as a large share of new placements and evictions.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace
from typing import Any

from bench import workloads
from bench.baselines import resolve
from bench.fleetsim import simulate, summarize
from bench.precise_sim import FLEETS, RUN_FIELDS, variants
from bench.workloads.base import Workload


def diagnose(
    workload: Workload, fleet: str, variant: str, pods: int = 8, policy: str = "ace"
) -> dict[str, Any]:
    """One variant's picks on ``workload``: the shares and per-pod counts above."""
    fields = variants()[variant]
    run = {k: v for k, v in fields.items() if k in RUN_FIELDS}
    settings = replace(FLEETS[fleet], **{k: v for k, v in fields.items() if k not in RUN_FIELDS})
    picks: dict[int, tuple[int, list[int]]] = {}

    def watch(index: int, slot: int, held: list[int]) -> None:
        picks.setdefault(index, (slot, held))  # a rerouted request: its first pick

    result = simulate(
        workload,
        resolve(policy),
        pods=pods,
        settings=settings,
        progress=False,
        watch=watch,
        **run,
    )
    prompt = sum(r.prompt_tokens for r in result.records) or 1
    best = left = 0
    new: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    actions: Counter[str] = Counter()
    cached: Counter[str] = Counter()
    for slot, held in picks.values():
        best += max(held)
        left += max(held) - held[slot]
    for r in result.records:
        tokens[r.pod] += r.prompt_tokens
        actions[r.action] += 1
        cached[r.family] += r.cached_tokens
        if r.action == "miss":
            new[r.pod] += 1
    return {
        "saved": summarize(result)["prefill_saved_ratio"],
        "best_held": best / prompt,
        "left": left / prompt,
        "actions": dict(actions),
        # Each family's cached tokens, as a share of all prompt tokens: the variants'
        # difference in a family is its part of the difference in "saved".
        "families": {f: n / prompt for f, n in sorted(cached.items())},
        "pods": [
            {"tokens": tokens[p] / prompt, "new": new[p], "evicted": result.evictions[p]}
            for p in range(pods)
        ],
    }


def report(name: str, fleet: str, found: dict[str, dict[str, Any]]) -> str:
    width = max(len(v) for v in found) + 2
    lines = [
        f"{name}, {fleet} fleet: prefill saved, what the best pod held at each pick, "
        "what the picks left there (shares of prompt tokens); picks by action",
        f"{'variant':<{width}}{'saved':>7}{'best held':>11}{'left':>7}   actions",
    ]
    for variant, f in found.items():
        acts = ", ".join(f"{a} {n}" for a, n in sorted(f["actions"].items()))
        lines.append(
            f"{variant:<{width}}{f['saved']:>7.1%}{f['best_held']:>11.1%}{f['left']:>7.1%}   {acts}"
        )
    families = sorted({f for v in found.values() for f in v["families"]})
    lines.append("saved by family (shares of all prompt tokens): " + ", ".join(families))
    for variant, f in found.items():
        cells = "  ".join(f"{f['families'].get(name, 0.0):>7.1%}" for name in families)
        lines.append(f"{variant:<{width}}{cells}")
    lines.append("per pod: prompt tokens / new placements / blocks evicted (thousands)")
    for variant, f in found.items():
        cells = "  ".join(
            f"{p['tokens']:.0%}/{p['new']}/{p['evicted'] / 1000:.0f}" for p in f["pods"]
        )
        lines.append(f"{variant:<{width}}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.placements", description=__doc__)
    ap.add_argument("--workload", required=True, help=", ".join(workloads.NAMES))
    ap.add_argument("--fleet", default="default", choices=sorted(FLEETS))
    ap.add_argument("--variants", default="approximate,precise@50ms")
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, help="the first N requests")
    ap.add_argument("--policy", default="ace")
    args = ap.parse_args(argv)
    known = variants()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen if v not in known]
    if unknown or not chosen:
        print(f"error: unknown variant(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    try:
        workload = workloads.get(args.workload, seed=args.seed, limit=args.limit)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    found = {
        v: diagnose(workload, args.fleet, v, pods=args.pods, policy=args.policy) for v in chosen
    }
    print(report(workload.name, args.fleet, found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
