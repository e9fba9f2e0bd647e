"""Replay of Mooncake-format traces (kvcache-ai/Mooncake, also what ``aiperf
--custom-dataset-type mooncake_trace`` reads).

The format: one JSON object a line, with ``timestamp`` (ms since the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (prefix block ids,
512 tokens a block, ``len(hash_ids) == ceil(input_length / 512)``); other fields are
ignored. Two requests share a prefix exactly as far as their ``hash_ids`` agree from
the start.

Each block id becomes a fixed 2048-byte ASCII text (:func:`.text.block_text`: 512
tokens of the simulated engine, the same text for the same id), a prompt is its
blocks' texts joined and cut to ``input_length * 4`` bytes, and each record is sent
as ``/v1/completions`` with ``{"model": "sim-llama", "prompt": text, "max_tokens":
output_length}``. Arrivals are the timestamps less the first one, divided by
``speed``. The trace has no sessions: each request is its own.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ace_extproc.request import COMPLETIONS_PATH

from .base import Request, TraceError, Workload, replay_speed
from .sessions import MODEL
from .text import MOONCAKE_BLOCK_TOKENS, blocks_prompt

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    line: int  # 1-based line of the file it came from


def read(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRecord]:
    """Read and validate a trace, the first ``limit`` records if given.

    Raises :class:`TraceError` naming the file and 1-based line of the first problem.
    """
    records: list[TraceRecord] = []
    previous: float | None = None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            record = _record(path, line_no, line)
            if previous is not None and record.timestamp_ms < previous:
                raise TraceError(
                    f"{path}:{line_no}: timestamp {record.timestamp_ms:g} is before the previous "
                    f"request's {previous:g} (timestamps must not decrease)"
                )
            previous = record.timestamp_ms
            records.append(record)
    if not records and limit != 0:
        raise TraceError(f"{path}:1: the trace is empty (no JSON lines)")
    return records


def _record(path: str | os.PathLike[str], line_no: int, line: str) -> TraceRecord:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in FIELDS:
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    ts = obj["timestamp"]
    if not _is_number(ts) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number (ms), got {ts!r}")
    lengths = []
    for name in ("input_length", "output_length"):
        value = obj[name]
        if not _is_int(value):
            raise TraceError(f"{where}: {name!r} must be an integer, got {value!r}")
        if value < 1:
            # An empty prompt cannot be sent, and max_tokens must be at least 1.
            raise TraceError(f"{where}: {name!r} must be positive, got {value}")
        lengths.append(value)
    input_length, output_length = lengths
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise TraceError(
            f"{where}: 'hash_ids' has {len(ids)} blocks but input_length {input_length} "
            f"needs ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {blocks}"
        )
    return TraceRecord(float(ts), input_length, output_length, ids, line_no)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def best_case_reuse(
    path_or_records: str | os.PathLike[str] | Iterable[TraceRecord | Mapping[str, Any]],
) -> float:
    """Share of prompt tokens one node with an unbounded cache would reuse.

    A block is reused when the same prefix (the same ``hash_ids`` up to and including
    it) appeared in an earlier request; it counts its tokens (the last block of a
    request may be partial). Computed from the ``hash_ids`` alone, with a trie whose
    nodes are prefixes, so each block costs one dict lookup.
    """
    if isinstance(path_or_records, str | os.PathLike):
        path_or_records = read(path_or_records)
    nodes: dict[tuple[int, int], int] = {}
    total = reused = 0
    for rec in path_or_records:
        if isinstance(rec, TraceRecord):
            length, ids = rec.input_length, rec.hash_ids
        else:
            length, ids = rec["input_length"], rec["hash_ids"]
        parent = -1
        for i, block in enumerate(ids):
            key = (parent, block)
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(nodes)
            else:
                reused += min(MOONCAKE_BLOCK_TOKENS, length - i * MOONCAKE_BLOCK_TOKENS)
            parent = node
        total += length
    return reused / total if total else 0.0


def arrival_scale(records: list[TraceRecord], speed: float | None, rate: float | None) -> float:
    """Seconds of replay per trace millisecond (see ``replay_speed``)."""
    factor = replay_speed([r.timestamp_ms / 1000 for r in records], speed, rate)
    return 1 / (1000 * factor)


def replay(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    speed: float | None = None,
    rate: float | None = None,
    name: str = "mooncake",
) -> Workload:
    records = read(path, limit)
    scale = arrival_scale(records, speed, rate)
    return Workload(
        name=name,
        description=(
            f"Mooncake-format trace {Path(path).name}: {len(records)} requests, block ids as "
            f"2048-byte texts, /v1/completions, arrivals x{1 / (1000 * scale):g}"
        ),
        requests=requests_of(records, scale),
    )


def requests_of(
    records: list[TraceRecord], scale: float = 0.001, family: str = "mooncake"
) -> list[Request]:
    """The records as requests (see the module's docstring), arrivals at ``scale``
    seconds a trace millisecond from the first."""
    t0 = records[0].timestamp_ms if records else 0.0
    return [
        Request(
            arrival_s=(rec.timestamp_ms - t0) * scale,
            path=COMPLETIONS_PATH,
            body=_encode(
                {
                    "model": MODEL,
                    "prompt": blocks_prompt(rec.hash_ids, rec.input_length),
                    "max_tokens": rec.output_length,
                }
            ),
            output_tokens=rec.output_length,
            family=family,
            session=f"{family}-{rec.line}",
        )
        for rec in records
    ]
