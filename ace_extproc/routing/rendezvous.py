"""Rendezvous (highest-random-weight) placement of new prefixes.

Every replica computes the same order of pods for a key with no shared state, and
adding or removing a pod moves only the keys that pod wins or held (~1/N of them).
Weighted by the logarithm method: score = -weight / ln(u), u uniform in (0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_SCALE = 1.0 / 2.0**64


def pod_seed(pod_key: str) -> int:
    return _xxh3(pod_key.encode())


def key_of(name: str) -> int:
    """A placement key for a name (a session id), like a prefix's block hash."""
    return _xxh3(name.encode())


def score(key: int, seed: int, weight: float) -> float:
    u = (_xxh3(key.to_bytes(8, "little"), seed) + 0.5) * _SCALE
    return -weight / math.log(u)


def rank(key: int, seeds: Sequence[tuple[int, float]]) -> list[int]:
    """Indexes into ``seeds`` (``(seed, weight)`` per pod), best first."""
    scores = [score(key, s, w) for s, w in seeds]
    return sorted(range(len(seeds)), key=scores.__getitem__, reverse=True)


def best(key: int, seeds: Sequence[tuple[int, float]], allowed: int = -1) -> int:
    """The index of the highest-scoring pod whose bit is set in ``allowed``."""
    if allowed < 0:
        allowed = (1 << len(seeds)) - 1
    top, top_score = -1, -1.0
    data = key.to_bytes(8, "little")
    # Only the allowed pods are scored: usually two or three near-equal ones of many.
    while allowed:
        low = allowed & -allowed
        allowed ^= low
        i = low.bit_length() - 1
        if i >= len(seeds):
            break
        seed, weight = seeds[i]
        s = -weight / math.log((_xxh3(data, seed) + 0.5) * _SCALE)
        if s > top_score:
            top, top_score = i, s
    return top
