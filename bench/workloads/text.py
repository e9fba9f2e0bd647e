"""Deterministic pseudo-text, cheap enough for millions of tokens.

Everything is cut from one precomputed ~1 MiB stream of seeded English words
(``POOL``): a piece of text is a slice of it at a word start, so making text costs a
slice, not a random draw per word. The pool is ASCII with no quote, backslash or
control character, so one character is one byte, one token of the simulated engine
is four characters, and JSON encoding never grows it.

Two slices at different offsets share no prefix (the words are random), but two at
the *same* offset do; callers put a unique tag (document number, block id) at the
start of anything whose prefix must not be shared by accident.
"""

from __future__ import annotations

import random
from array import array

BYTES_PER_TOKEN = 4  # the simulated engine's tokenizer: one token per 4 bytes
MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_BLOCK_BYTES = MOONCAKE_BLOCK_TOKENS * BYTES_PER_TOKEN  # 2048

_WORDS = """
the of and to in is was for that with as on by at from his her this which or are be had
it an not but have were their been has one all its they would who more when there can
will about other into some time than only these two may first after then new also could
over like such used any most where made through between many before under very well
system model cache prefix router token engine request latency memory block layer query
answer result value table index server client network buffer stream packet thread queue
design method policy report review update version module package library function class
object string number vector matrix signal sample output input source target record field
market price growth energy water river city region nation history theory science health
season garden window letter chapter author reader story music image camera screen device
quickly slowly carefully rarely often always never almost nearly exactly simply clearly
large small early late major minor local global public private simple complex common
rapid stable robust modern ancient northern southern central formal direct general final
measure compare describe explain consider provide require include support reduce extend
observe predict improve publish collect analyze deliver operate maintain evaluate select
"""
_VOCAB = tuple(_WORDS.split())

_POOL_BYTES = 1 << 20
_POOL_SEED = 0x5EED_7E47  # fixed: the text never depends on a workload's seed


def _build_pool() -> tuple[str, array[int]]:
    rng = random.Random(_POOL_SEED)
    words = rng.choices(_VOCAB, k=_POOL_BYTES // 6)
    # Sentences of 8-20 words, so the text reads like prose rather than a word list.
    out: list[str] = []
    starts = array("l")
    size = 0
    until_stop = rng.randint(8, 20)
    for w in words:
        until_stop -= 1
        if until_stop == 0:
            w += "."
            until_stop = rng.randint(8, 20)
        starts.append(size)
        out.append(w)
        size += len(w) + 1
    return " ".join(out), starts


POOL, _STARTS = _build_pool()
# Word starts with at least one Mooncake block of text after them.
_BLOCK_STARTS = sum(1 for s in _STARTS if s + MOONCAKE_BLOCK_BYTES <= len(POOL))


def words(rng: random.Random, n_bytes: int) -> str:
    """``n_bytes`` of pseudo-text (exactly) starting at a random word."""
    if n_bytes <= 0:
        return ""
    parts: list[str] = []
    left = n_bytes
    while left > 0:
        start = _STARTS[rng.randrange(len(_STARTS))]
        piece = POOL[start : start + left]
        parts.append(piece)
        left -= len(piece)
        if left > 0:  # ran off the pool's end: continue from another word
            parts.append(" ")
            left -= 1
    return "".join(parts)


def tokens_text(rng: random.Random, tokens: int) -> str:
    """Text of exactly ``tokens`` engine tokens (4 bytes each)."""
    return words(rng, tokens * BYTES_PER_TOKEN)


def tagged(tag: str, rng: random.Random, n_bytes: int) -> str:
    """``tag`` then pseudo-text, ``n_bytes`` in all (at least the tag)."""
    return tag + words(rng, n_bytes - len(tag))


class Stream:
    """An endless text from a fixed random word of the pool: ``take(n)`` is always the
    same first ``n`` bytes, so texts of different lengths cut from one stream share
    their prefix (a file read up to different cursors, a growing document)."""

    __slots__ = ("start",)

    def __init__(self, rng: random.Random) -> None:
        self.start = _STARTS[rng.randrange(len(_STARTS))]

    def take(self, n_bytes: int) -> str:
        parts = [POOL[self.start : self.start + max(n_bytes, 0)]]
        left = n_bytes - len(parts[0])
        while left > 0:  # past the pool's end: wrap around to its start
            parts.append(" " + POOL[: left - 1])
            left -= len(parts[-1])
        return "".join(parts)


def block_text(block_id: int) -> str:
    """The fixed 2048-byte text of a Mooncake block id (512 engine tokens).

    It opens with the id in decimal and a space, so two different ids differ within
    their first few bytes (a space ends the shorter number): prompts built from
    block texts share exactly their common blocks, plus at most the common leading
    digits of the next block's id, which is less than one engine cache block (16
    tokens, 64 bytes) or router block (512 bytes). The rest is a pool slice chosen
    by a multiplicative hash of the id.
    """
    tag = f"{block_id} "
    start = _STARTS[(block_id * 0x9E3779B1) % _BLOCK_STARTS]
    return tag + POOL[start : start + MOONCAKE_BLOCK_BYTES - len(tag)]


def blocks_prompt(hash_ids: list[int], input_length: int) -> str:
    """A Mooncake record's prompt: its blocks' texts joined, cut to ``input_length`` tokens."""
    return "".join(map(block_text, hash_ids))[: input_length * BYTES_PER_TOKEN]
