"""``lora-mix``: many LoRA adapters on one base model, where adapter swapping matters.

- **64 adapters** (``adapter-00`` ... ``adapter-63``), each a team's fine-tune named as
  the request's ``model``; their popularity is Zipf (the k-th most used is asked
  ``1/k`` as often as the first): a few hot adapters, a long tail.
- **Sessions**: each picks an adapter by popularity and opens with that adapter's own
  system prompt (800-2,400 tokens, shared by all its sessions), then 1-6 turns
  (mean ~2.5) of 50-800-token questions and 32-384-token replies; the conversation
  grows turn by turn, so a later turn reuses the earlier ones as a prefix.
- **The engines**: ``--enable-lora --max-loras 4`` (``Workload.max_loras``): an 8-pod
  fleet holds 32 adapters at once, half of them. A request for an adapter its pod has
  not loaded waits the load; one for a fifth adapter on a pod whose 4 slots all have
  requests running waits for one of them to finish (vLLM's scheduler).
- **Load**: Poisson at 30 requests/s by default: some 50 requests in flight over the
  fleet, six a pod, so a pod that takes any adapter soon runs more adapters than its
  slots, and where each adapter goes decides who waits.

Prefixes are per adapter (vLLM's block hashes include the adapter, and the router's
prefix keys are seeded by ``model``): two adapters' sessions share nothing, not even a
system prompt of the same text.
"""

from __future__ import annotations

import random
from typing import Any

from .base import Workload
from .sessions import Session, Turn, chat_body, logu, reply, schedule
from .text import tagged, tokens_text

NAME = "lora-mix"
ADAPTERS = 64
MAX_LORAS = 4  # the engines' --max-loras
REQUESTS = 3_000
DEFAULT_RATE = 30.0  # requests/s
SYSTEM_TOKENS = (800, 2_400)
ZIPF_S = 1.0


def adapter_name(k: int) -> str:
    return f"adapter-{k:02d}"


def build(seed: int = 0, rate: float | None = None, requests: int = REQUESTS) -> Workload:
    rng = random.Random(f"{NAME}:{seed}")
    rate = DEFAULT_RATE if rate is None else rate
    names = [adapter_name(k) for k in range(ADAPTERS)]
    systems = [
        tagged(
            f"You are {name}, a fine-tuned assistant of team {k}. ",
            rng,
            4 * rng.randint(*SYSTEM_TOKENS),
        )
        for k, name in enumerate(names)
    ]
    # Which adapter is hot is drawn too: popularity is no function of the name.
    by_rank = list(range(ADAPTERS))
    rng.shuffle(by_rank)
    weights = [0.0] * ADAPTERS
    for rank, k in enumerate(by_rank):
        weights[k] = 1.0 / (rank + 1) ** ZIPF_S
    sessions: list[Session] = []
    total = 0
    while total < requests:
        k = rng.choices(range(ADAPTERS), weights)[0]
        turns = min(6, 1 + int(rng.expovariate(1 / 1.5)), requests - total)
        session = Session(f"lora-{len(sessions):04d}", names[k])
        messages: list[dict[str, Any]] = [{"role": "system", "content": systems[k]}]
        for turn in range(turns):
            messages.append({"role": "user", "content": tokens_text(rng, logu(rng, 50, 800))})
            max_tokens = logu(rng, 32, 384)
            session.turns.append(
                Turn(
                    chat_body(messages, max_tokens, model=names[k]),
                    max_tokens,
                    think_s=rng.uniform(2.0, 20.0) if turn else 0.0,
                )
            )
            messages.append(reply(max_tokens))
        sessions.append(session)
        total += turns
    out = schedule(sessions, rate, random.Random(f"{NAME}:arrivals:{seed}"))
    return Workload(
        name=NAME,
        description=(
            f"{len(out)} chat requests for {ADAPTERS} LoRA adapters of one base model "
            f"(Zipf popularity, a system prompt each, sessions of 1-6 turns), Poisson at "
            f"{rate:g} req/s, engines with --max-loras {MAX_LORAS}"
        ),
        requests=out,
        max_loras=MAX_LORAS,
    )
