"""Sessions and their arrivals, shared by the suite and the stress shapes.

A session is an ordered list of turns (a chat, a run of an agent, questions on one
document). Session starts form a Poisson process; each later turn of a session is
sent once the previous reply would be done (an allowance for queueing and prefill,
plus ``max_tokens`` at the simulated engine's default 20 ms a token) and the
client has thought for a while. Replay is open-loop: if the fleet is slower than
that, a turn can arrive before its predecessor's reply, as with any trace replay.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ace_extproc.request import CHAT_PATH
from ace_extproc.sim.protocol import filler_text
from ace_extproc.sim.tokenizer import render_chat

from .base import Request
from .text import BYTES_PER_TOKEN

MODEL = "sim-llama"
TPOT_S = 0.020  # the simulated engine's default decode time per token
REPLY_ALLOWANCE_S = 1.0  # queueing + prefill before the first token, roughly

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Turn:
    body: bytes
    output_tokens: int
    think_s: float = 0.0  # client time between the previous reply and this turn
    path: str = CHAT_PATH


@dataclass(slots=True)
class Session:
    id: str
    family: str
    turns: list[Turn] = field(default_factory=list)
    # Send ``x-session-id`` (a client that has a conversation id); one-shot requests don't.
    sticky: bool = True


def chat_body(
    messages: list[dict[str, Any]],
    max_tokens: int,
    tools: list[dict[str, Any]] | None = None,
    model: str = MODEL,
) -> bytes:
    """An OpenAI chat body, encoded now (the caller keeps growing ``messages``);
    ``model``: the base model, or a LoRA adapter's name."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    if tools:
        body["tools"] = tools
    return _encode(body)


def reply(max_tokens: int) -> dict[str, str]:
    """The assistant turn a client appends after a reply of ``max_tokens`` tokens.

    Its text is exactly what the simulated engine generates (``filler_text``), so a
    live run's transcript and the workload's agree; any text would do for prefix
    reuse, since the next prompt re-renders the reply after the previous prompt.
    """
    return {"role": "assistant", "content": filler_text(max_tokens)}


def rendered_tokens(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> int:
    """Prompt tokens of a conversation on the simulated engine."""
    return -(-len(render_chat(messages, tools).encode()) // BYTES_PER_TOKEN)


def split(
    rng: random.Random, total: int, lo: int, hi: int, draw: Callable[[], int] | None = None
) -> list[int]:
    """Cut ``total`` into sizes within ``[lo, hi]`` (needs ``hi >= 2 * lo - 1``)."""
    sizes: list[int] = []
    left = total
    while left > hi:
        want = draw() if draw else rng.randint(lo, hi)
        size = max(lo, min(want, hi, left - lo))
        sizes.append(size)
        left -= size
    if left:  # at least lo: every cut above left that much
        sizes.append(left)
    return sizes


def logu(rng: random.Random, lo: float, hi: float) -> int:
    """Log-uniform integer in ``[lo, hi]``: sizes spread over orders of magnitude."""
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def service_s(output_tokens: int) -> float:
    return REPLY_ALLOWANCE_S + output_tokens * TPOT_S


def schedule(
    sessions: Iterable[Session], rate: float, rng: random.Random, *, start_s: float = 0.0
) -> list[Request]:
    """Requests of interleaved sessions, the mean request rate about ``rate`` per second.

    Sessions start in a random order as a Poisson process at
    ``rate * sessions / requests``, so requests come at ``rate`` on average.
    """
    order = list(sessions)
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    total = sum(len(s.turns) for s in order)
    if not total:
        return []
    session_rate = rate * len(order) / total
    rng.shuffle(order)
    out: list[Request] = []
    t = start_s
    for s in order:
        t += rng.expovariate(session_rate)
        out.extend(timed(s, t))
    out.sort(key=lambda r: r.arrival_s)
    return out


def timed(session: Session, start_s: float) -> list[Request]:
    """A session's requests, the first at ``start_s``, each later one after the
    previous reply's estimated service time and its own think time."""
    headers = {"x-session-id": session.id} if session.sticky else {}
    out: list[Request] = []
    t = start_s
    for i, turn in enumerate(session.turns):
        if i:
            t += service_s(session.turns[i - 1].output_tokens) + turn.think_s
        out.append(
            Request(
                arrival_s=round(t, 6),
                path=turn.path,
                body=turn.body,
                output_tokens=turn.output_tokens,
                family=session.family,
                session=session.id,
                headers=dict(headers),
            )
        )
    return out
