"""Stress shapes: traffic that breaks a router that only follows prefixes, or only
balances load.

- ``hot-prefix``: 3,000 single-turn chats, Poisson at 120 req/s. Exactly 90% carry
  one hot 3,000-token system prompt (plus a unique 50-500-token question); the other
  10% have a unique 1,000-3,000-token system prompt. Replies of 32-256 tokens. Pure
  prefix affinity sends 108 req/s to one pod: ~1.4 s of prefill work a second even
  with the prompt cached, and ~230 concurrent decodes against its 256 sequence slots,
  while at best-case reuse the whole fleet of 8 would be a third busy.
- ``churn``: the suite's shape at 300 requests a family (1,200 requests, Poisson at
  the suite's rate) on a fleet of 8 slots where slot 7 is absent at the start, slot 2
  leaves at a third of the run and slot 7 joins at two thirds: the sessions on the
  leaving pod lose their cache, and the new pod must take a fair share of new prefixes.
- ``burst32k``: 5 bursts, 60 s apart, of 24 sessions that all arrive within one second,
  each with its own 29,000-30,500-token document and a question (~30K-token prompts,
  720K tokens of cold prefill a burst), each followed up 3 times on the same document
  (multi-turn: the history grows, the last prompt stays under 32K), the first
  follow-up 15 s + Exp(mean 10 s) after the reply would be done: 480 requests, all in
  the 32K bucket.
"""

from __future__ import annotations

import random
from typing import Any

from .base import FleetEvent, Request, Workload
from .sessions import Session, Turn, chat_body, logu, reply, timed
from .suite import DEFAULT_RATE as SUITE_RATE
from .suite import build as build_suite
from .text import tagged, tokens_text

HOT_REQUESTS = 3_000
HOT_RATE = 120.0
HOT_SHARE = 0.9
HOT_SYSTEM_TOKENS = 3_000

CHURN_PER_FAMILY = 300
CHURN_PODS = 8
CHURN_LEAVES = 2
CHURN_JOINS = 7

BURSTS = 5
BURST_SESSIONS = 24
BURST_FOLLOW_UPS = 3
BURST_INTERVAL_S = 60.0
BURST_DOC_TOKENS = (29_000, 30_500)


def hot_prefix(seed: int = 0, rate: float | None = None) -> Workload:
    rng = random.Random(f"hot-prefix:{seed}")
    rate = HOT_RATE if rate is None else rate
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    hot_system = tagged("You are ACME's support assistant. ", rng, HOT_SYSTEM_TOKENS * 4)
    n_hot = round(HOT_REQUESTS * HOT_SHARE)
    hot = [True] * n_hot + [False] * (HOT_REQUESTS - n_hot)
    rng.shuffle(hot)
    requests = []
    t = 0.0
    for i, is_hot in enumerate(hot):
        t += rng.expovariate(rate)
        system = (
            hot_system
            if is_hot
            else tagged(
                f"Ticket {i}: you are a one-off assistant. ", rng, 4 * rng.randint(1_000, 3_000)
            )
        )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": tokens_text(rng, logu(rng, 50, 500))},
        ]
        max_tokens = logu(rng, 32, 256)
        requests.append(
            Request(
                arrival_s=round(t, 6),
                path="/v1/chat/completions",
                body=chat_body(messages, max_tokens),
                output_tokens=max_tokens,
                family="hot" if is_hot else "unique",
                session=f"{'hot' if is_hot else 'unique'}-{i}",
            )
        )
    return Workload(
        name="hot-prefix",
        description=(
            f"{HOT_REQUESTS} chats at {rate:g} req/s, {HOT_SHARE:.0%} sharing one "
            f"{HOT_SYSTEM_TOKENS}-token system prompt, the rest unique"
        ),
        requests=requests,
    )


def churn(seed: int = 0, rate: float | None = None) -> Workload:
    base = build_suite(seed, rate, per_family=CHURN_PER_FAMILY)
    end = base.requests[-1].arrival_s
    return Workload(
        name="churn",
        description=(
            f"the suite's families ({len(base.requests)} requests at "
            f"{SUITE_RATE if rate is None else rate:g} req/s) on {CHURN_PODS} slots: slot "
            f"{CHURN_LEAVES} leaves at {end / 3:.0f} s, slot {CHURN_JOINS} joins at "
            f"{2 * end / 3:.0f} s"
        ),
        requests=base.requests,
        events=[
            FleetEvent(round(end / 3, 3), "remove", CHURN_LEAVES),
            FleetEvent(round(2 * end / 3, 3), "add", CHURN_JOINS),
        ],
        initially_absent=(CHURN_JOINS,),
    )


def burst32k(seed: int = 0, rate: float | None = None) -> Workload:
    """``rate`` (requests/s) sets the bursts' spacing; by default 60 s (1.6 req/s)."""
    rng = random.Random(f"burst32k:{seed}")
    per_burst = BURST_SESSIONS * (1 + BURST_FOLLOW_UPS)
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    interval = BURST_INTERVAL_S if rate is None else per_burst / rate
    system = tagged("You answer questions about long documents. ", rng, 200 * 4)
    requests: list[Request] = []
    for burst in range(BURSTS):
        for k in range(BURST_SESSIONS):
            session = Session(f"burst{burst}-{k:02d}", "burst32k")
            document = tagged(f"Document {burst}.{k}.\n", rng, 4 * rng.randint(*BURST_DOC_TOKENS))
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            for turn in range(1 + BURST_FOLLOW_UPS):
                question = tokens_text(rng, logu(rng, 20, 80))
                user = f"{document}\n\nQuestion: {question}" if turn == 0 else question
                messages.append({"role": "user", "content": user})
                max_tokens = logu(rng, 64, 256)
                think = 15.0 + rng.expovariate(1 / 10.0) if turn else 0.0
                session.turns.append(Turn(chat_body(messages, max_tokens), max_tokens, think))
                messages.append(reply(max_tokens))
            requests += timed(session, burst * interval + rng.random())
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(
        name="burst32k",
        description=(
            f"{BURSTS} bursts {interval:g} s apart of {BURST_SESSIONS} sessions with ~30K-token "
            f"documents, each followed up {BURST_FOLLOW_UPS} times ({len(requests)} requests)"
        ),
        requests=requests,
    )
