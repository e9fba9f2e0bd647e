"""The most any router could serve from cache on a workload.

Every prompt counts as cached as far as some earlier prompt of the workload shares its
leading engine blocks: one cache that holds everything and never evicts, in the
simulated engine's own blocks (16 tokens, the same keys as its prefix cache), the last
token recomputed as vLLM does. No router can do better on the same requests in the same
order, so when routers reach this figure they tie at it, and differ only in latency.

The TTFT floor goes with it: each request's time to first token alone on an idle pod
(the calibrated TTFT model) with that much of it cached. No router beats its p99 on
these requests; where a router's p99 is near it, the tail is the cold prefill of the
longest new prompts, which routing cannot shorten.

    python -m bench.ceiling [--workload all] [--limit 800] [--seed 0] [--ttft-model M]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from ace_extproc.latency import DEFAULT_MODEL, TTFTModel, get_model
from ace_extproc.sim.kvcache import prompt_keys
from ace_extproc.sim.protocol import parse_messages, parse_prompts
from ace_extproc.sim.tokenizer import render_chat
from bench import workloads
from bench.fleetsim.metrics import percentile
from bench.workloads.base import Request

BLOCK_TOKENS = 16  # the simulated engine's (and vLLM's) default block size


@dataclass(frozen=True, slots=True)
class Ceiling:
    prompt_tokens: int
    cached_tokens: int  # at most, by any router
    floor_ms: tuple[float, ...] = ()  # each prompt's TTFT alone, cached that far

    @property
    def share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prompts_of(request: Request) -> list[bytes | list[int]]:
    """The prompts the engine sees: the rendered chat, or the completions prompts."""
    body = msgspec.json.decode(request.body)
    if request.path.endswith("/chat/completions"):
        messages, tools = parse_messages(body)
        return [render_chat(messages, tools).encode()]
    return [p.encode() if isinstance(p, str) else p for p in parse_prompts(body)]


def ceiling(
    requests: Iterable[Request],
    block_tokens: int = BLOCK_TOKENS,
    model: TTFTModel | None = None,
) -> Ceiling:
    model = model or get_model(DEFAULT_MODEL)
    seen: set[int] = set()
    floor: list[float] = []
    prompt_total = cached_total = 0
    for request in requests:
        for prompt in prompts_of(request):
            tokens, keys = prompt_keys(prompt, block_tokens)
            usable = (tokens - 1) // block_tokens  # the last token is always recomputed
            hit = 0
            while hit < usable and keys[hit] in seen:
                hit += 1
            seen.update(keys)
            prompt_total += tokens
            cached_total += hit * block_tokens
            floor.append(model.ttft_ms(tokens - hit * block_tokens, hit * block_tokens))
    return Ceiling(prompt_total, cached_total, tuple(floor))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(workloads.NAMES)}")
    ap.add_argument("--limit", type=int, help="only the first N requests (as bench.live)")
    ap.add_argument("--seed", type=int, default=0, help="the workload generator's seed")
    ap.add_argument("--ttft-model", default=DEFAULT_MODEL, help="the floor's TTFT model")
    args = ap.parse_args(argv)
    model = get_model(args.ttft_model)
    names = workloads.NAMES if args.workload == "all" else [args.workload]
    print(
        f"{'workload':<12}{'requests':>9}{'prompt tokens':>15}{'ceiling':>9}"
        f"{'floor p50 ms':>14}{'floor p99 ms':>14}"
    )
    for name in names:
        requests = workloads.get(name, seed=args.seed, limit=args.limit).requests[: args.limit]
        c = ceiling(requests, model=model)
        p50, p99 = percentile(c.floor_ms, 50), percentile(c.floor_ms, 99)
        print(
            f"{name:<12}{len(requests):>9}{c.prompt_tokens:>15,}{c.share:>9.1%}"
            f"{p50:>14,.1f}{p99:>14,.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
