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
    with pytest.raises(ValueError, match="split"):
        VllmOptions(python="py", model="m", cores="half").environment()  # type: ignore[arg-type]
