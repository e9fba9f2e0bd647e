"""Structured logs: one JSON object a line (or text for people).

``configure_logging`` installs one JSON object a line (or text). Each
decision is one line at debug (``ace_extproc.decision``); each anomaly (a bypass a
well-formed client would not cause, a rejected key, no pod) one line at info, at most
``ANOMALY_BURST`` a second for each action. Lines carry mode, action, tenant, pod,
token counts and latency: never prompt text, API keys, salts or prefix keys (the
formatter drops fields of those names even if a caller passes them).
"""

from __future__ import annotations

import json as _json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

# Fields never written by the formatters, whoever passes them.
FORBIDDEN_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "body",
        "text",
        "content",
        "prefix_key",
        "cache_prefix_id",
        "cache_salt",
        "salt",
        "key",
        "api_key",
        "authorization",
        "trace",
        "hashes",
    }
)
# The attribute ``extra={FIELDS_ATTR: {...}}`` puts structured fields under.
FIELDS_ATTR = "ace_fields"
ANOMALY_BURST = 5  # anomaly lines a second, per action; the rest are counted
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS_ATTR, None)
    if not isinstance(fields, dict):
        return {}
    return {k: v for k, v in fields.items() if k not in FORBIDDEN_FIELDS}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601, ms), ``level``, ``logger``,
    ``message``, the record's structured fields (``extra={"ace_fields": {...}}``,
    less ``FORBIDDEN_FIELDS``), and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in _fields(record).items():
            out.setdefault(k, v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return _json.dumps(out, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """The text format, with the structured fields appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        return f"{head} {extra}{sep}{tail}"


def configure_logging(level: str | int = "INFO", json: bool = True) -> None:
    """Route every logger to stderr in JSON lines (or text), replacing the root
    logger's handlers. ``level``: a name or number. Decision lines need DEBUG (or
    the ``ace_extproc.decision`` logger set to DEBUG alone)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def log_decision(
    logger: logging.Logger,
    mode: str,
    action: str,
    tenant: str,
    pod: str,
    prompt_tokens: int,
    cached_tokens: int,
    latency_ns: int,
    *,
    level: int = logging.DEBUG,
    event: str = "decision",
    suppressed: int = 0,
) -> None:
    """One decision as one line. Only these fields: no prompt, key or hash."""
    if not logger.isEnabledFor(level):
        return
    fields: dict[str, Any] = {
        "event": event,
        "mode": str(mode),
        "action": action,
        "tenant": tenant,
        "pod": pod,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "latency_us": round(latency_ns / 1000, 1),
    }
    if suppressed:
        fields["suppressed"] = suppressed  # like lines not written in the last second
    logger.log(level, "%s %s", event, action, extra={FIELDS_ATTR: fields})


def log_anomaly(logger: logging.Logger, event: str, message: str, **fields: Any) -> None:
    """An anomaly outside a decision (a pod, a scrape) at info, with fields."""
    logger.info(message, extra={FIELDS_ATTR: {"event": event, **fields}})


class RateLimit:
    """At most ``burst`` per ``window_s`` for each key; the rest are counted."""

    __slots__ = ("_state", "burst", "clock", "window_s")

    def __init__(
        self, burst: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._state: dict[str, list[float]] = {}  # key -> [window start, used, suppressed]

    def allow(self, key: str) -> bool:
        now = self.clock()
        st = self._state.get(key)
        if st is None:
            if len(self._state) > 1024:
                self._state.clear()
            st = self._state[key] = [now, 0, 0]
        if now - st[0] >= self.window_s:
            st[0], st[1] = now, 0
        if st[1] < self.burst:
            st[1] += 1
            return True
        st[2] += 1
        return False

    def take_suppressed(self, key: str) -> int:
        st = self._state.get(key)
        if st is None:
            return 0
        n = int(st[2])
        st[2] = 0
        return n
