"""Pure helpers for comparing two engines' answers (``bench.sim_vs_real`` and the
real-engine tier's parity test): the *shape* of a JSON value, where two shapes differ,
and the metric families of a Prometheus exposition with their label keys.

A shape keeps what a client could depend on and drops the values: an object becomes
its keys with their shapes, a list the distinct shapes of its items, and a scalar its
JSON type (``str``, ``int``, ``float``, ``bool``, ``null``).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

Shape = Any  # str for a scalar, dict for an object, list for a list


def shape(value: Any) -> Shape:
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        seen: dict[str, Shape] = {}
        for item in value:
            s = shape(item)
            seen.setdefault(json.dumps(s, sort_keys=True), s)
        return [seen[k] for k in sorted(seen)]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "str" if isinstance(value, str) else type(value).__name__


def _kind(s: Shape) -> str:
    return "object" if isinstance(s, dict) else "list" if isinstance(s, list) else s


def shape_diff(sim: Shape, real: Shape, path: str = "") -> list[str]:
    """Where ``sim`` differs from ``real``, one line per place: a key only one side
    has, or a different type (``int`` and ``float`` are both numbers to JSON, but a
    client in a typed language tells them apart, so they count)."""
    here = path or "(top)"
    if isinstance(sim, dict) and isinstance(real, dict):
        out: list[str] = []
        for key in sorted(set(sim) | set(real)):
            sub = f"{path}.{key}" if path else key
            if key not in sim:
                out.append(f"{sub}: only real has it ({_kind(real[key])})")
            elif key not in real:
                out.append(f"{sub}: only sim has it ({_kind(sim[key])})")
            else:
                out.extend(shape_diff(sim[key], real[key], sub))
        return out
    if isinstance(sim, list) and isinstance(real, list):
        if len(sim) == 1 and len(real) == 1:
            return shape_diff(sim[0], real[0], path + "[]")
        if (
            not sim
            or not real
            or json.dumps(sim, sort_keys=True) == json.dumps(real, sort_keys=True)
        ):
            return []  # an empty list fits any item shape
        return [f"{here}: items sim {json.dumps(sim)} real {json.dumps(real)}"]
    if sim != real:
        return [f"{here}: sim {_kind(sim)}, real {_kind(real)}"]
    return []


# -- Prometheus text ----------------------------------------------------------------------

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


@dataclass
class Family:
    """One sample name's type (from its ``# TYPE``) and the label-key sets seen on it."""

    type: str = "untyped"
    label_keys: set[tuple[str, ...]] = field(default_factory=set)
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def _family_of(sample: str, types: dict[str, str]) -> str:
    """The ``# TYPE`` name a sample belongs to (``x_bucket`` of histogram ``x``...)."""
    if sample in types:
        return sample
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created"):
        base = sample.removesuffix(suffix)
        if base != sample and base in types:
            return base
    return sample


def exposition(text: str) -> dict[str, Family]:
    """Every sample name of a ``/metrics`` body with its type, label keys and samples."""
    types: dict[str, str] = {}
    out: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind.strip()
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, raw_labels, raw_value = m.groups()
        labels = dict(_LABEL.findall(raw_labels or ""))
        fam = out.setdefault(name, Family())
        fam.type = types.get(_family_of(name, types), "untyped")
        fam.label_keys.add(tuple(sorted(labels)))
        with contextlib.suppress(ValueError):  # a malformed value: keys still count
            fam.samples.append((labels, float(raw_value)))
    return out


def value(families: dict[str, Family], name: str, **match: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``match`` (None: no sample)."""
    fam = families.get(name)
    if fam is None:
        return None
    found = [v for labels, v in fam.samples if all(labels.get(k) == x for k, x in match.items())]
    return sum(found) if found else None


def labels_of(families: dict[str, Family], name: str) -> dict[str, str]:
    """The labels of ``name``'s first sample (an info metric's payload)."""
    fam = families.get(name)
    return dict(fam.samples[0][0]) if fam and fam.samples else {}


def expected_cached(prompt_tokens: int, block_size: int, matched: int | None = None) -> int:
    """vLLM's cached tokens for a prompt whose first ``matched`` tokens (default: all)
    are in the cache: whole blocks only, and never the prompt's last token, which is
    always recomputed (so a prompt of exactly k blocks reuses k - 1 of them)."""
    limit = prompt_tokens - 1 if matched is None else min(matched, prompt_tokens - 1)
    return max(limit, 0) // block_size * block_size
