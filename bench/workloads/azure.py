"""Replay of the Azure LLM inference traces (2023: ``code`` and ``conv``), with a
synthetic prefix structure on top.

The CSV gives ``TIMESTAMP, ContextTokens, GeneratedTokens`` and nothing about
prompt content, so arrival times and lengths come from the trace and the sharing is
a documented, seeded assumption:

- ``azure-code`` (``/v1/completions``, like an IDE completion service): 200
  repositories with Zipf(1) popularity, 4 files each. A prompt is the repository's
  context (300-2,000 tokens of neighbouring-file snippets, shared by every request
  on that repository), then the file's text up to the cursor (shared with other
  requests on the same file as far as both reach), then 8-64 tokens of fresh lines
  around the cursor. Its length is exactly ``ContextTokens``.
- ``azure-conv`` (``/v1/chat/completions``): conversations. A request continues an
  open conversation with probability 0.5 when one can hold it (its history, with
  the previous reply, fits in ``ContextTokens``; the reply would be done by now;
  idle under 10 minutes), picked at random among those; otherwise it starts one
  with one of the 10 shared system prompts (60-1,600 tokens, Zipf(1) popularity)
  that fit, or none if none fits. The new user turn fills the prompt to exactly
  ``ContextTokens`` rendered tokens (prompts below the template's ~33-token floor
  come out at the floor). The reply appended to the history is the simulated
  engine's own text for ``GeneratedTokens``.

Arrivals are the timestamps less the first, divided by ``speed`` (or scaled to a mean
``rate``); conversations are assembled on the scaled clock, so a turn never comes
before its predecessor's reply would be done. By default only the first
``DEFAULT_LIMIT`` rows are replayed.
"""

from __future__ import annotations

import csv
import os
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from ace_extproc.request import CHAT_PATH, COMPLETIONS_PATH
from ace_extproc.sim.tokenizer import render_chat

from .base import Request, TraceError, Workload, replay_speed
from .sessions import MODEL, chat_body, logu, reply, service_s
from .text import BYTES_PER_TOKEN, Stream, tagged, words

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
DEFAULT_LIMIT = 3_000  # ~18 min of code traffic, ~10.5 min of conversations

CODE_REPOS = 200
CODE_FILES = 4
CODE_REPO_CONTEXT = (300, 2_000)  # tokens
CODE_TAIL = (8, 64)  # tokens of fresh text at the cursor

CONV_SYSTEM_TOKENS = (60, 120, 200, 300, 450, 600, 800, 1_000, 1_300, 1_600)
CONV_CONTINUE = 0.5
CONV_IDLE_S = 600.0
CONV_MIN_USER_BYTES = 16

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class AzureRecord:
    time_s: float  # seconds after the trace's first request
    context_tokens: int
    generated_tokens: int
    line: int  # 1-based; line 1 is the header


def read(path: str | os.PathLike[str], limit: int | None = None) -> list[AzureRecord]:
    """Read and validate an Azure trace CSV, the first ``limit`` rows if given.

    Raises :class:`TraceError` naming the file and 1-based line of the first problem.
    """
    records: list[AzureRecord] = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: the trace is empty")
        if tuple(h.strip() for h in header) != HEADER:
            raise TraceError(f"{path}:1: expected the header {','.join(HEADER)}, got {header}")
        first: datetime | None = None
        previous = 0.0
        for row in reader:
            if limit is not None and len(records) >= limit:
                break
            where = f"{path}:{reader.line_num}"
            if not row or not "".join(row).strip():
                continue
            if len(row) != len(HEADER):
                raise TraceError(f"{where}: expected {len(HEADER)} fields, got {len(row)}")
            stamp = _timestamp(row[0], where)
            if first is None:
                first = stamp
            t = (stamp - first).total_seconds()
            if t < previous or t < 0:
                raise TraceError(
                    f"{where}: TIMESTAMP {row[0].strip()} is before the previous row's "
                    "(timestamps must not decrease)"
                )
            previous = t
            ctx, gen = (_positive(row[i], HEADER[i], where) for i in (1, 2))
            records.append(AzureRecord(t, ctx, gen, reader.line_num))
    if not records and limit != 0:
        raise TraceError(f"{path}:2: the trace has a header but no requests")
    return records


def _timestamp(text: str, where: str) -> datetime:
    # "2023-11-16 18:17:03.9799600": seven fractional digits, more than
    # datetime.fromisoformat takes before Python 3.11's looser parser; cut to six.
    value = text.strip()
    head, dot, frac = value.partition(".")
    try:
        return datetime.fromisoformat(head + (dot + frac[:6] if dot else ""))
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP {value!r} is not a date and time") from None


def _positive(text: str, name: str, where: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(f"{where}: {name} must be an integer, got {text.strip()!r}") from None
    if value < 1:
        raise TraceError(f"{where}: {name} must be positive, got {value}")
    return value


def _scaled(records: list[AzureRecord], speed: float | None, rate: float | None) -> list[float]:
    times = [r.time_s for r in records]
    factor = replay_speed(times, speed, rate)
    return [round(t / factor, 6) for t in times]


def _zipf_weights(n: int) -> list[float]:
    return [1 / (i + 1) for i in range(n)]


# -- code ----------------------------------------------------------------------------------


def code(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    limit: int | None = DEFAULT_LIMIT,
    speed: float | None = None,
    rate: float | None = None,
) -> Workload:
    records = read(path, limit)
    times = _scaled(records, speed, rate)
    rng = random.Random(f"azure-code:{seed}")
    contexts = [
        tagged(f"# repository {r}: related snippets\n", rng, 4 * logu(rng, *CODE_REPO_CONTEXT))
        for r in range(CODE_REPOS)
    ]
    files: dict[tuple[int, int], Stream] = {}
    weights = _zipf_weights(CODE_REPOS)
    requests = []
    for rec, t in zip(records, times, strict=True):
        repo = rng.choices(range(CODE_REPOS), weights=weights)[0]
        f = rng.randrange(CODE_FILES)
        stream = files.get((repo, f))
        if stream is None:
            stream = files[repo, f] = Stream(rng)
        size = rec.context_tokens * BYTES_PER_TOKEN
        tail = min(size, BYTES_PER_TOKEN * rng.randint(*CODE_TAIL))
        head = contexts[repo] + f"# file {repo}/{f}\n"
        head = head[: size - tail]
        prompt = head + stream.take(size - tail - len(head)) + words(rng, tail)
        requests.append(
            Request(
                arrival_s=t,
                path=COMPLETIONS_PATH,
                body=_encode(
                    {"model": MODEL, "prompt": prompt, "max_tokens": rec.generated_tokens}
                ),
                output_tokens=rec.generated_tokens,
                family="azure-code",
                # Completions are independent: no request waits for another's answer.
                session=f"code-{rec.line}",
            )
        )
    return Workload(
        name="azure-code",
        description=(
            f"Azure code trace {Path(path).name}: {len(requests)} requests; prompts share "
            f"repository context and file prefixes ({CODE_REPOS} repos, Zipf)"
        ),
        requests=requests,
    )


# -- conv ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Conversation:
    id: str
    messages: list[dict[str, Any]]
    ready_s: float  # when the last reply would be done
    last_s: float
    # Rendered bytes of the history plus an empty user turn and the generation prompt.
    base_bytes: int
    turns: int = field(default=1)


def _base_bytes(messages: list[dict[str, Any]]) -> int:
    return len(render_chat([*messages, {"role": "user", "content": ""}]).encode())


def conv(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    limit: int | None = DEFAULT_LIMIT,
    speed: float | None = None,
    rate: float | None = None,
) -> Workload:
    records = read(path, limit)
    times = _scaled(records, speed, rate)
    rng = random.Random(f"azure-conv:{seed}")
    systems = [
        tagged(f"System prompt {i}: you are a helpful assistant. ", rng, 4 * tokens)
        for i, tokens in enumerate(CONV_SYSTEM_TOKENS)
    ]
    system_bytes = [_base_bytes([{"role": "system", "content": s}]) for s in systems]
    bare_bytes = _base_bytes([])
    weights = _zipf_weights(len(systems))
    open_: list[_Conversation] = []
    requests = []
    for rec, t in zip(records, times, strict=True):
        size = rec.context_tokens * BYTES_PER_TOKEN
        open_ = [c for c in open_ if t - c.last_s <= CONV_IDLE_S]
        fits = [c for c in open_ if c.ready_s <= t and c.base_bytes + CONV_MIN_USER_BYTES <= size]
        if fits and rng.random() < CONV_CONTINUE:
            c = rng.choice(fits)
            c.turns += 1
        else:
            allowed = [i for i, b in enumerate(system_bytes) if b + CONV_MIN_USER_BYTES <= size]
            if allowed:
                i = rng.choices(allowed, weights=[weights[i] for i in allowed])[0]
                messages = [{"role": "system", "content": systems[i]}]
                base = system_bytes[i]
            else:
                messages, base = [], bare_bytes
            c = _Conversation(f"conv-{rec.line}", messages, t, t, base)
            open_.append(c)
        user = words(rng, max(size - c.base_bytes, CONV_MIN_USER_BYTES))
        c.messages.append({"role": "user", "content": user})
        requests.append(
            Request(
                arrival_s=t,
                path=CHAT_PATH,
                body=chat_body(c.messages, rec.generated_tokens),
                output_tokens=rec.generated_tokens,
                family="azure-conv",
                session=c.id,
                headers={"x-session-id": c.id},
            )
        )
        c.messages.append(reply(rec.generated_tokens))
        c.last_s = t
        c.ready_s = t + service_s(rec.generated_tokens)
        c.base_bytes = _base_bytes(c.messages)
    sessions = len({r.session for r in requests})
    return Workload(
        name="azure-conv",
        description=(
            f"Azure conversation trace {Path(path).name}: {len(requests)} requests in "
            f"{sessions} conversations over {len(systems)} shared system prompts"
        ),
        requests=requests,
    )
