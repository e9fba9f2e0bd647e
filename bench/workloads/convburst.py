"""``conv-burst``: the shape of a production conversation trace our router once placed
badly (issue 27), generated here, not copied, so that routing is tested on it without
fitting that trace (which is held back).

- Conversations of 1 to 8 turns (mean ~3); each turn's prompt is the conversation's
  previous prompt, the reply, and a new turn of 200-3,000 tokens, so a later turn
  reuses the earlier ones as a prefix.
- **Every prompt begins with the same 512-token block**, a fleet-wide system prompt:
  every request "hits" on it wherever it goes.
- **Heavy-tailed lengths**: a conversation's first prompt is log-normal, median 6K
  tokens, a few past 60K, capped at 120K; ~13K tokens a request on average.
- **Bursts**: conversations start as a Poisson process, each later turn 5-60 s after
  the one before (the reply read, the next question typed); the arrivals are scaled to
  ``rate`` on average and every timestamp is cut to a whole second, so up to a dozen
  or more requests arrive at the same instant.
- At the default 3.4 requests/s an 8-pod fleet of the default model spends 18% (at
  best-case reuse) to 43% (every prompt cold) of its time prefilling, in bursts that
  fill it: each second's arrivals land at once.

Written in the Mooncake format (512-token block ids, ``/v1/completions``, one
request a session, as the trace had no session ids) and replayed through the same
path as a Mooncake trace (:func:`.mooncake.requests_of`).
"""

from __future__ import annotations

import math
import random

from .base import Workload
from .mooncake import TraceRecord, requests_of
from .text import MOONCAKE_BLOCK_TOKENS

NAME = "conv-burst"
REQUESTS = 3_000
DEFAULT_RATE = 3.4  # requests/s, all turns together
MEDIAN_FIRST_TOKENS = 6_000
SIGMA = 1.2  # of the first prompt's log-length: a heavy tail
MAX_TOKENS = 120_000
SHARED_BLOCK = 0  # the fleet-wide system prompt's block id


def build(seed: int = 0, rate: float | None = None, requests: int = REQUESTS) -> Workload:
    rng = random.Random(f"{NAME}:{seed}")
    rate = DEFAULT_RATE if rate is None else rate
    turns_per_conversation = 3.0  # the mean of the draw below
    next_block = SHARED_BLOCK + 1
    records: list[TraceRecord] = []
    start = 0.0
    while len(records) < requests:
        start += rng.expovariate(rate / turns_per_conversation)
        turns = min(8, 1 + int(rng.expovariate(1 / (turns_per_conversation - 1))))
        first = int(rng.lognormvariate(math.log(MEDIAN_FIRST_TOKENS), SIGMA))
        length = min(MAX_TOKENS, max(MOONCAKE_BLOCK_TOKENS + 1, first))
        blocks = [SHARED_BLOCK]
        at = start
        for _ in range(turns):
            need = math.ceil(length / MOONCAKE_BLOCK_TOKENS)
            # The last block of a turn is partly filled: the next turn's text starts a
            # new block (its reply and question differ from what a block id stood for).
            while len(blocks) < need:
                blocks.append(next_block)
                next_block += 1
            output = int(math.exp(rng.uniform(math.log(50), math.log(800))))
            records.append(TraceRecord(at, length, output, list(blocks), 0))
            at += rng.uniform(5, 60)
            length += output + rng.randint(200, 3_000)
            if length > MAX_TOKENS:
                break
            blocks.append(next_block)  # the reply and the new turn: new blocks
            next_block += 1
    records.sort(key=lambda r: r.timestamp_ms)
    records = records[:requests]
    # The arrivals stretched or squeezed to ``rate`` on average, then cut to whole
    # seconds (the bursts), in the format's milliseconds.
    span = records[-1].timestamp_ms - records[0].timestamp_ms
    scale = (len(records) - 1) / rate / span if span else 1.0
    records = [
        TraceRecord(
            math.floor(r.timestamp_ms * scale) * 1000.0,
            r.input_length,
            r.output_length,
            r.hash_ids,
            i + 1,
        )
        for i, r in enumerate(records)
    ]
    return Workload(
        name=NAME,
        description=(
            f"{len(records)} requests of multi-turn conversations, Mooncake-shaped: one "
            f"shared first block, heavy-tailed lengths, whole-second arrivals at {rate:g} "
            "req/s (bursts)"
        ),
        requests=requests_of(records, family=NAME),
    )
