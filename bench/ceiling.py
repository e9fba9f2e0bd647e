"""The most any router could serve from cache on a workload.

Every prompt counts as cached as far as some earlier prompt of the workload shares its
leading engine blocks: one cache that holds everything and never evicts, in the
simulated engine's own blocks (16 tokens, the same keys as its prefix cache), the last
token recomputed as vLLM does. No router can do better on the same requests in the same
order, so when routers reach this figure they tie at it, and differ only in latency.

    python -m bench.ceiling [--workload all] [--limit 800] [--seed 0]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from ace_extproc.sim.kvcache import prompt_keys
from ace_extproc.sim.protocol import parse_messages, parse_prompts
from ace_extproc.sim.tokenizer import render_chat
from bench import workloads
from bench.workloads.base import Request

BLOCK_TOKENS = 16  # the simulated engine's (and vLLM's) default block size


@dataclass(frozen=True, slots=True)
class Ceiling:
    prompt_tokens: int
    cached_tokens: int  # at most, by any router

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


def ceiling(requests: Iterable[Request], block_tokens: int = BLOCK_TOKENS) -> Ceiling:
    seen: set[int] = set()
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
    return Ceiling(prompt_total, cached_total)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(workloads.NAMES)}")
    ap.add_argument("--limit", type=int, help="only the first N requests (as bench.live)")
    ap.add_argument("--seed", type=int, default=0, help="the workload generator's seed")
    args = ap.parse_args(argv)
    names = workloads.NAMES if args.workload == "all" else [args.workload]
    print(f"{'workload':<12}{'requests':>9}{'prompt tokens':>15}{'ceiling':>9}")
    for name in names:
        requests = workloads.get(name, seed=args.seed, limit=args.limit).requests[: args.limit]
        c = ceiling(requests)
        print(f"{name:<12}{len(requests):>9}{c.prompt_tokens:>15,}{c.share:>9.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
