"""The optional C fast path (``_speedups.c``, ``_answer.c``, ``_price.c``, ``_lru.c``,
``_pick.c``) for the request path's per-byte and per-pod steps: a chat or completions
body to its canonical prompt in one pass, the prompt's chained block hashes in one call,
each pod's block LRU as a C structure, each holder's match depth and the chosen pod's
LRU record (refresh and eviction) in one call each, the pricing of every candidate pod
in one call, the default pipeline's whole pick (filter, match, price, choose, record)
in one call, and the answer to Envoy as wire bytes.

``request.py``, ``prefix.py``, ``routing/index.py``, ``routing/pipeline.py`` and
``mutate.py`` hold the reference in Python and call the C versions when the extension
was built (setup.py builds it wherever a C compiler is found). Both give the same
results (``tests/test_speedups.py``, ``test_lru.py``, ``test_price.py``,
``test_pick.py``, ``test_answer.py``); a body the C parser does not handle (an image
part, a key spelled with escapes, anything invalid) goes to the Python path, which
decides.
``ACE_EXTPROC_PURE_PYTHON=1`` runs on Python alone, to compare or to rule the extension
out.
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("ACE_EXTPROC_PURE_PYTHON") == "1":
        return None
    try:
        from ace_extproc import _speedups
    except ImportError:
        return None
    return _speedups


native = _load()
"""The extension module, or None: pure Python."""


def describe() -> str:
    return "native" if native is not None else "pure-python"
