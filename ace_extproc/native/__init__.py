"""Native code, for mechanism only, and the one place that chooses it.

The C extension (``_speedups.c`` and its parts) works on plain bytes, ints and
buffers, never on the package's domain objects; every policy is Python. Each piece
has a Python reference beside it, which gives the same results (the parity tests),
and each is here only because a recorded end-to-end A/B shows it pays
(bench/RESULTS.md, "Native code"):

- ``prompt``: a chat or completions body to its canonical prompt in one pass, and
  the prompt's chained block hashes in one call. Reference: ``request.parse_pure``
  (the typed msgspec parse, which also decides every body the C parser declines) and
  ``hashing.py``. Pays at large bodies: 22-27% less sidecar CPU a request at 220 KB.
- ``lru``: each pod's block LRU as a C structure (16 bytes a block), its match and
  its record. Reference: ``lru.py`` (a dict per pod). Pays in memory: 2.5x fewer
  bytes a tracked block (``bench.index_memory``).

Reading a request's headers from Envoy's wire bytes and writing the body answer's
bytes were native too; the A/B showed neither saved 10% of the sidecar's CPU a
request at 16 KB or 220 KB, so they were deleted.

Where no C compiler was found the package runs on the references alone.
``ACE_EXTPROC_PURE_PYTHON=1`` rules the extension out; ``ACE_EXTPROC_NATIVE`` names
the pieces to use (``prompt,lru``; ``none``), for side-by-side runs.
"""

from __future__ import annotations

import os
from types import ModuleType

from ace_extproc.native import hashing, lru

PIECES = ("prompt", "lru")


def _load() -> ModuleType | None:
    if os.environ.get("ACE_EXTPROC_PURE_PYTHON") == "1":
        return None
    try:
        from ace_extproc.native import _speedups
    except ImportError:
        return None
    return _speedups


def _chosen() -> frozenset[str]:
    named = os.environ.get("ACE_EXTPROC_NATIVE", "").strip()
    if not named:
        return frozenset(PIECES)
    chosen = frozenset(p.strip() for p in named.split(",") if p.strip() not in ("", "none"))
    if unknown := chosen - set(PIECES):
        raise ImportError(f"ACE_EXTPROC_NATIVE: unknown pieces {sorted(unknown)}; known: {PIECES}")
    return chosen


extension = _load()
"""The compiled module, or None: no piece is native."""
used = frozenset[str]() if extension is None else _chosen()
"""The pieces running in C in this process."""

# Each piece: the extension's functions where it is used, else the reference's (the
# parsers have none here: request.parse_pure decides every body).
_prompt = extension if extension is not None and "prompt" in used else None
chat_prompt = _prompt.chat_prompt if _prompt is not None else None
completion_prompt = _prompt.completion_prompt if _prompt is not None else None
chain = _prompt.chain if _prompt is not None else hashing.chain
prefix_hashes = _prompt.prefix_hashes if _prompt is not None else hashing.prefix_hashes
_lru = extension if extension is not None and "lru" in used else None
LRU_OPS = lru.Structures.of(_lru) if _lru is not None else lru.REFERENCE


def describe() -> str:
    """What the start-up line says: which pieces run in C."""
    if not used:
        return "pure-python"
    return "native " + ",".join(p for p in PIECES if p in used)
