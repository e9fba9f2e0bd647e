"""Several ``bench.live`` runs' per-request records, pooled per router.

    python -m bench.pool_runs RECORDS... [--baseline ace] [--same [RUN:]NAME=AS] [--out FILE]

One run of 300 requests has its TTFT p99 set by its three slowest requests; on the
real-engine tier those are the first requests of new 25K-token documents, which every
router places alike (nothing is warm anywhere), and whose time moves by seconds between
two routers' turns of one run. Pooling the records (``--records FILE`` of each run,
JSON lines, gzipped or not) of runs of one command gives each percentile several times
the requests. Per router: answered requests, the engines' cached share, TTFT p50, p90,
p95 and p99; and each figure against ``--baseline``'s, as a ratio (below 1: lower).
Also the mean time from first token to last (decoding, which the engines' contention
for cores sets, not the placement), and TTFT p50 by the prompt tokens the engine had to
prefill (under 100, 1K, 4K, over): a fixed cost on the request path shows in every group.
Also, per router that names its pods, the requests that took their family (a
conversation, a document, an adapter's system prompt) to a pod it had not reached
while it was warm on another (``spread``): what was in flight at the warm pod and at
the new one when each was sent, and how many other families the warm pod's requests
in flight named (on a LoRA workload, its adapters in use against its slots).
Also per router of ours, its broken promises: requests its trace calls a hit whose
engine served less than half the tokens it promised (``saved_prefill_tokens``), and the
tokens short. Then how many requests each router sent to the same pod as the baseline,
and of those with the same cached tokens (placement and cache aside), by family: the
median of their TTFT less the baseline's for the same request of the same run, so a
router slower for some other reason shows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import record
from bench.overhead import percentile
from bench.workloads import lora

QUANTILES = (0.50, 0.90, 0.95, 0.99)
# Upper bounds of the uncached-token groups whose TTFT p50 is compared: a fixed cost on
# the request path shows in every group alike, a worse placement in the long ones.
UNCACHED_BOUNDS = (100, 1_000, 4_000, None)
_GROUPS = [f"under_{b}" if b else "over" for b in UNCACHED_BOUNDS]


def read(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def renamed(record: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    router = record["router"]
    return {**record, "router": renames[router]} if router in renames else record


def pooled(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per router: answered requests, cached share of prompt tokens, TTFT quantiles (ms)."""
    out: dict[str, dict[str, float]] = {}
    for router in dict.fromkeys(r["router"] for r in records):
        ok = [r for r in records if r["router"] == router and r["error"] is None]
        ttfts = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        figures: dict[str, float] = {
            "requests": len(ok),
            "ttft_mean_ms": round(statistics.fmean(ttfts), 1) if ttfts else 0.0,
            "cached_share": round(sum(r["cached_tokens"] or 0 for r in ok) / prompt, 4)
            if prompt
            else 0.0,
        }
        for q in QUANTILES:
            figures[f"ttft_p{round(q * 100)}_ms"] = round(percentile(ttfts, q), 1)
        short = [s for s in map(_short, ok) if s]
        figures["short_hits"], figures["short_hit_tokens"] = len(short), sum(short)
        # Time from the first token to the last: decoding, which no placement changes
        # but the engines' contention for the machine's cores does.
        streams = [
            r["latency_ms"] - r["ttft_ms"]
            for r in ok
            if r["ttft_ms"] is not None and r.get("latency_ms") is not None
        ]
        figures["after_first_token_mean_ms"] = (
            round(statistics.fmean(streams), 1) if streams else 0.0
        )
        for bound, group in _by_tokens(ok, "ttft_ms").items():
            figures[f"ttft_p50_uncached_{bound}_ms"] = round(percentile(group, 0.5), 1)
        # Envoy's hold of ours' requests (bench.live joins its access log): how much of
        # the TTFT routing took, and what is left without it.
        held = [r for r in ok if r.get("hold_ms") is not None and r["ttft_ms"] is not None]
        if held:
            holds = [r["hold_ms"] for r in held]
            figures["hold_p50_ms"] = round(percentile(holds, 0.5), 2)
            figures["hold_p99_ms"] = round(percentile(holds, 0.99), 2)
            less = [r["ttft_ms"] - r["hold_ms"] for r in held]
            figures["ttft_less_hold_p50_ms"] = round(percentile(less, 0.5), 1)
            # By the whole prompt's size: the body Envoy buffers and ace-extproc reads.
            for bound, group in _by_tokens(held, "hold_ms", cached_too=True).items():
                figures[f"hold_p50_prompt_{bound}_ms"] = round(percentile(group, 0.5), 2)
        out[router] = figures
    return out


def _by_tokens(
    ok: Sequence[dict[str, Any]], field: str, cached_too: bool = False
) -> dict[str, list[float]]:
    """Each record's ``field`` grouped by its prompt tokens ("under_100", ...): those the
    engine had to prefill, or with ``cached_too`` all of them."""
    groups: dict[str, list[float]] = {}
    for r in ok:
        if r.get(field) is None:
            continue
        tokens = (r["prompt_tokens"] or 0) - (0 if cached_too else r["cached_tokens"] or 0)
        bound = next(b for b in UNCACHED_BOUNDS if b is None or tokens < b)
        groups.setdefault("over" if bound is None else f"under_{bound}", []).append(r[field])
    return groups


def _short(r: dict[str, Any]) -> int:
    """The tokens a request routed as a hit was promised and not served, where the
    engine served less than half (0 otherwise, and for a router that writes no trace)."""
    trace = dict(kv.partition("=")[::2] for kv in (r.get("trace") or "").split(","))
    promised = int(trace.get("saved_prefill_tokens") or 0)
    cached = r["cached_tokens"] or 0
    return promised - cached if trace.get("action") == "hit" and cached < promised / 2 else 0


def _pinned(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per router that names its pods, its answered requests in the order sent."""
    ok = [
        r
        for r in records
        if r["error"] is None
        and r["pod"] is not None
        and r.get("sent_s") is not None
        and r.get("latency_ms") is not None
    ]
    mine: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(ok, key=lambda r: r["sent_s"]):
        mine.setdefault(r["router"], []).append(r)
    return mine


def _in_flight(mine: Sequence[dict[str, Any]], r: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's other requests in flight (sent, not yet answered) when ``r`` was
    sent, as the client saw them."""
    t = r["sent_s"]
    return [
        o for o in mine if o is not r and o["sent_s"] <= t < o["sent_s"] + o["latency_ms"] / 1000
    ]


def spread(runs: Sequence[Sequence[dict[str, Any]]]) -> dict[str, list[dict[str, int]]]:
    """Per router that names its pods: each request that took its family to a pod the
    family had not reached in its run while it had reached another, with what was in
    flight when it was sent: requests at the family's busiest warm pod (``warm``) and at
    the new pod (``here``), and the other families the warm pod's requests named
    (``others_warm``)."""
    out: dict[str, list[dict[str, int]]] = {}
    for records in runs:
        for router, mine in _pinned(records).items():
            reached: dict[str, set[str]] = {}
            for r in mine:
                pods = reached.setdefault(r["family"], set())
                if pods and r["pod"] not in pods:
                    flying = _in_flight(mine, r)
                    on = {pod: [o for o in flying if o["pod"] == pod] for pod in pods}
                    warm = max(sorted(pods), key=lambda pod: len(on[pod]))
                    out.setdefault(router, []).append(
                        {
                            "warm": len(on[warm]),
                            "here": sum(o["pod"] == r["pod"] for o in flying),
                            "others_warm": len({o["family"] for o in on[warm]} - {r["family"]}),
                        }
                    )
                pods.add(r["pod"])
    return out


def adapter_picks(
    runs: Sequence[Sequence[dict[str, Any]]], slots: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Per router whose trace says what a request's LoRA adapter needed on its pod
    (``adapter=loaded|load|wait``): the requests by that, and by whether the client
    counted ``slots`` or more other families (adapters) in flight at that pod when it
    was sent (``full``: a request the router priced as loading into a free slot there
    waited for one), with their count and TTFT p50 and max."""
    ttfts: dict[str, dict[str, list[float]]] = {}
    for records in runs:
        for router, mine in _pinned(records).items():
            for r in mine:
                fields = dict(
                    f.split("=", 1) for f in (r.get("trace") or "").split(",") if "=" in f
                )
                need = fields.get("adapter")
                if need is None or r.get("ttft_ms") is None:
                    continue
                others = {o["family"] for o in _in_flight(mine, r) if o["pod"] == r["pod"]}
                full = r["family"] not in others and len(others) >= slots
                key = f"{need}, full" if full else need
                ttfts.setdefault(router, {}).setdefault(key, []).append(r["ttft_ms"])
    return {
        router: {
            key: {
                "requests": len(v),
                "ttft_p50_ms": statistics.median(v),
                "ttft_max_ms": max(v),
            }
            for key, v in sorted(groups.items())
        }
        for router, groups in ttfts.items()
    }


def same_pod(runs: Sequence[Sequence[dict[str, Any]]], baseline: str) -> dict[str, list[int]]:
    """Per router: ``[requests sent to the same pod as the baseline's in the same run,
    requests both answered]``."""
    out: dict[str, list[int]] = {}
    for records in runs:
        ok = [r for r in records if r["error"] is None]
        base = {r["index"]: r["pod"] for r in ok if r["router"] == baseline}
        for r in ok:
            if r["router"] != baseline and r["index"] in base:
                counts = out.setdefault(r["router"], [0, 0])
                counts[0] += r["pod"] == base[r["index"]]
                counts[1] += 1
    return out


def paired(
    runs: Sequence[Sequence[dict[str, Any]]], baseline: str
) -> dict[str, dict[str, dict[str, float]]]:
    """Per router, per family: requests placed and cached as the baseline's in the same
    run, and the median of their TTFT less the baseline's (ms)."""
    diffs: dict[str, dict[str, list[float]]] = {}
    for records in runs:
        ok = [r for r in records if r["error"] is None and r["ttft_ms"] is not None]
        base = {r["index"]: r for r in ok if r["router"] == baseline}
        for r in ok:
            b = base.get(r["index"])
            if r["router"] == baseline or b is None:
                continue
            if (r["pod"], r["cached_tokens"]) == (b["pod"], b["cached_tokens"]):
                by_family = diffs.setdefault(r["router"], {})
                by_family.setdefault(r["family"], []).append(r["ttft_ms"] - b["ttft_ms"])
    return {
        router: {
            family: {"requests": len(d), "median_ttft_diff_ms": round(statistics.median(d), 1)}
            for family, d in sorted(families.items())
        }
        for router, families in diffs.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--baseline", default="ace")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--same",
        action="append",
        default=[],
        metavar="[RUN:]NAME=AS",
        help="pool router NAME's records as AS's, in the RUN-th records file (from 1) or "
        "in all: one configuration named differently in different runs (a setting's "
        "old default, say); repeatable",
    )
    ap.add_argument(
        "--lora-slots",
        type=int,
        default=lora.MAX_LORAS,
        help="the engines' --max-loras, for adapter_picks (default: lora-mix's, %(default)s)",
    )
    args = ap.parse_args(argv)
    renames: list[dict[str, str]] = [{} for _ in args.records]
    for spec in args.same:
        run, _, pair = spec.rpartition(":")
        name, eq, as_ = pair.partition("=")
        if not (eq and name and as_) or (
            run and not (run.isdigit() and 1 <= int(run) <= len(renames))
        ):
            ap.error(f"--same {spec!r}: expected [RUN:]NAME=AS, RUN from 1 to {len(renames)}")
        for i in [int(run) - 1] if run else range(len(renames)):
            renames[i][name] = as_
    runs = [
        [renamed(r, names) for r in read(path)]
        for path, names in zip(args.records, renames, strict=True)
    ]
    records = [r for run in runs for r in run]
    routers = pooled(records)
    alike = paired(runs, args.baseline)
    base = routers.get(args.baseline)
    names = [f"ttft_p{round(q * 100)}_ms" for q in QUANTILES]
    print(f"{len(args.records)} runs pooled")
    names = ["ttft_mean_ms", *names]
    print(
        f"{'router':<16}{'requests':>9}{'cached%':>9}"
        + "".join(f"{n.split('_')[1]:>9}" for n in names)
    )
    for router, f in routers.items():
        row = f"{router:<16}{f['requests']:>9.0f}{f['cached_share'] * 100:>9.2f}"
        row += "".join(f"{f[n]:>9.0f}" for n in names)
        if base is not None and router != args.baseline:
            ratios = " ".join(f"{f[n] / base[n]:.2f}x" for n in names if base[n])
            points = (f["cached_share"] - base["cached_share"]) * 100
            row += f"   vs {args.baseline}: {points:+.2f} points, TTFT {ratios}"
        print(row)
    print("hits served less than half the tokens promised: requests, tokens short")
    for router, f in routers.items():
        print(f"  {router:<14}{f['short_hits']:>6.0f}{f['short_hit_tokens']:>9.0f}")
    for router, f in routers.items():
        if "hold_p50_ms" in f:
            print(
                f"{router}: Envoy held its requests {f['hold_p50_ms']:.2f} ms at p50, "
                f"{f['hold_p99_ms']:.2f} at p99; its TTFT p50 without: "
                f"{f['ttft_less_hold_p50_ms']:.1f} ms; its hold's p50 by prompt tokens: "
                + " ".join(
                    f"{name} {f[key]:.2f}"
                    for name in _GROUPS
                    if (key := f"hold_p50_prompt_{name}_ms") in f
                )
            )
    print("mean ms from first token to last; TTFT p50 ms by uncached prompt tokens")
    for router, f in routers.items():
        groups = " ".join(
            f"{name} {f[key]:.0f}"
            for name in _GROUPS
            if (key := f"ttft_p50_uncached_{name}_ms") in f
        )
        print(f"  {router:<14}{f['after_first_token_mean_ms']:>8.0f}   {groups}")
    moves = spread(runs)
    for router, moved in moves.items():
        print(f"{router}: {len(moved)} requests took their family to another pod; in flight")
        for key, what in (("warm", "at its warm pod"), ("here", "at the new pod")):
            counts = sorted(Counter(m[key] for m in moved).items())
            print(f"  {what}: " + ", ".join(f"{n}: {c}" for n, c in counts))
        counts = sorted(Counter(m["others_warm"] for m in moved).items())
        print("  other families at its warm pod: " + ", ".join(f"{n}: {c}" for n, c in counts))
    picks = adapter_picks(runs, args.lora_slots)
    for router, needs in picks.items():
        print(
            f"{router}: what its trace says a request's adapter needed on its pod "
            f"(full: {args.lora_slots}+ other adapters in flight there): requests, "
            "TTFT p50, max ms"
        )
        for key, g in needs.items():
            print(f"  {key:<14}{g['requests']:>6}{g['ttft_p50_ms']:>9.0f}{g['ttft_max_ms']:>9.0f}")
    pods = same_pod(runs, args.baseline)
    for router, (same, total) in pods.items():
        print(f"{router}: {same} of {total} requests on {args.baseline}'s pod")
    for router, families in alike.items():
        print(f"{router}, placed and cached as {args.baseline}: TTFT less its, median ms")
        for family, f in families.items():
            print(f"  {family:<14}{f['requests']:>6.0f}{f['median_ttft_diff_ms']:>+9.0f}")
    if args.out:
        doc = {
            "command": record.command("bench.pool_runs", argv),
            "runs": [str(p) for p in args.records],
            "routers": routers,
            "same_pod": pods,
            "spread": {router: len(moved) for router, moved in moves.items()},
            "adapter_picks": picks,
            "placed_alike": alike,
        }
        record.write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
