"""Which process groups got the CPU, sampled from ``/proc``: a diagnostic for the rig.

    python -m bench.cpu_share --match vllm,VLLM --seconds 300 [--every 0.1] [--out FILE]

Every ``--every`` seconds, each process whose command line or name contains one of
``--match`` is read from ``/proc/PID/stat``: its state and CPU ticks. Processes are
grouped by process group (each real vLLM server leads its own, ``vllm_pods``). Printed:
the windows of at least ``--min-s`` in which a group had a process runnable all along
yet got under a tenth of a core, with what every other group got meanwhile. That is how
the real pods were found stalling each other: with only their compute threads bound
to their cores, one server's engine core, busy-polling its worker, ran on the other
server's core (docs/engines.md). ``--out`` keeps the samples as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    name: str
    group: int  # process group
    state: str  # R: running or runnable; S, D: waiting
    ticks: int  # user + system CPU, in clock ticks


def sample(patterns: Sequence[str], proc: Path = Path("/proc")) -> list[Proc]:
    """The processes matching any of ``patterns``, as ``/proc`` says now."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:  # gone since listed
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if not any(p in cmd or p in name for p in patterns):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        found.append(
            Proc(
                int(entry.name), name, int(fields[2]), fields[0], int(fields[11]) + int(fields[12])
            )
        )
    return found


def starved(
    samples: Sequence[tuple[float, list[Proc]]], min_s: float = 1.0, share: float = 0.1
) -> Iterator[tuple[int, float, float, dict[int, float]]]:
    """Windows of at least ``min_s`` in which a group had a process runnable at every
    sample yet got under ``share`` of a core: (group, start, end, each group's share of
    a core over the window)."""
    runs: dict[int, list[int]] = defaultdict(list)  # group -> sample indexes in a run
    steps = []
    for i in range(1, len(samples)):
        (t0, before), (t1, now) = samples[i - 1], samples[i]
        ticks0 = {p.pid: p.ticks for p in before}
        used: dict[int, float] = defaultdict(float)
        runnable: set[int] = set()
        for p in now:
            used[p.group] += (p.ticks - ticks0.get(p.pid, p.ticks)) / TICKS_PER_S
            if p.state == "R":
                runnable.add(p.group)
        steps.append((t0, t1, used))
        for group in {p.group for p in now}:
            if group in runnable and used[group] < share * (t1 - t0):
                runs[group].append(len(steps) - 1)
            else:
                yield from _window(group, runs.pop(group, []), steps, min_s)
    for group, run in runs.items():
        yield from _window(group, run, steps, min_s)


def _window(
    group: int,
    run: list[int],
    steps: list[tuple[float, float, dict[int, float]]],
    min_s: float,
) -> Iterator[tuple[int, float, float, dict[int, float]]]:
    if not run:
        return
    start, end = steps[run[0]][0], steps[run[-1]][1]
    if end - start < min_s:
        return
    totals: dict[int, float] = defaultdict(float)
    for i in run:
        for g, seconds in steps[i][2].items():
            totals[g] += seconds
    yield group, start, end, {g: s / (end - start) for g, s in sorted(totals.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", default="vllm,VLLM", help="comma-separated substrings")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=0.1)
    ap.add_argument("--min-s", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    patterns = [p for p in args.match.split(",") if p]
    samples: list[tuple[float, list[Proc]]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t = time.monotonic()
        own = os.getpgrp()  # this sampler's own group matches its patterns too
        samples.append((t, [p for p in sample(patterns) if p.group != own]))
        time.sleep(max(0.0, args.every - (time.monotonic() - t)))
    if args.out:
        with open(args.out, "w") as f:
            for t, procs in samples:
                f.write(json.dumps([t, [astuple(p) for p in procs]]) + "\n")
    t0 = samples[0][0] if samples else 0.0
    names = {p.group: p.name for _, procs in samples for p in procs if p.pid == p.group}
    print(f"{len(samples)} samples; groups: {names}")
    for group, start, stop, shares in starved(samples, args.min_s):
        others = ", ".join(f"{g}: {s:.0%}" for g, s in shares.items())
        print(f"group {group} runnable with no CPU {start - t0:.1f}-{stop - t0:.1f} s ({others})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
