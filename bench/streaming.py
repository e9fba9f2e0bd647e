"""Streamed responses through Envoy + ace-extproc: are chunks unchanged and undelayed?

    python -m bench.streaming [--requests 12] [--tokens 48] [--tpot-ms 10]

Starts the local stack twice, with usage capture off (the default: Envoy's access log
reports each response, no filter sees its body) and on (an observe-only filter reads
each streamed body, and ace-extproc adds ``stream_options.include_usage`` to streamed
requests). In each, the same
streamed chat requests go alternately straight to a pod and through Envoy, so both
paths share the machine's noise. Per path: time to the first event, the gaps between
consecutive SSE events (inter-token latency, ITL), and whether the generated text
arrived exactly as the pod sends it. The figure that matters is the ITL added by the
proxy path over the direct one, with capture off and on. Writes
bench/results/streaming.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ace_extproc.stack import Stack, StackOptions
from bench.overhead import free_ports


@dataclass
class Stream:
    ttft_ms: float
    gaps_ms: list[float]
    text: str  # the generated text, concatenated from the deltas
    usage: dict[str, Any] | None  # the final usage chunk, if any
    events: int


@dataclass
class PathStats:
    streams: list[Stream] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        gaps = sorted(g for s in self.streams for g in s.gaps_ms)
        return {
            "requests": len(self.streams),
            "ttft_p50_ms": round(statistics.median(s.ttft_ms for s in self.streams), 2),
            "itl_p50_ms": round(statistics.median(gaps), 3),
            "itl_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 3),
            "itl_mean_ms": round(statistics.fmean(gaps), 3),
            "with_usage_chunk": sum(s.usage is not None for s in self.streams),
        }


def body(i: int, tokens: int) -> dict[str, Any]:
    system = f"[stream-{i % 3}] " + "You answer questions about streaming. " * 40
    return {
        "model": "sim-llama",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}"},
        ],
        "max_tokens": tokens,
        "stream": True,
    }


async def stream(http: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> Stream:
    sent = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    usage = None
    async with http.post(url + "/v1/chat/completions", json=doc) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices"):
                arrivals.append(now)
                text.append(event["choices"][0]["delta"].get("content") or "")
    gaps = [(b - a) * 1000 for a, b in pairwise(arrivals)]
    return Stream((arrivals[0] - sent) * 1000, gaps, "".join(text), usage, len(arrivals))


async def run_variant(capture: bool, requests: int, tokens: int, tpot_ms: float) -> dict[str, Any]:
    ports = free_ports(6)
    stack = Stack(
        StackOptions(
            pods=2,
            first_pod_port=ports[0],
            listen=f"127.0.0.1:{ports[2]}",
            admin=f"127.0.0.1:{ports[3]}",
            ext_proc=f"127.0.0.1:{ports[4]}",
            metrics=f"127.0.0.1:{ports[5]}",
            admin_api="off",
            time_scale=1.0,
            sim_args=["--tpot-ms", str(tpot_ms)],
            router={"usage_capture": capture},
            env={"ACE_SALT_SECRET": "bench"},
        )
    )
    await stack.start()
    direct, proxied = PathStats(), PathStats()
    same_text = True
    try:
        assert stack.config is not None
        pod_url = stack.config.fleet.pods[0].base_url
        async with aiohttp.ClientSession() as http:
            for i in range(requests):
                doc = body(i, tokens)
                a = await stream(http, pod_url, doc)
                b = await stream(http, stack.url, doc)
                direct.streams.append(a)
                proxied.streams.append(b)
                same_text &= a.text == b.text and a.events == b.events
            told = sum(
                s.usage["prompt_tokens_details"]["cached_tokens"]
                for s in proxied.streams
                if s.usage and s.usage.get("prompt_tokens_details")
            )
            # The observe filter reports after each response ends: wait for the last
            # reports (up to 5 s on a loaded machine), not a fixed pause.
            deadline = time.monotonic() + 5.0
            while True:
                async with http.get(f"http://127.0.0.1:{ports[5]}/metrics") as resp:
                    metrics = await resp.text()
                observed = _sample(metrics, "ace_response_cached_tokens_total")
                if not capture or observed >= told or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
    finally:
        await stack.stop()
    d, p = direct.summary(), proxied.summary()
    return {
        # What the clients were told in the usage chunks, and what ace-extproc read from
        # the same streams (its observe filter; 0 without usage capture).
        "cached_tokens_in_usage_chunks": told,
        "cached_tokens_observed": _sample(metrics, "ace_response_cached_tokens_total"),
        "usage_capture": capture,
        "direct": d,
        "through_envoy": p,
        "added_itl_p50_ms": round(p["itl_p50_ms"] - d["itl_p50_ms"], 3),
        "added_itl_p99_ms": round(p["itl_p99_ms"] - d["itl_p99_ms"], 3),
        "added_itl_mean_ms": round(p["itl_mean_ms"] - d["itl_mean_ms"], 3),
        "text_unchanged": same_text,
    }


def _sample(text: str, name: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tpot-ms", type=float, default=10.0)
    ap.add_argument("--out", default="bench/results/streaming.json")
    args = ap.parse_args(argv)
    variants = [
        asyncio.run(run_variant(capture, args.requests, args.tokens, args.tpot_ms))
        for capture in (False, True)
    ]
    print(
        f"streamed chat, {args.requests} requests x {args.tokens} tokens, "
        f"pod decode {args.tpot_ms} ms/token; ITL in ms"
    )
    print(
        f"{'usage capture':>14} {'path':>14} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'usage chunks':>12}"
    )
    for v in variants:
        for path in ("direct", "through_envoy"):
            s = v[path]
            print(
                f"{'on' if v['usage_capture'] else 'off':>14} {path:>14} {s['ttft_p50_ms']:>9} "
                f"{s['itl_p50_ms']:>8} {s['itl_p99_ms']:>8} {s['with_usage_chunk']:>12}"
            )
        print(
            f"{'':>14} {'added':>14} {'':>9} {v['added_itl_p50_ms']:>8} "
            f"{v['added_itl_p99_ms']:>8}   text unchanged: {v['text_unchanged']}"
        )
    doc = {
        "command": "python -m bench.streaming",
        "machine": f"{platform.machine()} {platform.python_version()}",
        "requests": args.requests,
        "tokens": args.tokens,
        "tpot_ms": args.tpot_ms,
        "variants": variants,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
