"""Approximate, precise and speculative+precise routing, side by side, in the fleet
simulation: the same workload, fleet and policy (``ace``), only what the router knows
of the pods' caches changes.

    python -m bench.precise_sim --workload all             # every workload, both fleets
    python -m bench.precise_sim --workload seed800 --fleets kv-pressure --limit 300
    python -m bench.precise_sim --workload all --fleets kv-tight --replicas 2 --seeds 4

Variants (``VARIANTS``):

* ``approximate``: today's default, the approximate index (where the router sent each
  prefix, aged out by a model of the engine's LRU).
* ``precise@D``: the pods publish KV events (``SimSettings.kv_events``), delivered to
  the router's precise index ``D`` later in simulated time; the destination has
  ``tokenizer: sim`` so the production ``Processor`` keys each request token-exact;
  ``router.precise.speculate`` off: the index holds only what the events said.
* ``precise+spec@D``: the same with speculation on (the default): a pick counts as
  held on its pod until the events confirm it.
* ``approximate+shared`` (``--replicas N``): N replicas sharing their placements
  through Redis, 3 ms late; every other variant then runs as N replicas sharing
  no placements, each with its own precise index fed by every pod's events. All N
  see one load view, as sharing replicas do in this simulation.

Fleets (``FLEETS``): ``default`` (the simulation's 16,384 blocks a pod) and
``kv-pressure`` (4,096 blocks, 64K tokens: a pod holds a few prompts, so engines
evict and the approximate index's model of their LRU is tested), ``kv-tight`` (2,048
blocks, 32K tokens: the largest prompts barely fit), ``vllm-cpu`` (the real-engine
tier's pods at 2,048 blocks, as ``bench.live --engine vllm --kv-blocks 2048`` runs
them; with ``--pods 2 --limit 300 --rate 1``, the shape of its precise runs).

``--clear-every S``: every S simulated seconds a pod's cache is emptied of what no
running request holds, the pods in turn, and the router is not told (a restart's
effect on the cache: ``FleetEvent`` "clear"). The approximate index keeps guessing
what it sent there; the events say ``AllBlocksCleared``. Writes
``precise-sim-clearS.json`` unless ``--out``.

Per variant: TTFT p50/p99, the share of prompt tokens the engines reported cached
(``saved%``, what ``usage.cached_tokens`` says), requests with any hit, evictions, the
router's estimate error (|its estimated saved tokens - the engine's cached| over the
prompt tokens), what the precise index made of the events, and ``alike%``: of the
requests keyed by the events, the share whose deepest pods the approximate index
guessed alike (where it is near 100, the events have little to steer by). Writes
``bench/results/precise-sim.json`` (one entry per workload, merged into the file).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from datetime import date
from pathlib import Path
from typing import Any

from bench import workloads
from bench.baselines import resolve
from bench.fleetsim import RunResult, SimSettings, simulate, summarize
from bench.fleetsim.settings import cpu_vllm
from bench.workloads.base import FleetEvent, Workload

OUT = Path("bench/results/precise-sim.json")
DELAYS_S = (0.0, 0.05, 0.5)
FLEETS: dict[str, SimSettings] = {
    "default": SimSettings(),
    "kv-pressure": SimSettings(num_gpu_blocks=4096),
    # 32K tokens: the largest prompt of most workloads still fits (not Mooncake's).
    "kv-tight": SimSettings(num_gpu_blocks=2048),
    # The real-engine tier's pods (bench.live --engine vllm --kv-blocks 2048): the CPU
    # build's block size, batch limit and calibrated TTFT model, to predict those runs.
    "vllm-cpu": cpu_vllm(2048),
}
# Workloads too big to run whole for every variant here: their first N requests.
DEFAULT_LIMITS: dict[str, int] = {"mooncake": 1000}
UNSEEDED = frozenset({"mooncake"})  # a replayed trace: every seed the same requests


def _delay(d: float) -> str:
    return f"{d * 1000:g}ms"


# A variant's fields that are ``simulate``'s arguments, not ``SimSettings``'.
RUN_FIELDS = ("replicas", "share_delay_s", "common_load")
SHARE_DELAY_S = 0.003  # Redis pub/sub between replicas (bench.report --share-ms 3)


def variants(delays: tuple[float, ...] = DELAYS_S, replicas: int = 1) -> dict[str, dict[str, Any]]:
    """Name -> the ``SimSettings`` fields it changes (and, with replicas, how many
    routers take turns: each keys and speculates alone, every one reads the events).
    Replicas all see one load view, so only what they know of placements
    differs between variants."""
    if replicas > 1:
        every = {"replicas": replicas, "common_load": True}
        plain = variants(delays)
        shared = {"approximate+shared": {"share_delay_s": SHARE_DELAY_S}}
        return {name: {**fields, **every} for name, fields in {**plain, **shared}.items()}
    out: dict[str, dict[str, Any]] = {"approximate": {}}
    for spec, label in ((False, "precise"), (True, "precise+spec")):
        for d in delays:
            out[f"{label}@{_delay(d)}"] = {
                "kv_events": True,
                "speculate": spec,
                "event_delay_s": d,
            }
    return out


VARIANTS = variants()


def figures(result: RunResult) -> dict[str, Any]:
    """One variant's figures."""
    s = summarize(result)
    records = result.records
    prompt = sum(r.prompt_tokens for r in records)
    error = sum(abs(r.estimated_saved_tokens - r.cached_tokens) for r in records)
    return {
        "requests": s["requests"],
        "ttft_p50_ms": round(s["ttft_p50_ms"], 2),
        "ttft_p99_ms": round(s["ttft_p99_ms"], 2),
        "ttft_mean_ms": round(s["ttft_mean_ms"], 2),
        "prefill_saved_ratio": round(s["prefill_saved_ratio"], 4),
        "hit_ratio": round(s["hit_ratio"], 4),
        "estimate_error": round(error / prompt, 4) if prompt else 0.0,
        "evictions": s["evictions"],
        "rejected": s["rejected"],
        "imbalance": round(s["imbalance"], 3),
        "wall_s": round(result.wall_s, 2),
        **{k: v for k, v in result.extra.items() if k != "scrapes"},
    }


def with_clears(workload: Workload, pods: int, every_s: float) -> Workload:
    """``workload`` with a pod's cache cleared every ``every_s`` seconds while requests
    arrive, pods in turn (slot 0 first), beside its own fleet events."""
    if every_s <= 0 or not workload.requests:
        return workload
    end = workload.requests[-1].arrival_s
    clears = [
        FleetEvent(round(k * every_s, 6), "clear", (k - 1) % pods)
        for k in range(1, int(end // every_s) + 1)
    ]
    events = sorted([*workload.events, *clears], key=lambda e: e.at_s)
    return replace(workload, events=events)


def run_workload(
    workload: Workload,
    pods: int,
    fleets: dict[str, SimSettings],
    chosen: dict[str, dict[str, Any]],
    *,
    policy: str = "ace",
    log: bool = True,
) -> dict[str, dict[str, dict[str, Any]]]:
    """fleet -> variant -> figures, every variant on the same requests."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for fleet, base in fleets.items():
        out[fleet] = {}
        for name, fields in chosen.items():
            run = {k: v for k, v in fields.items() if k in RUN_FIELDS}
            sim = {k: v for k, v in fields.items() if k not in RUN_FIELDS}
            result = simulate(
                workload,
                resolve(policy),
                pods=pods,
                settings=replace(base, **sim),
                progress=False,
                **run,
            )
            out[fleet][name] = figures(result)
            if log:
                print(
                    f"  {workload.name} {fleet} {name}: {result.wall_s:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return out


def mean_of(runs: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Several seeds' ``run_workload`` results as one: each number the mean over the
    seeds, and each variant's prefill saved per seed beside it (a single run of the
    fleet simulation moves by a few points from one seed to the next: one pick sent
    elsewhere changes what every later pick finds)."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for fleet, by_variant in runs[0].items():
        out[fleet] = {}
        for variant, first in by_variant.items():
            each = [run[fleet][variant] for run in runs]
            merged: dict[str, Any] = {}
            for key, value in first.items():
                numbers = [f[key] for f in each]
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[key] = round(sum(numbers) / len(numbers), 4)
                else:
                    merged[key] = value
            merged["prefill_saved_by_seed"] = [f["prefill_saved_ratio"] for f in each]
            out[fleet][variant] = merged
    return out


def table(name: str, fleets: dict[str, dict[str, dict[str, Any]]]) -> str:
    head = (
        f"{'fleet':<12}{'variant':<22}{'p50 ms':>9}{'p99 ms':>10}{'saved%':>8}"
        f"{'hit%':>7}{'est.err%':>9}{'evict':>10}{'alike%':>8}{'wall s':>8}"
    )
    rows = [name, head, "-" * len(head)]
    for fleet, by_variant in fleets.items():
        for variant, f in by_variant.items():
            rows.append(
                f"{fleet:<12}{variant:<22}{f['ttft_p50_ms']:>9.1f}{f['ttft_p99_ms']:>10.1f}"
                f"{f['prefill_saved_ratio'] * 100:>8.1f}{f['hit_ratio'] * 100:>7.1f}"
                f"{f['estimate_error'] * 100:>9.1f}{f['evictions']:>10}"
                f"{_alike(f):>8}{f['wall_s']:>8.1f}"
            )
    return "\n".join(rows)


def _alike(f: dict[str, Any]) -> str:
    """The share of keyed requests whose deepest pods the approximate index guessed as
    the events said ("-" without events)."""
    share = f.get("guess_agreed")
    return "-" if share is None else f"{share * 100:.1f}"


def markdown(doc: dict[str, Any]) -> str:
    """The file's figures as one Markdown table (for bench/RESULTS.md)."""
    rows = [
        "| workload | fleet | variant | TTFT p50 ms | p99 ms | saved % | hit % | est. err % "
        "| evictions | guess alike % |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in doc.get("workloads", {}).items():
        label = name + (f" (first {entry['limit']})" if entry.get("limit") else "")
        for fleet, by_variant in entry["fleets"].items():
            for variant, f in by_variant.items():
                rows.append(
                    f"| {label} | {fleet} | {variant} | {f['ttft_p50_ms']:.1f} "
                    f"| {f['ttft_p99_ms']:.0f} | {f['prefill_saved_ratio'] * 100:.1f} "
                    f"| {f['hit_ratio'] * 100:.1f} | {f['estimate_error'] * 100:.1f} "
                    f"| {f['evictions']} | {_alike(f)} |"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Approximate vs precise routing, per workload.")
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(workloads.NAMES)}, all")
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--limit", type=int, help="the first N requests of each workload")
    ap.add_argument("--fleets", default="default,kv-pressure", help=", ".join(FLEETS))
    ap.add_argument(
        "--delays-ms", default=",".join(f"{d * 1000:g}" for d in DELAYS_S), help="event delays"
    )
    ap.add_argument(
        "--policy",
        default="ace",
        help="ours with router settings changed, as bench.report: e.g. ace@min_match=0",
    )
    ap.add_argument("--rate", type=float, help="requests/s, as bench.live --rate")
    ap.add_argument("--seed", type=int, default=0, help="the workload generator's seed")
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="N seeds from --seed, each figure their mean (a trace that takes no seed, "
        "Mooncake, runs once)",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N routers taking turns, sharing nothing (and approximate+shared: through "
        "Redis); writes precise-sim-replicasN.json unless --out",
    )
    ap.add_argument(
        "--clear-every",
        type=float,
        default=0.0,
        metavar="S",
        help="empty a pod's cache every S simulated seconds, pods in turn, unannounced "
        "(a restart); writes precise-sim-clearS.json unless --out",
    )
    ap.add_argument("--out")
    ap.add_argument("--markdown", action="store_true", help="print --out's table; run nothing")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.clear_every < 0:
        ap.error("--clear-every must not be negative")
    if args.out is None:
        stem = "precise-sim"
        if args.replicas > 1:
            stem += f"-replicas{args.replicas}"
        if args.clear_every:
            stem += f"-clear{args.clear_every:g}"
        args.out = str(OUT.with_name(f"{stem}.json"))
    if args.markdown:
        print(markdown(json.loads(Path(args.out).read_text())))
        return 0
    names = list(workloads.NAMES) if args.workload == "all" else [args.workload]
    fleets = {f: FLEETS[f] for f in args.fleets.split(",") if f}
    delays = tuple(float(d) / 1000 for d in args.delays_ms.split(",") if d)
    chosen = variants(delays, args.replicas)
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    doc.update(
        {
            "command": "python -m bench.precise_sim "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": date.today().isoformat(),
            "python": platform.python_version(),
            "pods": args.pods,
            "policy": args.policy,
            "clear_every_s": args.clear_every,
            "fleets": {f: asdict(s) for f, s in fleets.items()},
            "variants": chosen,
        }
    )
    doc.setdefault("workloads", {})
    for name in names:
        limit = args.limit or DEFAULT_LIMITS.get(name)
        seeds = range(args.seed, args.seed + (1 if name in UNSEEDED else args.seeds))
        try:
            runs = [
                with_clears(
                    workloads.get(name, seed=seed, limit=limit, rate=args.rate),
                    args.pods,
                    args.clear_every,
                )
                for seed in seeds
            ]
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        workload = runs[0]
        begin = time.perf_counter()
        result = mean_of(
            [run_workload(w, args.pods, fleets, chosen, policy=args.policy) for w in runs]
        )
        wall = round(time.perf_counter() - begin, 1)
        entry = doc["workloads"].get(name)
        if entry is None or entry.get("requests") != len(workload.requests):
            entry = doc["workloads"][name] = {"fleets": {}, "wall_s": {}}
        entry.update(requests=len(workload.requests), limit=limit, seeds=list(seeds))
        if not isinstance(entry.get("wall_s"), dict):  # an older file: the total
            old = entry["fleets"]
            entry["wall_s"] = dict.fromkeys(
                old, round(entry.get("wall_s", 0) / max(1, len(old)), 1)
            )
        entry["fleets"].update(result)  # a run of some fleets keeps the others'
        entry["wall_s"].update(dict.fromkeys(result, round(wall / len(result), 1)))
        note = f" (first {limit} requests)" if limit else ""
        print(table(f"{name}: {len(workload.requests)} requests{note}", result))
        print(f"({wall} s)\n", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
