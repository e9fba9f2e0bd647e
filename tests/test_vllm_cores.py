"""Real vLLM pods started here each compute on cores of their own (vllm_pods.split_cores)."""

from __future__ import annotations

import pytest

from ace_extproc.vllm_pods import VllmOptions, split_cores


def test_two_pods_on_two_cores_get_one_each() -> None:
    assert [split_cores(i, 2, [0, 1]) for i in range(2)] == ["0", "1"]


def test_the_remainder_goes_to_the_last_pod() -> None:
    assert [split_cores(i, 3, list(range(8))) for i in range(3)] == ["0,1", "2,3", "4,5,6,7"]


def test_the_cores_this_process_may_use_are_the_ones_split() -> None:
    assert [split_cores(i, 2, [4, 6, 9, 11]) for i in range(2)] == ["4,6", "9,11"]


def test_more_pods_than_cores_share_them_all() -> None:
    assert {split_cores(i, 3, [0, 1]) for i in range(3)} == {"nobind"}


def test_shared_cores_are_not_split() -> None:
    assert split_cores(0, 2, [0, 1], split=False) == "nobind"
    env = VllmOptions(python="py", model="m", cores="shared").environment(1, 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_pod_gets_its_own_share_in_its_environment() -> None:
    options = VllmOptions(python="py", model="m")
    binds = {options.environment(i, 2)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)}
    assert len(binds) == 2 or binds == {"nobind"}  # one core here: nothing to split
    assert "nobind" in binds or not set.intersection(*(set(b.split(",")) for b in binds))


def test_an_unknown_cores_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="pinned"):
        VllmOptions(python="py", model="m", cores="half").environment()  # type: ignore[arg-type]


def test_a_pinned_pod_runs_every_process_on_its_own_cores() -> None:
    """Pinned (the default), each pod's API server, engine core and workers run on its
    share only: split, an engine core busy-polling its worker ran on the other pod's core
    and stalled that pod for seconds (docs/engines.md)."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    pinned = VllmOptions(python="py", model="m")
    assert pinned.cores == "pinned"
    mine = [pinned.affinity(i, 2) for i in range(2)]
    if len(cores) < 2:
        assert mine == [None, None]  # one core: nothing to pin apart
        return
    assert all(m for m in mine) and not set.intersection(*(set(m or ()) for m in mine))
    for i, m in enumerate(mine):  # the same cores its compute threads are bound to
        binds = pinned.environment(i, 2)["VLLM_CPU_OMP_THREADS_BIND"]
        assert m == {int(c) for c in binds.split(",")}
    for way in ("split", "shared"):
        assert VllmOptions(python="py", model="m", cores=way).affinity(0, 2) is None  # type: ignore[arg-type]


def test_a_child_started_on_some_cores_stays_there() -> None:
    import functools
    import os
    import subprocess
    import sys

    from ace_extproc.procs import child

    first = min(os.sched_getaffinity(0))
    run = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=functools.partial(child, 0, frozenset({first})),
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == f"[{first}]"
