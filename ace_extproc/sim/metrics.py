"""Prometheus text exposition of the sim's state under vLLM's metric names.

Written by hand (a few dozen lines) so the sim needs no prometheus-client.
Names, types and labels follow vLLM v1: ``engine`` and ``model_name`` on every
series, label names sorted as vLLM 0.32 writes them, counters exposed with their
``_total`` suffix, TTFT buckets as vLLM's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

# What vLLM 0.32's prometheus-client (0.26) answers a GET with; the body is the same text.
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


def _gauge_num(value: float) -> str:
    """A gauge's value as prometheus-client writes it: Python's shortest digits, but
    from 1e7 on in exponent form, as Go prints floats ("1.7333995905843e+09")."""
    text = repr(float(value))
    if not value >= 1e7 or "e" in text or "inf" in text:
        return text
    whole, _, frac = text.partition(".")
    digits = (whole + frac).rstrip("0")
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{mantissa}e+{len(whole) - 1:02d}"


class Histogram:
    """A cumulative-bucket histogram (counts per upper bound, plus +Inf)."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...] = TTFT_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels(pairs: Mapping[str, str]) -> str:
    """``{a="1",b="2"}``, names sorted as vLLM writes them."""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items())) + "}"


def _num(value: float) -> str:
    return repr(float(value))  # "3.0", "0.25", "inf": what prometheus-client prints


class Exposition:
    """Accumulates metric families, then renders them."""

    def __init__(self, base_labels: Mapping[str, str]) -> None:
        self._base = dict(base_labels)
        self._lbl = labels(self._base)
        self._lines: list[str] = []

    def _head(self, name: str, kind: str, help_text: str) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self._head(name, "gauge", help_text)
        self._lines.append(f"{name}{self._lbl} {_num(value)}")

    def process_gauge(self, name: str, value: float, help_text: str) -> None:
        """A process metric, without the engine's labels (as prometheus-client's
        process collector writes ``process_start_time_seconds``)."""
        self._head(name, "gauge", help_text)
        self._lines.append(f"{name} {_num(value)}")

    def counter(self, name: str, value: float, help_text: str) -> None:
        self._head(name, "counter", help_text)
        self._lines.append(f"{name}{self._lbl} {_num(value)}")

    def labelled_gauge(
        self, name: str, label: str, values: Mapping[str, float], help_text: str
    ) -> None:
        self._labelled(name, "gauge", label, values, help_text)

    def labelled_counter(
        self, name: str, label: str, values: Mapping[str, float], help_text: str
    ) -> None:
        self._labelled(name, "counter", label, values, help_text)

    def _labelled(
        self, name: str, kind: str, label: str, values: Mapping[str, float], help_text: str
    ) -> None:
        self._head(name, kind, help_text)
        for key, value in values.items():
            self._lines.append(f"{name}{labels({**self._base, label: key})} {_num(value)}")

    def info(self, name: str, info: Mapping[str, str], help_text: str) -> None:
        self._head(name, "gauge", help_text)
        self._lines.append(f"{name}{labels(info)} 1.0")

    def info_series(
        self, name: str, samples: list[tuple[dict[str, str], float]], help_text: str
    ) -> None:
        """A gauge of several label sets and no base labels (``vllm:lora_requests_info``:
        labels in the order given, as prometheus-client writes a gauge's labelnames)."""
        self._head(name, "gauge", help_text)
        for pairs, value in samples:
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items())
            self._lines.append(f"{name}{{{text}}} {_gauge_num(value)}")

    def histogram(self, name: str, hist: Histogram, help_text: str) -> None:
        self._head(name, "histogram", help_text)
        cumulative = 0
        for bound, n in zip((*hist.buckets, float("inf")), hist.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else _num(bound)
            self._lines.append(
                f"{name}_bucket{labels({**self._base, 'le': le})} {_num(cumulative)}"
            )
        self._lines.append(f"{name}_count{self._lbl} {_num(hist.count)}")
        self._lines.append(f"{name}_sum{self._lbl} {_num(hist.sum)}")

    def render(self, only: frozenset[str] | None = None) -> str:
        """The text; with ``only``, as prometheus-client answers ``?name[]=...``: just
        the samples of those names, each family's HELP and TYPE where one is left."""
        if only is None:
            return "\n".join(self._lines) + "\n"
        out: list[str] = []
        head: list[str] = []
        for line in self._lines:
            if line.startswith("# HELP"):
                head = [line]
            elif line.startswith("#"):
                head.append(line)
            elif line.partition("{")[0].partition(" ")[0] in only:
                out += head
                head = []
                out.append(line)
        return "\n".join(out) + "\n" if out else ""
