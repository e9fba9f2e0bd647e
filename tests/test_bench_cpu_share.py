"""bench.cpu_share: the windows in which a process group was runnable and got no CPU."""

import os

from bench.cpu_share import TICKS_PER_S, Proc, sample, starved


def _step(t: float, a_ticks: int, b_ticks: int, a_state: str = "R") -> tuple[float, list[Proc]]:
    return t, [Proc(10, "pod-a", 10, a_state, a_ticks), Proc(20, "pod-b", 20, "R", b_ticks)]


def test_a_group_runnable_without_cpu_for_a_second_is_reported() -> None:
    per_step = TICKS_PER_S // 10  # a whole core over 0.1 s
    samples = []
    a = b = 0
    for i in range(30):
        t = i * 0.1
        starving = 5 <= i < 20  # pod-a gets nothing for 1.5 s, pod-b a whole core
        a += 0 if starving else per_step
        b += per_step
        samples.append(_step(t, a, b))
    found = list(starved(samples, min_s=1.0))
    assert [(g, round(s, 1), round(e, 1)) for g, s, e, _ in found] == [(10, 0.4, 1.9)]
    shares = found[0][3]
    assert shares[10] == 0.0 and abs(shares[20] - 1.0) < 1e-9


def test_a_waiting_group_or_a_short_gap_is_not_starved() -> None:
    per_step = TICKS_PER_S // 10
    # Idle (state S) with no CPU: waiting, not starved. Runnable with none for 0.5 s:
    # shorter than the window asked for.
    idle = [_step(i * 0.1, 0, i * per_step, "S") for i in range(20)]
    short = [_step(i * 0.1, 0 if i < 5 else i * per_step, i * per_step) for i in range(20)]
    assert list(starved(idle)) == []
    assert list(starved(short, min_s=1.0)) == []


def test_this_process_is_found_in_proc() -> None:
    mine = [p for p in sample(["pytest", "python"]) if p.pid == os.getpid()]
    assert len(mine) == 1 and mine[0].group == os.getpgrp() and mine[0].state == "R"
