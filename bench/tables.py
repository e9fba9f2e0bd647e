"""Markdown tables from ``bench/results/report-*.json``, for ``bench/RESULTS.md``.

    python -m bench.tables [bench/results]

The figures in RESULTS.md are pasted from this output, so they are exactly what the
report commands wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BUCKETS = ("1K", "4K", "16K", "32K")


def table(report: dict[str, Any]) -> str:
    pol = report["policies"]
    rr = pol.get("round_robin")
    pooled = pol.get("bound_pooled")
    rows = [
        f"#### `{report['workload']}`: {report['requests']} requests, {report['pods']} pods "
        f"(`{report['command']}`)",
        "",
        "| policy | hit % | warm hit % | prefill saved % | of pooled bound | TTFT p50 ms"
        " | p95 | p99 | p50 vs RR | imbalance | compute imbalance | evictions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, p in pol.items():
        of_pooled = (
            f"{p['prefill_saved_ratio'] / pooled['prefill_saved_ratio']:.0%}"
            if pooled and pooled["prefill_saved_ratio"]
            else "-"
        )
        vs_rr = f"{rr['ttft_p50_ms'] / p['ttft_p50_ms']:.2f}x" if rr and p["ttft_p50_ms"] else "-"
        work = f"{p['work_imbalance']:.2f}" if "work_imbalance" in p else "-"
        label = f"**{name}**" if name == "ace" else name
        rows.append(
            f"| {label} | {p['hit_ratio']:.1%} | {p['warm_hit_ratio']:.1%} "
            f"| {p['prefill_saved_ratio']:.1%} | {of_pooled} | {p['ttft_p50_ms']:.0f} "
            f"| {p['ttft_p95_ms']:.0f} | {p['ttft_p99_ms']:.0f} | {vs_rr} | {p['imbalance']:.2f} "
            f"| {work} | {p['evictions']:,} |"
        )
    rows += ["", "TTFT p50 ms by context bucket:", ""]
    rows.append("| policy | " + " | ".join(BUCKETS) + " |")
    rows.append("| --- |" + " ---: |" * len(BUCKETS))
    for name, p in pol.items():
        by = p.get("ttft_by_bucket", {})
        cells = [
            f"{by[b]['p50_ms']:.0f} ({by[b]['count']})" if by.get(b, {}).get("count") else "-"
            for b in BUCKETS
        ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# Policies that are not routers one would deploy: the bounds, and ours' variants.
NOT_PEERS = ("ace", "bound_", "round_robin", "random", "least_loaded", "session_hash")


def targets(reports: list[dict[str, Any]]) -> str:
    """One row a workload, against issue 27's targets: ours' TTFT p50 in each context
    bucket against round robin's, its TTFT p99 against the best other deployable policy's
    (a peer's or a baseline's, ours' variants aside), and its prefill saved as a share of
    the pooled-cache bound's."""
    rows = [
        "| workload | TTFT p50 by bucket, ours / round robin (ms) | TTFT p99 ours / best other"
        " (ms) | prefill saved, ours / pooled bound |",
        "| --- | --- | --- | --- |",
    ]
    for report in reports:
        pol = report["policies"]
        ace, rr, pooled = pol.get("ace"), pol.get("round_robin"), pol.get("bound_pooled")
        if ace is None or rr is None or pooled is None:
            continue
        cells = []
        for b in BUCKETS:
            ours = ace["ttft_by_bucket"].get(b, {})
            theirs = rr["ttft_by_bucket"].get(b, {})
            if ours.get("count") and theirs.get("count"):
                mark = "" if ours["p50_ms"] <= theirs["p50_ms"] else " ✗"
                cells.append(f"{b} {ours['p50_ms']:.0f} / {theirs['p50_ms']:.0f}{mark}")
        others = {n: p for n, p in pol.items() if not n.startswith(NOT_PEERS) or n == "round_robin"}
        others.update({n: p for n, p in pol.items() if n in ("least_loaded", "session_hash")})
        best_name, best = min(others.items(), key=lambda kv: kv[1]["ttft_p99_ms"])
        ratio = best["ttft_p99_ms"] / ace["ttft_p99_ms"] if ace["ttft_p99_ms"] else 0.0
        share = ace["prefill_saved_ratio"] / pooled["prefill_saved_ratio"]
        rows.append(
            f"| {report['workload']} | {', '.join(cells)} | {ace['ttft_p99_ms']:,.0f} / "
            f"{best['ttft_p99_ms']:,.0f} ({best_name}): {ratio:.2f}x | "
            f"{ace['prefill_saved_ratio']:.1%} / {pooled['prefill_saved_ratio']:.1%}: {share:.0%} |"
        )
    return "\n".join(rows)


def live_table(live: dict[str, Any]) -> str:
    w = live["workload"]
    rows = [
        f"#### `{w['name']}` live: {w['requests']} requests (`{live['command']}`)",
        "",
        "| router | ok / requests | hit % | prompt tokens from cache (engine-reported) "
        "| latency p50 / p99 ms | TTFT p50 / p99 ms | engines' TTFT p50 / p99 (simulated ms) "
        "| busiest pod share |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in live["routers"].items():
        if "cached_share" not in r:
            rows.append(f"| {name} | skipped: {r.get('skipped', 'not run')} | | | | | | |")
            continue
        lat, ttft = r["latency_ms"], r["ttft_ms"]
        # Runs before the simulated engines reported their TTFT have none.
        sim = r.get("engine_ttft_ms")
        sim_cell = "-" if not sim else f"{sim['p50']:.0f} / {sim['p99']:.0f}"
        rows.append(
            f"| {name} | {r['ok']} / {r['requests']} | {r['hit_ratio']:.1%} "
            f"| {r['cached_share']:.1%} | {lat['p50']:.0f} / {lat['p99']:.0f} "
            f"| {ttft['p50']:.0f} / {ttft['p99']:.0f} | {sim_cell} | {r['busiest_pod_share']:.0%} |"
        )
    return "\n".join(rows)


def live_summary(lives: list[dict[str, Any]]) -> str:
    """One row per workload: each router's share of prompt tokens from cache (as the
    engines reported it) next to the most any router could get (``bench.ceiling``)."""
    routers = list(dict.fromkeys(name for live in lives for name in live["routers"]))
    rows = [
        "| workload | ceiling | " + " | ".join(routers) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in routers) + " |",
    ]
    for live in lives:
        w = live["workload"]
        bound = w.get("cached_share_ceiling")
        shares = [live["routers"].get(name, {}).get("cached_share") for name in routers]
        shown = [None if x is None else f"{x:.1%}" for x in shares]
        best = max((x for x in shares if x is not None), default=None)
        top = None if best is None else f"{best:.1%}"  # ties at the shown precision: all bold
        cells = ["-" if x is None else (f"**{x}**" if x == top else x) for x in shown]
        seed = live.get("options", {}).get("seed", 0)
        name = f"{w['name']}, seed {seed}" if seed else w["name"]
        rows.append(
            f"| {name} ({w['requests']}) | {'-' if bound is None else f'{bound:.1%}'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(rows)


def overhead_table(data: dict[str, Any]) -> str:
    rows = [
        f"`{data['command']}`",
        "",
        "| variant | body | +p50 ms | +p99 ms | req/s at fixed concurrency "
        "| highest rate sustained |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in data["variants"].items():
        for size, f in v["body_bytes"].items():
            rows.append(
                f"| {name} | {int(size) // 1024} KB "
                f"| {f['added_p50_ms']:.2f} | {f['added_p99_ms']:.2f} "
                f"| {f['rps']:.0f} (c={f.get('load_connections', '-')}) "
                f"| {f.get('max_sustained_rps', '-')} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0] if args else "bench/results")
    reports = [json.loads(path.read_text()) for path in sorted(folder.glob("report-*.json"))]
    for report in reports:
        print(table(report))
        print()
    if reports:
        print(targets(reports))
        print()
    lives = [json.loads(path.read_text()) for path in sorted(folder.glob("live-*.json"))]
    lives = [live for live in lives if "workload" in live]  # not bench.pool_runs' pools
    if lives:
        print(live_summary(lives))
        print()
    for live in lives:
        print(live_table(live))
        print()
    for path in sorted(folder.glob("overhead*.json")):
        print(overhead_table(json.loads(path.read_text())))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
