"""How long a real vLLM's gauges take to count a request the router has just sent.

    python -m bench.gauge_lag [--repeats 3] [--out bench/results/gauge-lag.json]

The router's queued-prefill estimate is corrected by scrapes of ``/metrics``, and an
idle reading (``vllm:num_requests_running`` and ``_waiting`` both 0) clears it. A request
shows in those gauges only once the API server has read and tokenized it and handed it
to the engine, so a scrape just after a pick can read the pod idle while the pick is on
its way (``routing/load.py`` keeps a pick counted for its modelled TTFT plus
``UNSEEN_MS``). On one idle real pod (``vllm_pods``: the CPU build, the tiny model), for
chat prompts of about 1k, 8k and 30k tokens, it sends one streamed request (new text, so
nothing is cached) and reads ``/metrics`` back to back until the first token: the lag is
the first read that counts the request, next to the TTFT and the router's allowance for
the same prompt. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from ace_extproc.latency import get_model
from ace_extproc.routing.load import UNSEEN_MS
from ace_extproc.vllm_pods import TTFT_MODEL, EnginesMissing, VllmOptions
from bench import record
from bench.calibrate_vllm import sized
from bench.engine_pair import real_pod

OUT = Path("bench/results/gauge-lag.json")
LENGTHS = (1024, 8192, 30_000)
_GAUGE = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", re.M)


async def _counted(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(f"{url}/metrics") as resp:
        return any(float(v) > 0 for v in _GAUGE.findall(await resp.text()))


async def one(http: aiohttp.ClientSession, url: str, model: str, text: str) -> dict[str, Any]:
    """Send ``text`` and read the gauges until its first token: (lag, TTFT) in ms."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
    body |= {"max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
    prompt_tokens = 0

    async def send() -> None:
        nonlocal first, prompt_tokens
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if first is None and b'"content"' in line:
                    first = time.perf_counter()
                if m := re.search(rb'"prompt_tokens":\s*(\d+)', line):
                    prompt_tokens = int(m.group(1))

    task = asyncio.ensure_future(send())
    counted: float | None = None
    while not task.done() and counted is None:
        if await _counted(http, url):
            counted = time.perf_counter()
    await task
    end = first or time.perf_counter()
    return {
        "prompt_tokens": prompt_tokens,
        "lag_ms": ((counted or end) - sent) * 1000,
        "counted_before_first_token": counted is not None and counted <= end,
        "ttft_ms": (end - sent) * 1000,
    }


async def run(repeats: int) -> dict[str, Any]:
    options = VllmOptions.find()
    model = get_model(TTFT_MODEL)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with real_pod(Path(tmp), options) as pods, aiohttp.ClientSession() as http:
            url = pods.urls[0]
            await one(http, url, options.served_names[0], "warm up")
            for target in LENGTHS:
                runs = [
                    await one(
                        http,
                        url,
                        options.served_names[0],
                        await sized(http, url, target, seed=target * 100 + i),
                    )
                    for i in range(repeats)
                ]
                tokens = round(statistics.median(r["prompt_tokens"] for r in runs))
                rows.append(
                    {
                        "target_tokens": target,
                        "prompt_tokens": tokens,
                        "lag_ms": round(statistics.median(r["lag_ms"] for r in runs), 1),
                        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 1),
                        "allowance_ms": round(model.ttft_ms(tokens) + UNSEEN_MS, 1),
                        "runs": runs,
                    }
                )
    return {"model": TTFT_MODEL, "repeats": repeats, "lengths": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    try:
        doc = asyncio.run(run(args.repeats))
    except EnginesMissing as exc:
        print(f"{exc}")
        return 2
    print(f"{'tokens':>8}{'lag ms':>9}{'TTFT ms':>9}{'kept ms':>9}")
    for row in doc["lengths"]:
        print(
            f"{row['prompt_tokens']:>8}{row['lag_ms']:>9.0f}{row['ttft_ms']:>9.0f}"
            f"{row['allowance_ms']:>9.0f}"
        )
    record.write(args.out, {"command": record.command("bench.gauge_lag", argv), **doc})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
