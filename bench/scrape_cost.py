"""What one read of a real vLLM pod's ``/metrics`` costs the pod.

    python -m bench.scrape_cost [--scrapes 300] [--out bench/results/scrape-cost.json]

The router reads each pod's ``/metrics`` every ``scrape_interval_s`` (0.1 s). vLLM's API
server renders the exposition in Python, in the process that also tokenizes and streams
every request. On one real pod (``vllm_pods``: the CPU build, the tiny model) that has
served a few requests (so its histograms have samples), this reads ``/metrics``
``--scrapes`` times back to back and reports the API server's CPU a read (its own
process: the engine core is another), the wall time a read, the exposition's size, and
the share of one core the router's default interval would take from the pod: the whole
text, and the router's read of its own series by name (``metrics_text.SCRAPE_PATH``,
``_by_name``). Each with the pod idle, and with requests decoding (``--busy`` streams at
once, each 1,000 tokens out).

Then what a client feels: the render holds the API server's event loop, which streams
every request's tokens (prometheus-client's ASGI app renders synchronously). ``--busy``
streams decode ``--itl-tokens`` tokens each while the router's read is made every 1, 0.3,
0.1 and 0.05 s, or not at all, the regimes interleaved over ``--itl-rounds`` rounds; the
gaps between a stream's chunks at the client are reported per regime.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from ace_extproc.config import Settings
from ace_extproc.routing import metrics_text
from ace_extproc.vllm_pods import EnginesMissing, VllmOptions
from bench import record
from bench.engine_pair import real_pod
from bench.overhead import cpu_s

OUT = Path("bench/results/scrape-cost.json")

# While the streams decode: seconds between reads (None: no reads), and which read; the
# whole text at the router's interval too, side by side with its own read.
ITL_REGIMES: tuple[tuple[float | None, str], ...] = (
    (None, ""),
    (1.0, "_by_name"),
    (0.3, "_by_name"),
    (0.1, "_by_name"),
    (0.1, ""),
    (0.05, "_by_name"),
)


async def _stream(
    http: aiohttp.ClientSession, url: str, model: str, tag: str, out: int
) -> list[float]:
    """Stream a chat of ``out`` tokens; its gaps between chunks as received, ms."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{tag} tell me a long story"}],
        "max_tokens": out,
        "ignore_eos": True,
        "stream": True,
    }
    gaps: list[float] = []
    last: float | None = None
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue  # the blank line after each event
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1000)
            last = now
    return gaps


async def _read_every(
    http: aiohttp.ClientSession, url: str, interval: float, stop: asyncio.Event
) -> int:
    reads = 0
    while not stop.is_set():
        async with http.get(url) as resp:
            await resp.read()
        reads += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
    return reads


async def _itl(
    http: aiohttp.ClientSession, url: str, model: str, streams: int, tokens: int, rounds: int
) -> list[dict[str, Any]]:
    gaps: dict[tuple[float | None, str], list[float]] = {r: [] for r in ITL_REGIMES}
    reads = dict.fromkeys(ITL_REGIMES, 0)
    for r in range(rounds):
        for regime in ITL_REGIMES:
            interval, which = regime
            stop = asyncio.Event()
            reader = (
                asyncio.ensure_future(_read_every(http, url + PATHS[which], interval, stop))
                if interval is not None
                else None
            )
            tags = (f"itl {r} {interval}{which} {i}" for i in range(streams))
            for one in await asyncio.gather(*(_stream(http, url, model, t, tokens) for t in tags)):
                gaps[regime] += one
            stop.set()
            if reader is not None:
                reads[regime] += await reader
    out = []
    for (interval, which), g in gaps.items():
        g.sort()
        out.append(
            {
                "read_every_s": interval,
                "read": "by name" if which else "whole",
                "reads": reads[(interval, which)],
                "gaps": len(g),
                "gap_ms_p50": round(g[len(g) // 2], 2),
                "gap_ms_p99": round(g[int(0.99 * (len(g) - 1))], 2),
                "gap_ms_p999": round(g[int(0.999 * (len(g) - 1))], 2),
                "gap_ms_mean": round(statistics.fmean(g), 2),
            }
        )
    return out


# The whole exposition, and the router's read of its own series by name.
PATHS = {"": metrics_text.METRICS_PATH, "_by_name": metrics_text.SCRAPE_PATH}


async def _reads(
    http: aiohttp.ClientSession, url: str, pid: int, n: int, path: str
) -> dict[str, Any]:
    size, walls = 0, []
    cpu0 = cpu_s(pid)
    for _ in range(n):
        t = time.perf_counter()
        async with http.get(url + path) as resp:
            size = len(await resp.read())
        walls.append((time.perf_counter() - t) * 1000)
    cpu_ms = (cpu_s(pid) - cpu0) * 1000 / n
    interval_s = Settings().scrape_interval_s
    return {
        "bytes": size,
        "cpu_ms_per_read": round(cpu_ms, 3),
        "wall_ms_p50": round(statistics.median(walls), 2),
        "wall_ms_p99": round(sorted(walls)[int(0.99 * (len(walls) - 1))], 2),
        "core_share_at_default_interval": round(cpu_ms / 1000 / interval_s, 4),
    }


async def run(scrapes: int, busy: int, itl_tokens: int, itl_rounds: int) -> dict[str, Any]:
    options = VllmOptions.find()
    model = options.served_names[0]
    with tempfile.TemporaryDirectory() as tmp:
        async with real_pod(Path(tmp), options) as pods, aiohttp.ClientSession() as http:
            url, pid = pods.urls[0], pods.procs[0].pid  # type: ignore[union-attr]
            await asyncio.gather(*(_stream(http, url, model, f"warm {i}", 16) for i in range(8)))
            reads = {f"idle{k}": await _reads(http, url, pid, scrapes, p) for k, p in PATHS.items()}
            load = [
                asyncio.ensure_future(_stream(http, url, model, f"busy {i}", 1000))
                for i in range(busy)
            ]
            await asyncio.sleep(1.0)  # every stream admitted and decoding
            for k, p in PATHS.items():
                reads[f"decoding{k}"] = await _reads(http, url, pid, scrapes, p)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            itl = await _itl(http, url, model, busy, itl_tokens, itl_rounds) if itl_rounds else []
    return {
        "scrapes": scrapes,
        "busy_streams": busy,
        **reads,
        "itl_tokens": itl_tokens,
        "itl_rounds": itl_rounds,
        "chunk_gaps": itl,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--busy", type=int, default=8, help="streams decoding in the second part")
    ap.add_argument("--itl-tokens", type=int, default=1000, help="tokens a stream, each regime")
    ap.add_argument("--itl-rounds", type=int, default=4, help="rounds of every regime (0: none)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    try:
        doc = asyncio.run(run(args.scrapes, args.busy, args.itl_tokens, args.itl_rounds))
    except EnginesMissing as exc:
        print(f"{exc}")
        return 2
    print(
        f"{'pod':<18}{'bytes':>8}{'CPU ms':>8}{'wall p50':>10}{'wall p99':>10}{'core at 0.1 s':>15}"
    )
    for name in (f"{state}{k}" for state in ("idle", "decoding") for k in PATHS):
        r = doc[name]
        print(
            f"{name:<18}{r['bytes']:>8}{r['cpu_ms_per_read']:>8.2f}{r['wall_ms_p50']:>10.1f}"
            f"{r['wall_ms_p99']:>10.1f}{r['core_share_at_default_interval']:>14.1%}"
        )
    if doc["chunk_gaps"]:
        print(f"\n{args.busy} streams decoding: gaps between a stream's chunks at the client")
        print(
            f"{'read every':<20}{'reads':>7}{'gaps':>8}{'p50 ms':>8}{'p99 ms':>8}{'p99.9 ms':>10}"
        )
        for g in doc["chunk_gaps"]:
            every = (
                "never" if g["read_every_s"] is None else f"{g['read_every_s']:g} s, {g['read']}"
            )
            print(
                f"{every:<20}{g['reads']:>7}{g['gaps']:>8}{g['gap_ms_p50']:>8.1f}"
                f"{g['gap_ms_p99']:>8.1f}{g['gap_ms_p999']:>10.1f}"
            )
    record.write(args.out, {"command": record.command("bench.scrape_cost", argv), **doc})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
