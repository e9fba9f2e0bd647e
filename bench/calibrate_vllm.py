"""Calibrate the TTFT model on a real vLLM pod, and check the sim against it.

    python -m bench.calibrate_vllm [--repeats 9] [--out bench/results/calibrate-vllm.json]
                                   [--real URL] [--sim-only]

On one idle real pod (``vllm_pods``: the CPU build, the tiny model), for prompts of about
256, 1k, 2k, 4k, 8k and 16k tokens of its own tokenizer (sized with ``/tokenize``), it
measures TTFT: from sending a streamed ``/v1/completions`` request (``max_tokens`` 1) to
the first SSE ``data:`` event carrying a token. *Cold*: the prompt with a fresh start (a
nonce first, so no block of it is cached); *warm*: the same prompt again at once (all but
the last partial block cached). Each length, ``--repeats`` times, interleaved so the
machine's noise spreads over all lengths; medians. One unmeasured round first warms the
server up.

The model ``TTFT_ms = t0 + p*(n + c) + max(t_step, a*n + b*n*(c + n/2))`` (``latency.py``)
is fitted to the cold and warm medians (``bench/ttft_fit.py``: least squares on relative
error), and the cold/warm ratio given per length. Every prefill measured lasts longer than
one engine step, so TTFT cannot tell ``t_step``: it is measured on the same pod as the
time between streamed tokens of ``DECODE_BATCHES`` requests decoding together (medians;
``t_step`` is one request's, the floor of a step), which is also what a step costs the
requests waiting to prefill behind it.

Then the same measurement on ``ace-extproc sim --ttft-model vllm-cpu-tiny --time-scale 1``
(prompts sized by the sim's own tokenizer), with the coefficients latency.py holds when it
runs: after putting the fitted ones there, ``--sim-only`` measures the sim again and
updates the result file's ``sim`` part. The sim's figures are the client's TTFT and the
sim's own ``sim_ttft_ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from ace_extproc.latency import get_model
from ace_extproc.vllm_pods import BLOCK_SIZE, TTFT_MODEL, EnginesMissing, VllmOptions
from bench import record
from bench.engine_pair import free_port, kv_blocks, real_pod, sim_argv, sim_pod
from bench.parity import expected_cached
from bench.ttft_fit import Point, fit

OUT = Path("bench/results/calibrate-vllm.json")
LENGTHS = (256, 1024, 2048, 4096, 8192, 16384)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_TOKENS = 200
_VOCAB = (
    "return", "value", "self", "import", "class", "def", "None", "list", "item", "data",
    "path", "error", "result", "config", "request", "token", "block", "cache", "engine",
    "prefix", "while", "for", "in", "if", "else", "lambda", "yield", "assert", "string",
)  # fmt: skip


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_VOCAB) for _ in range(n))


async def _count(http: aiohttp.ClientSession, url: str, text: str) -> int:
    async with http.post(f"{url}/tokenize", json={"prompt": text}) as resp:
        resp.raise_for_status()
        return int((await resp.json())["count"])


async def sized(http: aiohttp.ClientSession, url: str, target: int, seed: int) -> str:
    """Text of about ``target`` tokens by the pod's tokenizer (within ~1%)."""
    words = target
    for _ in range(4):
        text = _words(seed, words)
        got = await _count(http, url, text)
        if abs(got - target) <= target * 0.01:
            break
        words = max(1, round(words * target / got))
    return text


async def ttft(http: aiohttp.ClientSession, url: str, prompt: str) -> dict[str, Any]:
    """One streamed request: the client's TTFT, and the usage (and sim_ttft_ms) at the end."""
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first: float | None = None
    last: dict[str, Any] = {}
    sent = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            # A completions stream has no role chunk: its first event with a choice is the
            # first token's (whose text may be empty: the tiny model's output is noise).
            if first is None and event.get("choices"):
                first = time.perf_counter()
            if event.get("usage"):
                last = event
    if first is None:
        raise RuntimeError(f"{url}: no token in the stream")
    use = last["usage"]
    return {
        "ttft_ms": (first - sent) * 1000,
        "prompt_tokens": use["prompt_tokens"],
        "cached": use["prompt_tokens_details"]["cached_tokens"],
        "sim_ttft_ms": last.get("sim_ttft_ms"),
    }


async def measure(url: str, repeats: int, label: str) -> list[dict[str, Any]]:
    """Cold and warm TTFT per length, ``repeats`` times, interleaved; medians."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        bodies = {n: await sized(http, url, n, seed=n) for n in LENGTHS}
        runs: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {n: [] for n in LENGTHS}
        for rep in range(-1, repeats):  # round -1 warms the server up
            for n in LENGTHS:
                prompt = f"{os.urandom(6).hex()} {bodies[n]}"  # a fresh first block
                cold = await ttft(http, url, prompt)
                warm = await ttft(http, url, prompt)
                if rep >= 0:
                    runs[n].append((cold, warm))
            print(f"{label}: round {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    points = []
    for n in LENGTHS:
        colds = [c for c, _ in runs[n]]
        warms = [w for _, w in runs[n]]
        size = int(statistics.median(c["prompt_tokens"] for c in colds))
        cached = int(statistics.median(w["cached"] for w in warms))
        point: dict[str, Any] = {
            "target_tokens": n,
            "prompt_tokens": size,
            "warm_cached_tokens": cached,
            "warm_cached_is_rule": all(
                w["cached"] == expected_cached(w["prompt_tokens"], BLOCK_SIZE) for w in warms
            ),
            "cold_cached_tokens_max": max(c["cached"] for c in colds),
            "cold_ms": [round(c["ttft_ms"], 2) for c in colds],
            "warm_ms": [round(w["ttft_ms"], 2) for w in warms],
        }
        point["cold_median_ms"] = round(statistics.median(point["cold_ms"]), 2)
        point["warm_median_ms"] = round(statistics.median(point["warm_ms"]), 2)
        point["cold_warm_ratio"] = round(point["cold_median_ms"] / point["warm_median_ms"], 2)
        if colds[0]["sim_ttft_ms"] is not None:
            sim_cold = statistics.median(c["sim_ttft_ms"] for c in colds)
            sim_warm = statistics.median(w["sim_ttft_ms"] for w in warms)
            point["sim_ttft_cold_ms"] = round(sim_cold, 2)
            point["sim_ttft_warm_ms"] = round(sim_warm, 2)
            point["sim_ttft_ratio"] = round(sim_cold / sim_warm, 2)
        points.append(point)
    return points


async def _inter_token_ms(http: aiohttp.ClientSession, url: str, seed: int) -> float:
    """One streamed request decoding DECODE_TOKENS: the median time between its tokens."""
    body = {
        "prompt": f"{seed} " + _words(seed, 50),
        "max_tokens": DECODE_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    stamps = []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(gaps) * 1000


async def decode_steps(url: str) -> dict[str, float]:
    """Milliseconds between tokens with 1, 4, 16 and 32 requests decoding at once."""
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await _inter_token_ms(http, url, 0)  # warm-up
        for batch in DECODE_BATCHES:
            gaps = await asyncio.gather(
                *(_inter_token_ms(http, url, 1000 * batch + i) for i in range(batch))
            )
            out[str(batch)] = round(statistics.median(gaps), 3)
    return out


def fitted(points: list[dict[str, Any]], step_ms: float | None = None) -> dict[str, Any]:
    data = []
    for p in points:
        data.append(Point(p["prompt_tokens"], 0, p["cold_median_ms"]))
        cached = p["warm_cached_tokens"]
        data.append(Point(p["prompt_tokens"] - cached, cached, p["warm_median_ms"]))
    f = fit(data, t_step_ms=step_ms)  # measured, where the prefills cannot tell it
    out: dict[str, Any] = {k: float(f"{v:.6g}") for k, v in asdict(f).items()}
    out["method"] = "least squares on relative error, cold and warm medians (bench/ttft_fit.py)"
    if step_ms is not None:
        out["t_step_from"] = "one request's decode step on the same pod (real.decode_ms['1'])"
    out["predicted"] = [
        {
            "prompt_tokens": p["prompt_tokens"],
            "cold_ms": round(f.predict(p["prompt_tokens"]), 2),
            "warm_ms": round(
                f.predict(p["prompt_tokens"] - p["warm_cached_tokens"], p["warm_cached_tokens"]), 2
            ),
        }
        for p in points
    ]
    for row in out["predicted"]:
        row["ratio"] = round(row["cold_ms"] / row["warm_ms"], 2)
    return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def measure_real(workdir: Path, url: str | None, repeats: int) -> dict[str, Any]:
    load = _load()
    if url is not None:
        points = await measure(url, repeats, "real")
        decode = await decode_steps(url)
        argv: list[str] | str = url
        blocks = await kv_blocks(url)
    else:
        async with real_pod(workdir) as pods:
            points = await measure(pods.urls[0], repeats, "real")
            decode = await decode_steps(pods.urls[0])
            argv = pods.options.argv("127.0.0.1", pods.ports[0])[1:]
            blocks = await kv_blocks(pods.urls[0])
    return {
        "argv": argv,
        "num_gpu_blocks": blocks,
        "decode_ms": decode,
        "load_avg_before": load,
        "load_avg_after": _load(),
        "points": points,
    }


async def measure_sim(workdir: Path, repeats: int, blocks: int) -> dict[str, Any]:
    options = VllmOptions.find()
    port = free_port()
    argv = sim_argv(port, options, blocks, time_scale=1.0)
    load = _load()
    async with sim_pod(argv, f"http://127.0.0.1:{port}", workdir / "sim.log") as url:
        points = await measure(url, repeats, "sim")
    model = get_model(TTFT_MODEL)
    return {
        "argv": argv[1:],
        "ttft_model": asdict(model),
        "load_avg_before": load,
        "load_avg_after": _load(),
        "points": points,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if args.sim_only:
        result = json.loads(args.out.read_text())
    else:
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "command": record.command("bench.calibrate_vllm", args.argv),
            "machine": {"cpus": os.cpu_count()},
            "repeats": args.repeats,
            "ttft": "request sent to the first SSE data event carrying a token (max_tokens 1)",
        }
        result["real"] = await measure_real(args.workdir, args.real, args.repeats)
        result["fit"] = fitted(result["real"]["points"], result["real"]["decode_ms"]["1"])
    result["sim"] = await measure_sim(args.workdir, args.repeats, result["real"]["num_gpu_blocks"])
    result["sim"]["date"] = time.strftime("%Y-%m-%d")
    result["sim"]["command"] = record.command("bench.calibrate_vllm", args.argv)
    fit_now = {k: result["fit"][k] for k in ("t0_ms", "a_ms", "b_ms", "t_step_ms", "token_ms")}
    used = {k: result["sim"]["ttft_model"][k] for k in fit_now}
    # latency.py holds them to three significant figures.
    result["sim"]["uses_fitted_coefficients"] = all(
        abs(used[k] - v) <= 5e-3 * abs(v) + 1e-12 for k, v in fit_now.items()
    )
    result["ratios"] = [
        {
            "target_tokens": r["target_tokens"],
            "real": r["cold_warm_ratio"],
            "sim_client": s["cold_warm_ratio"],
            "sim_engine": s.get("sim_ttft_ratio"),
            "model": f["ratio"],
        }
        for r, s, f in zip(
            result["real"]["points"],
            result["sim"]["points"],
            result["fit"]["predicted"],
            strict=True,
        )
    ]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=OUT, help="JSON result (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9, help="runs per length (default: 9)")
    ap.add_argument("--real", metavar="URL", help="measure this running vLLM pod instead")
    ap.add_argument("--sim-only", action="store_true", help="re-measure only the sim into --out")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ace-calibrate-vllm"))
    args = ap.parse_args(argv)
    args.argv = argv
    try:
        result = asyncio.run(run(args))
    except EnginesMissing as exc:
        print(f"calibrate_vllm: {exc}", file=sys.stderr)
        return 2
    record.write(args.out, result)
    f = result["fit"]
    print(
        f"fit: t0={f['t0_ms']:.4g} ms  a={f['a_ms']:.4g} ms/token  b={f['b_ms']:.4g} ms/token^2"
        f"  t_step={f['t_step_ms']:.4g} ms  (relative RMS error {f['rel_rmse']:.1%})"
    )
    print("tokens   real cold/warm   sim cold/warm (client, engine)   model")
    for r in result["ratios"]:
        print(
            f"{r['target_tokens']:>6}   {r['real']:>14}   {r['sim_client']:>13}, "
            f"{r['sim_engine']}   {r['model']:>14}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
