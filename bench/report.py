"""The benchmark report: every policy on the same workload, side by side, in one run.

    python -m bench.report --suite seed800                 # the product's 800-prompt suite
    python -m bench.report --trace PATH                     # any Mooncake-format trace
    python -m bench.report --workload hot-prefix --pods 8 --policies ace,round_robin
    python -m bench.report --trace PATH --policies ace,ace@min_match=0.1  # try a setting

Each policy runs through the production ``Processor`` inside the fleet simulation
(``bench.fleetsim``); the two bounds run with the simulation's pooled or unbounded
caches. ``ace@setting=value`` is ours with router settings changed
(``baselines.resolve``), to see what a ``fleet.yaml`` setting would do to a trace before
deploying it. Prints the product-style report for ``ace`` and a table of every policy,
and writes ``bench/results/report-<workload>.json`` plus PNG plots next to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ace_extproc import request as req
from ace_extproc.prefix import hash_prompt, scope_seed
from bench import workloads
from bench.baselines import POLICIES, resolve
from bench.fleetsim import SimSettings, simulate, summarize
from bench.fleetsim.settings import cpu_vllm, for_workload
from bench.workloads.base import Workload

RESULTS = Path("bench/results")
# Ours first, then the registry's order (baselines, then the bounds).
DEFAULT_POLICIES = ["ace", *(name for name in POLICIES if name != "ace")]
BOUND_SETTINGS: dict[str, dict[str, Any]] = {
    "bound_pooled": {"pooled_cache": True},
    "bound_unbounded": {"unbounded_cache": True},
}


def hashing_overhead_ms(workload: Workload, block_bytes: int = 512) -> dict[str, float]:
    """The in-process cost of prefix hashing alone (canonical prompt -> block hashes),
    per request of this workload: the figure the product reports as "hashing overhead"."""
    times = []
    clock = time.perf_counter_ns
    for r in workload.requests[:2000]:
        try:
            parsed = req.parse(r.path, r.body)
        except req.RequestError:
            continue
        seed = scope_seed("anon", parsed.model)
        t = clock()
        hash_prompt(parsed.prompt, parsed.cacheable_end, block_bytes, seed)
        times.append((clock() - t) / 1e6)
    if not times:
        return {"p50_ms": 0.0, "mean_ms": 0.0}
    return {"p50_ms": statistics.median(times), "mean_ms": statistics.fmean(times)}


def run_policy(
    workload: Workload,
    name: str,
    pods: int,
    settings: SimSettings,
    progress: bool,
    replicas: int = 1,
    share_delay_s: float | None = None,
) -> dict[str, Any]:
    policy_settings = replace(settings, **BOUND_SETTINGS.get(name, {}))
    result = simulate(
        workload,
        resolve(name),
        pods=pods,
        settings=policy_settings,
        progress=progress,
        replicas=replicas,
        share_delay_s=share_delay_s,
    )
    summary = summarize(result)
    summary["replicas"] = replicas
    summary["share_delay_ms"] = None if share_delay_s is None else share_delay_s * 1000
    summary["session_moves"] = _session_moves(result)
    summary["wall_s"] = round(result.wall_s, 2)
    # "Any cached token" counts the chat template's first block, warm on every pod; a
    # warm hit is a request that got at least half of its prompt from cache.
    warm = sum(1 for r in result.records if r.cached_tokens * 2 >= r.prompt_tokens)
    summary["warm_hit_ratio"] = warm / len(result.records) if result.records else 0.0
    summary["by_family"] = _by_family(result)
    for key in ("lora_loads", "lora_evictions"):  # adapter workloads only
        if key in result.extra:
            summary[key] = result.extra[key]
    return summary


def _session_moves(result: Any) -> float:
    """Share of a session's later requests that went to a different pod than its
    previous one: how often routing breaks a conversation's affinity (with several
    replicas, where their separate indexes disagree)."""
    last: dict[str, int] = {}
    moves = later = 0
    for r in sorted(result.records, key=lambda r: r.arrival_s):
        if r.session in last:
            later += 1
            moves += r.pod != last[r.session]
        last[r.session] = r.pod
    return moves / later if later else 0.0


def _by_family(result: Any) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    families = sorted({r.family for r in result.records})
    for fam in families:
        recs = [r for r in result.records if r.family == fam]
        prompt = sum(r.prompt_tokens for r in recs)
        ttfts = sorted(r.ttft_s * 1000 for r in recs)
        out[fam] = {
            "requests": len(recs),
            "hit_ratio": sum(1 for r in recs if r.cached_tokens > 0) / len(recs),
            "prefill_saved_ratio": sum(r.cached_tokens for r in recs) / prompt if prompt else 0.0,
            "ttft_p50_ms": ttfts[len(ttfts) // 2],
        }
    return out


# ------------------------------------------------------------------ output


def product_report(workload: Workload, pods: int, report: dict[str, Any]) -> str:
    """The product's own report format, for our policy."""
    ours = report["policies"]["ace"]
    rr = report["policies"].get("round_robin")
    hits, misses = ours["hits"], ours["misses"]
    lines = [
        f"ace-extproc benchmark: {workload.name} ({len(workload.requests)} prompts, {pods} pods)",
        f"  Total prompts:          {hits + misses}",
        f"  Cache hit ratio:        {ours['hit_ratio']:.1%}  ({hits} hits / {misses} misses)",
        f"  Total prompt tokens:    {ours['prompt_tokens']:,}",
        f"  Saved prefill tokens:   {ours['cached_tokens']:,} ({ours['prefill_saved_ratio']:.1%})",
    ]
    lines.append(
        f"  Warm hit ratio:         {ours['warm_hit_ratio']:.1%}  (>= half the prompt from cache;"
        f" round-robin {rr['warm_hit_ratio']:.1%})"
        if rr
        else ""
    )
    if rr:
        by_ours, by_rr = ours["ttft_by_bucket"], rr["ttft_by_bucket"]
        speedups = [
            f"{b} {by_rr[b]['p50_ms'] / by_ours[b]['p50_ms']:.2f}x"
            for b in ("1K", "4K", "16K", "32K")
            if by_ours.get(b, {}).get("count") and by_ours[b]["p50_ms"] > 0
        ]
        lines.append(f"  TTFT p50 speedup by context: {', '.join(speedups)}")
        lines.append(
            f"  TTFT speedup vs round-robin: p50 {rr['ttft_p50_ms'] / ours['ttft_p50_ms']:.2f}x "
            f"({ours['ttft_p50_ms']:.1f} vs {rr['ttft_p50_ms']:.1f} ms), "
            f"mean {rr['ttft_mean_ms'] / ours['ttft_mean_ms']:.2f}x"
        )
    h = report["hashing_overhead"]
    lines.append(
        f"  Hashing overhead:       {h['p50_ms']:.4f} ms p50 per request "
        f"(mean {h['mean_ms']:.4f} ms; in-process, this machine)"
    )
    return "\n".join(lines)


def policy_table(report: dict[str, Any]) -> str:
    w = max([20, *(len(name) + 1 for name in report["policies"])])  # a column apart
    head = (
        f"{'policy':<{w}}{'hit%':>7}{'warm%':>7}{'saved%':>8}"
        f"{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'imbal':>7}{'evict':>9}{'rps':>8}{'moves%':>8}"
    )
    rows = [head, "-" * len(head)]
    for name, p in report["policies"].items():
        rows.append(
            f"{name:<{w}}{p['hit_ratio'] * 100:>7.1f}{p['warm_hit_ratio'] * 100:>7.1f}"
            f"{p['prefill_saved_ratio'] * 100:>8.1f}"
            f"{p['ttft_p50_ms']:>9.1f}{p['ttft_p95_ms']:>9.1f}{p['ttft_p99_ms']:>9.1f}"
            f"{p['imbalance']:>7.2f}{p['evictions']:>9}{p['throughput_rps']:>8.1f}"
            f"{p['session_moves'] * 100:>8.1f}"
        )
    return "\n".join(rows)


def bucket_table(report: dict[str, Any]) -> str:
    buckets = ["1K", "4K", "16K", "32K"]
    head = f"{'TTFT p50 ms by context':<24}" + "".join(f"{b:>10}" for b in buckets)
    rows = [head]
    for name, p in report["policies"].items():
        cells = []
        for b in buckets:
            cell = p.get("ttft_by_bucket", {}).get(b)
            cells.append(f"{cell['p50_ms']:>10.1f}" if cell and cell.get("count") else f"{'-':>10}")
        rows.append(f"{name:<24}" + "".join(cells))
    return "\n".join(rows)


def plot(report: dict[str, Any], stem: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots; pip install 'ace-extproc[bench]')")
        return []
    names = list(report["policies"])
    written = []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    hit = [report["policies"][n]["hit_ratio"] * 100 for n in names]
    saved = [report["policies"][n]["prefill_saved_ratio"] * 100 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], hit, width=0.4, label="requests with a cache hit %")
    ax.bar([x + 0.2 for x in xs], saved, width=0.4, label="prompt tokens from cache %")
    ax.set_xticks(list(xs), names, rotation=35, ha="right")
    ax.set_ylim(0, 100)
    ax.set_title(f"{report['workload']}: cache reuse by policy ({report['pods']} pods)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = stem.with_name(stem.name + "-hit.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    fig, ax = plt.subplots(figsize=(10, 4.5))
    buckets = ["1K", "4K", "16K", "32K"]
    for n in names:
        by = report["policies"][n].get("ttft_by_bucket", {})
        pts = [(i, by[b]["p50_ms"]) for i, b in enumerate(buckets) if by.get(b, {}).get("count")]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set_yscale("log")
    ax.set_xlabel("prompt context bucket (tokens)")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title(f"{report['workload']}: TTFT by context length")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = stem.with_name(stem.name + "-ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    return written


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Every routing policy on one workload, side by side.")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--suite", help="a built-in workload (same as --workload)")
    src.add_argument("--workload", help=f"one of: {', '.join(workloads.NAMES)}, or all")
    src.add_argument("--trace", help="a Mooncake-format trace (JSONL)")
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--rate", type=float, help="arrival rate override (requests/s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-gpu-blocks", type=int, help="KV blocks per pod (16 tokens each)")
    ap.add_argument(
        "--engines",
        choices=("sim", "cpu-vllm"),
        default="sim",
        help="the pods simulated: the default fleet's, or the real-engine tier's CPU vLLM "
        "(its blocks, KV, TTFT model: the shape of bench.live --engine vllm)",
    )
    add_router_view_options(ap)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="also run our policies as N independent replicas (requests spread over them)",
    )
    ap.add_argument(
        "--share-ms",
        type=float,
        help="with --replicas: also run them sharing placements (router.share_url), "
        "each reaching the others this many ms later",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true", help="write the JSON only")
    args = ap.parse_args(argv)

    if args.share_ms is not None and (args.share_ms < 0 or args.replicas < 2):
        print("error: --share-ms needs --replicas 2 or more and a delay >= 0", file=sys.stderr)
        return 2
    name = args.suite or args.workload or ("trace:" + args.trace if args.trace else "seed800")
    if name == "all":
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "all"]
        rest = [a for a in rest if a not in ("--workload", "--suite")]
        return max(main(["--workload", w, *rest]) for w in workloads.NAMES)
    try:
        workload = workloads.get(name, seed=args.seed, limit=args.limit, rate=args.rate)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        for p in policies:
            resolve(p)
    except ValueError as exc:  # a ConfigError too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    slots = [e.slot for e in workload.events] + list(workload.initially_absent)
    if slots and max(slots) >= args.pods:
        print(f"error: {name} needs --pods {max(slots) + 1} or more", file=sys.stderr)
        return 2
    settings = SimSettings() if args.engines == "sim" else cpu_vllm()
    if args.num_gpu_blocks:
        settings = replace(settings, num_gpu_blocks=args.num_gpu_blocks)
    settings = router_view(ap, args, settings)
    settings = for_workload(settings, workload)  # e.g. --enable-lora for adapters

    report: dict[str, Any] = {
        "workload": workload.name,
        "description": workload.description,
        "pods": args.pods,
        "requests": len(workload.requests),
        "command": "python -m bench.report " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": platform.python_version(),
        "settings": asdict(settings),
        "hashing_overhead": hashing_overhead_ms(workload),
        "policies": {},
    }
    for p in policies:
        print(f"{p} ...", file=sys.stderr, flush=True)
        report["policies"][p] = run_policy(
            workload, p, args.pods, settings, progress=not args.no_progress
        )
    for p in [p for p in policies if p.startswith("ace")] if args.replicas > 1 else []:
        name = f"{p}_x{args.replicas}_replicas"
        print(f"{name} ...", file=sys.stderr, flush=True)
        report["policies"][name] = run_policy(
            workload, p, args.pods, settings, not args.no_progress, args.replicas
        )
        if args.share_ms is not None:
            name += "_shared"
            print(f"{name} ...", file=sys.stderr, flush=True)
            report["policies"][name] = run_policy(
                workload,
                p,
                args.pods,
                settings,
                not args.no_progress,
                args.replicas,
                args.share_ms / 1000,
            )

    if "ace" in report["policies"]:
        print(product_report(workload, args.pods, report))
        print()
    print(policy_table(report))
    print()
    print(bucket_table(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Non-default fleets get their own files, beside the default run's.
    shape = "" if args.pods == 8 and not args.num_gpu_blocks else f"-{args.pods}pods"
    shape += "-cpu-vllm" if args.engines == "cpu-vllm" else ""
    shape += f"-{args.num_gpu_blocks}blocks" if args.num_gpu_blocks else ""
    shape += (
        f"-scrape{round(args.scrape_interval * 1000)}ms" if args.scrape_interval is not None else ""
    )
    shape += "-no-access-log" if args.no_access_log else ""
    stem = out / f"report-{_slug(workload.name)}{shape}"
    path = stem.with_suffix(".json")
    report["plots"] = [] if args.no_plots else plot(report, stem)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nwrote {path}" + "".join(f", {p}" for p in report["plots"]))
    return 0


def add_router_view_options(ap: argparse.ArgumentParser) -> None:
    """What the simulated router learns of the pods, and when (``router_view``)."""
    ap.add_argument(
        "--scrape-interval",
        type=float,
        help="seconds between the router's reads of the pods' figures (default 0.1; "
        "ace-extproc reads a pod whose scrapes are slow up to ten times less often)",
    )
    ap.add_argument(
        "--no-access-log",
        action="store_true",
        help="the router is not told when a request is answered (a gateway without "
        "Envoy's access log): only the scrapes say so",
    )


def router_view(
    ap: argparse.ArgumentParser, args: argparse.Namespace, settings: SimSettings
) -> SimSettings:
    """``settings`` with ``add_router_view_options``' options applied."""
    if args.scrape_interval is not None:
        if not args.scrape_interval > 0:
            ap.error("--scrape-interval must be positive")
        settings = replace(settings, scrape_interval_s=args.scrape_interval)
    if args.no_access_log:
        settings = replace(settings, access_log_s=None)
    return settings


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(name).stem)


if __name__ == "__main__":
    raise SystemExit(main())
