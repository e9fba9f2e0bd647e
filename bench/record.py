"""Where a benchmark's figures go: a JSON file that names the command which wrote it,
with the arguments it ran with, so every figure quoted from it can be rerun."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def command(module: str, argv: Sequence[str] | None) -> str:
    """``python -m <module>`` and its arguments (the process's own when ``argv`` is None,
    as ``main(argv=None)`` receives them)."""
    return " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])


def write(path: str | Path, doc: dict[str, Any]) -> Path:
    """``doc`` as indented JSON at ``path`` (its folder made if missing); says where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return out
