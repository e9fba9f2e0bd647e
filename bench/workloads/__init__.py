"""Workloads for the benchmark: the product's 800-prompt suite, trace replays and
stress shapes. ``get(name, ...)`` builds one by name; see README.md for each shape.

==============  =====================================================  ================
name            what                                                   default size
==============  =====================================================  ================
``seed800``     chat, document QA, agent loops, 5-shot (:mod:`.suite`)  800 requests
``mooncake``    the shipped Mooncake trace (:mod:`.mooncake`)           3,993 requests
``trace:PATH``  any Mooncake-format JSONL file                          the whole file
``azure-code``  Azure 2023 code trace + repo prefixes (:mod:`.azure`)   3,000 requests
``azure-conv``  Azure 2023 conv trace + conversations                   3,000 requests
``hot-prefix``  90% on one system prompt (:mod:`.stress`)               3,000 requests
``churn``       the suite's families while a pod leaves and one joins   1,200 requests
``burst32k``    bursts of 24 parallel ~30K-token documents              480 requests
``conv-burst``  conversations, one shared block, whole-second bursts    3,000 requests
``lora-mix``    64 LoRA adapters, Zipf popularity (:mod:`.lora`)        3,000 requests
==============  =====================================================  ================
"""

from __future__ import annotations

import os
from pathlib import Path

from . import azure, convburst, lora, mooncake, stress, suite
from .base import FleetEvent, Request, TraceError, Workload

__all__ = [
    "NAMES",
    "TRACE_PREFIX",
    "FleetEvent",
    "Request",
    "TraceError",
    "Workload",
    "get",
    "traces_dir",
]

# The built-in workloads; any Mooncake-format file is also a workload: "trace:PATH".
NAMES = (
    "seed800", "mooncake", "azure-code", "azure-conv", "hot-prefix", "churn", "burst32k",
    "conv-burst", "lora-mix",
)  # fmt: skip
TRACE_PREFIX = "trace:"

TRACE_FILES = {
    "mooncake": "mooncake_synthetic_trace.jsonl",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
}
_REPO_ROOT = Path(__file__).resolve().parents[2]


def traces_dir() -> Path:
    """``$ACE_TRACES_DIR``, else ``../shared/data/traces`` from the repository root."""
    env = os.environ.get("ACE_TRACES_DIR")
    return Path(env) if env else _REPO_ROOT.parent / "shared" / "data" / "traces"


def get(
    name: str,
    *,
    seed: int = 0,
    limit: int | None = None,
    rate: float | None = None,
    path: str | None = None,
    speed: float | None = None,
) -> Workload:
    """Build the workload ``name`` (one of ``NAMES``; ``trace:PATH`` for any
    Mooncake-format file).

    ``limit`` keeps the first N requests (for the Azure traces, the first N rows;
    default 3,000). ``rate`` is requests/s: the Poisson rate of the synthetic ones,
    the mean arrival rate a trace is rescaled to. ``speed`` divides a trace's
    inter-arrival times (not with ``rate``). ``path`` replaces a trace's file.
    Raises ``ValueError`` (``TraceError`` for a bad trace) or ``OSError``.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    is_trace = name in TRACE_FILES or name.startswith(TRACE_PREFIX)
    if not is_trace and (path is not None or speed is not None):
        raise ValueError(f"path and speed apply to trace replays, not {name!r}")
    if name.startswith(TRACE_PREFIX):
        file = name.removeprefix(TRACE_PREFIX)
        if not file:
            raise ValueError("trace: needs a path, e.g. trace:/data/my_trace.jsonl")
        return mooncake.replay(file, limit=limit, speed=speed, rate=rate, name=name)
    if is_trace:
        file = path or str(traces_dir() / TRACE_FILES[name])
        if name == "mooncake":
            return mooncake.replay(file, limit=limit, speed=speed, rate=rate)
        build = azure.code if name == "azure-code" else azure.conv
        return build(
            file, seed=seed, limit=azure.DEFAULT_LIMIT if limit is None else limit,
            speed=speed, rate=rate,
        )  # fmt: skip
    makers = {
        "seed800": suite.build,
        "hot-prefix": stress.hot_prefix,
        "churn": stress.churn,
        "burst32k": stress.burst32k,
        "conv-burst": convburst.build,
        "lora-mix": lora.build,
    }
    if name not in makers:
        known = ", ".join((*NAMES, TRACE_PREFIX + "PATH"))
        raise ValueError(f"unknown workload {name!r}; known: {known}")
    workload = makers[name](seed, rate)
    if limit is not None:
        workload.requests = workload.requests[:limit]
    return workload
