"""In-process cost of one routing decision, step by step.

    python -m bench.decision [--iterations 2000] [--pods 8]

Steps, timed in turn within each iteration on the same requests: parse (body to
canonical prompt), hash (chained block hashes), pick (index lookup and placement),
rewrite (body splice and the Envoy protobuf answer, serialized: by the C fast path's
encoder where the ``answer`` piece is native, or by upb); "total" times the whole
header + body phase as the
server runs it, up to the answer's wire bytes (also in endpoint mode, beside cluster mode
in a loop of their own). A diagnostic: end-to-end figures (``bench.overhead``) decide;
the in-process target this once had is retired. Prompts of 1K/4K/16K/32K tokens (~4 bytes a
token), as multi-turn chats whose prefixes are already indexed, so picks are warm hits
(checked: ``hit_share``). Writes bench/results/decision.json. Also compares the C chat
parser with JSON decoders on the same bodies, the parse step on the workloads' own
bodies by request family (chat, agents with tools, token-id completions), and (unless
``--no-compare``) the whole benchmark on the C fast path against pure Python
(``ACE_EXTPROC_PURE_PYTHON=1``), run alternately in subprocesses so both see the same
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson

from ace_extproc import mutate, native, server
from ace_extproc import request as req
from ace_extproc.app import App, build
from ace_extproc.config import Config, Settings, sim_fleet
from ace_extproc.fleet_file import UpstreamMode
from ace_extproc.prefix import hash_prompt, scope_seed
from ace_extproc.processor import Processor, rewrite_body
from ace_extproc.routing import RoutingRequest
from bench import workloads

SIZES = (1024, 4096, 16384, 32768)  # prompt tokens
HEADERS = {
    ":path": req.CHAT_PATH,
    ":method": "POST",
    "content-type": "application/json",
    "authorization": "Bearer k",
}


def words(rng: random.Random, n_bytes: int) -> str:
    vocab = ["the", "cache", "prefix", "router", "token", "engine", "pod", "latency", "block"]
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(vocab)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def chat_body(rng: random.Random, tokens: int) -> bytes:
    """A conversation of ``tokens`` tokens: a long system prompt and a few turns."""
    total = tokens * 4
    system = words(rng, total // 2)
    turns: list[dict[str, Any]] = [{"role": "system", "content": system}]
    per_turn = (total - len(system)) // 6
    for i in range(6):
        turns.append(
            {"role": "user" if i % 2 == 0 else "assistant", "content": words(rng, per_turn)}
        )
    turns.append({"role": "user", "content": "and now?"})
    return msgspec.json.encode({"model": "sim-llama", "messages": turns, "max_tokens": 64})


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(fn: Any, iterations: int) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t = clock()
        fn()
        out.append((clock() - t) / 1000.0)
    return out


def warm_app(
    tokens: int, pods: int, upstream_mode: UpstreamMode = "cluster"
) -> tuple[App, list[bytes]]:
    """A process's parts, its index having seen 16 conversations of ``tokens`` tokens (returned)
    and unrelated traffic; the same for the same arguments."""
    rng = random.Random(tokens)
    fleet = sim_fleet([f"127.0.0.1:{9000 + i}" for i in range(pods)])
    # As the server builds it (its monitor not started: no probes or scrapes here): the
    # queue drain and the load accounting run on every pick.
    app = build(Config(fleet, Settings(salt_secret=b"bench", upstream_mode=upstream_mode)))
    proc = app.processor
    bodies = [chat_body(rng, tokens) for _ in range(16)]
    for b in bodies:
        proc.on_body(proc.on_headers(HEADERS, False), b)
    for i in range(2000):
        filler = hash_prompt(rng.randbytes(4096), None, proc.settings.block_bytes, i)
        proc.picker.pick(RoutingRequest(filler, b"", 1024, "anon", "m"), proc.fleet.available)
    return app, bodies


def bench_size(tokens: int, iterations: int, pods: int) -> dict[str, Any]:
    app, bodies = warm_app(tokens, pods)
    proc = app.processor
    s = proc.settings
    parsed = [req.parse(req.CHAT_PATH, b) for b in bodies]
    seed = scope_seed("anon", "sim-llama")
    hashes = [
        RoutingRequest(
            hash_prompt(p.prompt, p.cacheable_end, s.block_bytes, seed),
            p.prompt,
            len(p.prompt) // 4,
            "anon",
            p.model,
        )
        for p in parsed
    ]
    ctx = proc.on_headers(HEADERS, False)
    outcome = proc.on_body(ctx, bodies[0])
    server.tune_gc()  # as the server does once started
    fields = '"cache_prefix_id":"ace-kv-anon-0123456789abcdef","cache_salt":"' + "a" * 64 + '"'

    # Both end with the answer's wire bytes: gRPC serializes it on the same thread.
    def total_on(p: Processor, k: int) -> None:
        c = p.on_headers(HEADERS, False)
        out = p.on_body(c, bodies[k])
        mutate.body_decided(out, c.client_upstream).SerializeToString()

    # Endpoint mode (large and dynamic fleets): x-ace-upstream is the pod's ip:port,
    # with Envoy's fallback list and the endpoint-picker metadata; on a processor of
    # its own, warmed alike.
    endpoint = warm_app(tokens, pods, "endpoint")[0].processor

    def rewrite(k: int) -> None:
        outcome.body = rewrite_body(bodies[k], fields, False)
        mutate.body_decided(outcome, False).SerializeToString()

    timed: dict[str, Callable[[int], object]] = {
        "parse": lambda k: req.parse(req.CHAT_PATH, bodies[k]),
        "hash": lambda k: hash_prompt(
            parsed[k].prompt, parsed[k].cacheable_end, s.block_bytes, seed
        ),
        "pick": lambda k: proc.picker.pick(hashes[k], proc.fleet.available),
        "rewrite": rewrite,
        "total": lambda k: total_on(proc, k),
    }
    # Each iteration times every step in turn, so each runs with the caches the others
    # leave, as on the request path; timed in tight loops of their own they measured
    # up to 2x faster and summed to well under the total.
    steps: dict[str, list[float]] = {name: [] for name in timed}
    clock = time.perf_counter_ns
    for i in range(iterations):
        k = i % len(bodies)
        for name, fn in timed.items():
            t = clock()
            fn(k)
            steps[name].append((clock() - t) / 1000.0)
    # Endpoint mode beside cluster mode, in a loop of their own: a second processor's
    # decision in the loop above would change the caches every step there runs with.
    modes = {"cluster": proc, "endpoint": endpoint}
    by_mode: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(iterations):
        k = i % len(bodies)
        for mode, p in modes.items():
            t = clock()
            total_on(p, k)
            by_mode[mode].append((clock() - t) / 1000.0)
    # What the timed requests were: warm hits, as the table says (checked, not assumed).
    actions = [
        p.on_body(p.on_headers(HEADERS, False), b).action for p in modes.values() for b in bodies
    ]
    typed = msgspec.json.Decoder(req.ChatBody)
    json_cmp = {
        "c_chat_prompt": statistics.median(measure(lambda: chat_prompt(bodies[0]), iterations))
        if (chat_prompt := native.chat_prompt)
        else float("nan"),
        "msgspec_typed": statistics.median(measure(lambda: typed.decode(bodies[0]), iterations)),
        "orjson_dict": statistics.median(measure(lambda: orjson.loads(bodies[0]), iterations)),
    }
    return {
        "tokens": tokens,
        "body_bytes": statistics.mean(len(b) for b in bodies),
        "blocks": len(hashes[0].hashes.blocks),
        "steps_us": {
            name: {"p50": round(percentile(v, 0.5), 2), "p99": round(percentile(v, 0.99), 2)}
            for name, v in steps.items()
        },
        "json_decode_p50_us": {k: round(v, 2) for k, v in json_cmp.items()},
        "hit_share": actions.count("hit") / len(actions),
        "total_by_mode_p50_us": {m: round(percentile(v, 0.5), 2) for m, v in by_mode.items()},
        # What the total holds besides the four steps: the header phase, metrics, the
        # outcome and its trace, the pick log (p50s subtracted: an estimate).
        "other_p50_us": round(
            percentile(steps["total"], 0.5)
            - sum(percentile(steps[n], 0.5) for n in ("parse", "hash", "pick", "rewrite")),
            2,
        ),
    }


def block_size_costs(iterations: int) -> dict[int, dict[str, float]]:
    """The hash step of a 32K-token prompt at other block sizes: why 512 bytes."""
    parsed = req.parse(req.CHAT_PATH, chat_body(random.Random(7), 32768))
    out = {}
    for block in (64, 128, 256, 512, 1024):
        times = measure(
            lambda b=block: hash_prompt(parsed.prompt, parsed.cacheable_end, b, 1), iterations
        )
        out[block] = {
            "p50_us": round(statistics.median(times), 1),
            "blocks": len(parsed.prompt) // block,
        }
    return out


def family_parse_costs(iterations: int) -> dict[str, dict[str, float]]:
    """The parse step on the benchmark's own workloads, by request family: the C fast
    path (``request.parse``) against pure Python (``request.parse_pure``), each body
    of a family in turn. Mooncake (token-id completions) needs the shared traces."""
    families: dict[str, list[tuple[str, bytes]]] = {}
    # The first 64 bodies of each family are timed: Mooncake's first 64 are enough.
    for name, limit in (("seed800", None), ("mooncake", 64)):
        try:
            work = workloads.get(name, limit=limit)
        except (OSError, ValueError):
            continue  # the trace is not beside this checkout
        for r in work.requests:
            families.setdefault(r.family, []).append((r.path, r.body))
    out = {}
    for family, all_bodies in sorted(families.items()):
        bodies = all_bodies[:64]
        rounds = max(1, iterations // len(bodies))

        def parse_all(parse: Any, bodies: list[tuple[str, bytes]] = bodies) -> None:
            for path, body in bodies:
                parse(path, body)

        c, pure = (
            statistics.median(measure(lambda f=f: parse_all(f), rounds)) / len(bodies)
            for f in (req.parse, req.parse_pure)
        )
        out[family] = {
            "mean_body_bytes": round(statistics.mean(len(b) for _, b in bodies)),
            "c_us": round(c, 2),
            "pure_us": round(pure, 2),
            "ratio": round(pure / c, 2),
        }
    return out


def run_subprocess(pure: bool, iterations: int, pods: int) -> list[dict[str, Any]]:
    """This benchmark's rows from a fresh process, on pure Python or the C fast path."""
    env = {k: v for k, v in os.environ.items() if k != "ACE_EXTPROC_PURE_PYTHON"}
    if pure:
        env["ACE_EXTPROC_PURE_PYTHON"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decision.json"
        cmd = [sys.executable, "-m", "bench.decision", "--no-compare", "--out", str(out)]
        cmd += ["--iterations", str(iterations), "--pods", str(pods)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        rows: list[dict[str, Any]] = json.loads(out.read_text())["sizes"]
    return rows


def compare_paths(
    first: list[dict[str, Any]], iterations: int, pods: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Total and per-step p50s on the C fast path and on pure Python, side by side.
    Runs alternate (C: this process, pure, C, pure) so a drifting machine hits both;
    each path's figure is the mean of its two runs."""
    runs: dict[str, list[list[dict[str, Any]]]] = {"c": [first], "pure": []}
    runs["pure"].append(run_subprocess(True, iterations, pods))
    runs["c"].append(run_subprocess(False, iterations, pods))
    runs["pure"].append(run_subprocess(True, iterations, pods))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for i, row in enumerate(first):
        cells: dict[str, dict[str, float]] = {}
        for step in row["steps_us"]:
            c, pure = (
                statistics.mean(r[i]["steps_us"][step]["p50"] for r in runs[path])
                for path in ("c", "pure")
            )
            cells[step] = {"c": round(c, 2), "pure": round(pure, 2), "ratio": round(pure / c, 2)}
        out[str(row["tokens"])] = cells
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--out", default="bench/results/decision.json")
    ap.add_argument(
        "--no-compare", action="store_true", help="skip the C fast path vs pure Python runs"
    )
    args = ap.parse_args(argv)

    rows = [bench_size(t, args.iterations, args.pods) for t in SIZES]
    blocks = block_size_costs(args.iterations // 4)
    names = ["parse", "hash", "pick", "rewrite", "total"]
    print(
        f"decision cost in microseconds, p50 / p99 ({args.iterations} iterations, "
        f"{args.pods} pods, {native.describe()})"
    )
    print(f"{'tokens':>7} {'blocks':>6} " + " ".join(f"{n:>15}" for n in names))
    for r in rows:
        cells = " ".join(
            f"{r['steps_us'][n]['p50']:>7.1f}/{r['steps_us'][n]['p99']:<7.1f}" for n in names
        )
        print(f"{r['tokens']:>7} {r['blocks']:>6} {cells}")
    print(
        "total p50 minus the four steps' p50s (header phase, metrics, outcome, pick log):",
        ", ".join(f"{r['tokens']}: {r['other_p50_us']:.1f} us" for r in rows),
    )
    print(
        "total p50 in endpoint mode (x-ace-upstream ip:port, fallbacks, endpoint-picker "
        "metadata) vs cluster mode, side by side in a loop of their own:",
        ", ".join(
            f"{r['tokens']}: {r['total_by_mode_p50_us']['endpoint']:.1f} vs "
            f"{r['total_by_mode_p50_us']['cluster']:.1f} us"
            for r in rows
        ),
    )
    print(
        "chat body decode p50 us (C chat_prompt to canonical bytes vs msgspec typed vs orjson "
        "to dict):",
        ", ".join(
            f"{r['tokens']}: {r['json_decode_p50_us']['c_chat_prompt']:.1f} vs "
            f"{r['json_decode_p50_us']['msgspec_typed']:.1f} vs "
            f"{r['json_decode_p50_us']['orjson_dict']:.1f}"
            for r in rows
        ),
    )
    print(
        "hash step at 32K tokens by block size (us p50, blocks):",
        ", ".join(f"{b} B: {v['p50_us']:.1f} ({v['blocks']})" for b, v in blocks.items()),
    )
    families = family_parse_costs(args.iterations // 4)
    print(
        "parse step by request family, p50 us a body (C fast path vs pure Python):",
        ", ".join(
            f"{fam} ({v['mean_body_bytes'] // 1000} KB) {v['c_us']:.1f} vs {v['pure_us']:.1f} "
            f"({v['ratio']:.1f}x)"
            for fam, v in families.items()
        ),
    )
    paths = None
    if not args.no_compare and native.used:
        paths = compare_paths(rows, args.iterations, args.pods)
        print("C fast path vs pure Python, p50 us (mean of 2 alternating runs each), pure / C:")
        for tokens, by_step in paths.items():
            print(
                f"{tokens:>7} "
                + "  ".join(
                    f"{n} {by_step[n]['c']:.1f} vs {by_step[n]['pure']:.1f} "
                    f"({by_step[n]['ratio']:.2f}x)"
                    for n in names
                )
            )
    result = {
        "command": "python -m bench.decision",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "path": native.describe(),
        "iterations": args.iterations,
        "pods": args.pods,
        "sizes": rows,
        "hash_32k_by_block_bytes": blocks,
        "parse_by_family_p50_us": families,
        "c_vs_pure_p50_us": paths,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
