"""How fast two real vLLM pods on this machine decode, alone and both at once, with their
cores split between them or shared.

    python -m bench.engine_cores [--repeats 8] [--out bench/results/engine-cores.json]

The real-engine tier runs two CPU vLLM servers on one machine. On a GPU fleet each pod
computes on an accelerator of its own, so a router that keeps both pods busy gets twice
the compute of one that keeps one busy. With every pod's compute threads on every core
(vLLM's ``VLLM_CPU_OMP_THREADS_BIND=nobind``), two pods busy at once oversubscribe the
cores, so that router is penalized instead. This measures it: for each way (``split``:
``vllm_pods.split_cores``, each pod on a core of its own; ``shared``), two pods started,
and ``--repeats`` times a streamed request of new text (about 1.2K tokens, 200 tokens
out, ``ignore_eos``) to one pod alone, then one to each pod at the same moment. Reported:
the median time from first to last token, alone and together, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from ace_extproc.vllm_pods import EnginesMissing, Pods, VllmOptions
from bench import record
from bench.engine_pair import free_port

OUT = Path("bench/results/engine-cores.json")
WAYS = ("split", "pinned", "shared")
OUTPUT_TOKENS = 200
PROMPT = "the quick brown fox jumps over the lazy dog " * 120


async def decode_ms(http: aiohttp.ClientSession, url: str, model: str, tag: str) -> float:
    """Milliseconds from the first streamed token to the last, of a prompt no cache holds."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"{tag} {PROMPT}"}],
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    first: float | None = None
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    return (time.perf_counter() - (first or time.perf_counter())) * 1000


async def one_way(way: str, repeats: int, niceness: int) -> dict[str, Any]:
    options = VllmOptions.find(cores=way, niceness=niceness)
    model = options.served_names[0]
    with tempfile.TemporaryDirectory() as tmp:
        pods = Pods(options, [free_port(), free_port()], Path(tmp))
        async with pods, aiohttp.ClientSession() as http:
            a, b = pods.urls
            await asyncio.gather(
                decode_ms(http, a, model, "warm"), decode_ms(http, b, model, "warm")
            )
            alone: list[float] = []
            together: list[float] = []
            for i in range(repeats):
                alone.append(await decode_ms(http, a, model, f"{way} alone {i}"))
                together += await asyncio.gather(
                    decode_ms(http, a, model, f"{way} a {i}"),
                    decode_ms(http, b, model, f"{way} b {i}"),
                )
    alone_ms, together_ms = statistics.median(alone), statistics.median(together)
    return {
        "way": way,
        "binds": [options.environment(i, 2)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)],
        "alone_ms": round(alone_ms, 1),
        "together_ms": round(together_ms, 1),
        "slowdown": round(together_ms / alone_ms, 2),
        "alone_runs_ms": [round(x, 1) for x in alone],
        "together_runs_ms": [round(x, 1) for x in together],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--engine-nice", type=int, default=10, help="the servers' niceness")
    ap.add_argument("--ways", default=",".join(WAYS), help=", ".join(WAYS))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    if not ways or any(w not in WAYS for w in ways):
        ap.error(f"--ways: some of {', '.join(WAYS)}")
    try:
        rows = [asyncio.run(one_way(way, args.repeats, args.engine_nice)) for way in ways]
    except EnginesMissing as exc:
        print(f"{exc}")
        return 2
    print(f"{'cores':<8}{'binds':<14}{'alone ms':>10}{'together ms':>13}{'slowdown':>10}")
    for r in rows:
        binds = " | ".join(r["binds"])
        print(
            f"{r['way']:<8}{binds:<14}{r['alone_ms']:>10.0f}{r['together_ms']:>13.0f}"
            f"{r['slowdown']:>9.2f}x"
        )
    doc = {"command": record.command("bench.engine_cores", argv), "tokens_out": OUTPUT_TOKENS}
    record.write(args.out, {**doc, "ways": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
