"""What one read of a real vLLM pod's ``/metrics`` costs the pod.

    python -m bench.scrape_cost [--scrapes 300] [--out bench/results/scrape-cost.json]

The router reads each pod's ``/metrics`` every ``scrape_interval_s`` (0.1 s). vLLM's API
server renders the exposition in Python, in the process that also tokenizes and streams
every request. On one real pod (``vllm_pods``: the CPU build, the tiny model) that has
served a few requests (so its histograms have samples), this reads ``/metrics``
``--scrapes`` times back to back and reports the API server's CPU a read (its own
process: the engine core is another), the wall time a read, the exposition's size, and
the share of one core the router's default interval would take from the pod. Twice: the
pod idle, and with requests decoding (``--busy`` streams at once, each 1,000 tokens out).
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

from ace_extproc.config import Settings
from ace_extproc.vllm_pods import EnginesMissing, VllmOptions
from bench import record
from bench.engine_pair import real_pod
from bench.overhead import cpu_s

OUT = Path("bench/results/scrape-cost.json")


async def _stream(http: aiohttp.ClientSession, url: str, model: str, tag: str, out: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{tag} tell me a long story"}],
        "max_tokens": out,
        "ignore_eos": True,
        "stream": True,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for _ in resp.content:
            pass


async def _reads(http: aiohttp.ClientSession, url: str, pid: int, n: int) -> dict[str, Any]:
    size, walls = 0, []
    cpu0 = cpu_s(pid)
    for _ in range(n):
        t = time.perf_counter()
        async with http.get(f"{url}/metrics") as resp:
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


async def run(scrapes: int, busy: int) -> dict[str, Any]:
    options = VllmOptions.find()
    model = options.served_names[0]
    with tempfile.TemporaryDirectory() as tmp:
        async with real_pod(Path(tmp), options) as pods, aiohttp.ClientSession() as http:
            url, pid = pods.urls[0], pods.procs[0].pid  # type: ignore[union-attr]
            await asyncio.gather(*(_stream(http, url, model, f"warm {i}", 16) for i in range(8)))
            idle = await _reads(http, url, pid, scrapes)
            load = [
                asyncio.ensure_future(_stream(http, url, model, f"busy {i}", 1000))
                for i in range(busy)
            ]
            await asyncio.sleep(1.0)  # every stream admitted and decoding
            loaded = await _reads(http, url, pid, scrapes)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    return {"scrapes": scrapes, "busy_streams": busy, "idle": idle, "decoding": loaded}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--busy", type=int, default=8, help="streams decoding in the second part")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    try:
        doc = asyncio.run(run(args.scrapes, args.busy))
    except EnginesMissing as exc:
        print(f"{exc}")
        return 2
    print(
        f"{'pod':<10}{'bytes':>8}{'CPU ms':>8}{'wall p50':>10}{'wall p99':>10}{'core at 0.1 s':>15}"
    )
    for name in ("idle", "decoding"):
        r = doc[name]
        print(
            f"{name:<10}{r['bytes']:>8}{r['cpu_ms_per_read']:>8.2f}{r['wall_ms_p50']:>10.1f}"
            f"{r['wall_ms_p99']:>10.1f}{r['core_share_at_default_interval']:>14.1%}"
        )
    record.write(args.out, {"command": record.command("bench.scrape_cost", argv), **doc})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
