"""Child processes that never outlive their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: have the kernel send this process SIGTERM when its parent dies, even by
    SIGKILL, so a crashed supervisor leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child(niceness: int = 0, cores: frozenset[int] | None = None) -> None:  # pragma: no cover
    """A ``preexec_fn``: the child dies with its parent, at ``niceness`` more than it,
    on ``cores`` only where given (inherited by every process it starts)."""
    die_with_parent()
    if niceness:
        os.nice(niceness)
    if cores:
        os.sched_setaffinity(0, cores)
