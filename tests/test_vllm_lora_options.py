"""LoRA options of the real-engine pods, without an engine: the flags they render and the
adapters ``make_adapters`` writes (tests/engines/test_lora.py serves them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ace_extproc.vllm_pods import LoraModule, VllmOptions, make_adapters

TINY = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def test_no_adapters_no_lora_flags() -> None:
    argv = VllmOptions(python="py", model="m").argv("127.0.0.1", 8000)
    assert not any("lora" in a for a in argv)


def test_lora_flags() -> None:
    modules = (LoraModule("a", "/x/a"), LoraModule("b", "/x/b"))
    options = VllmOptions(python="py", model="m", lora_modules=modules, max_loras=2)
    argv = options.argv("127.0.0.1", 8000)
    assert "--enable-lora" in argv and "--max-cpu-loras" not in argv
    assert argv[argv.index("--max-loras") + 1] == "2"
    assert argv[argv.index("--max-lora-rank") + 1] == "8"
    start = argv.index("--lora-modules") + 1
    assert argv[start : start + 2] == ["a=/x/a", "b=/x/b"]
    cpu = VllmOptions(python="py", model="m", lora_modules=modules, max_cpu_loras=4)
    argv = cpu.argv("127.0.0.1", 8000)
    assert argv[argv.index("--max-cpu-loras") + 1] == "4"


def _header(path: Path) -> dict[str, dict[str, object]]:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header: dict[str, dict[str, object]] = json.loads(raw[8 : 8 + size])
    end = max(int(t["data_offsets"][1]) for t in header.values())  # type: ignore[index]
    assert len(raw) == 8 + size + end and size % 8 == 0
    return header


def test_make_adapters_writes_peft_layout(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    modules = make_adapters(tmp_path / "out", 3, model=model, seed=1)
    assert [m.name for m in modules] == ["lora-0", "lora-1", "lora-2"]
    config = json.loads(Path(modules[0].path, "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj"]
    header = _header(Path(modules[0].path, "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.self_attn"
    assert header[f"{prefix}.q_proj.lora_A.weight"]["shape"] == [8, 128]
    assert header[f"{prefix}.q_proj.lora_B.weight"]["shape"] == [128, 8]
    assert header[f"{prefix}.v_proj.lora_B.weight"]["shape"] == [64, 8]
    assert len(header) == 2 * 2 * 2  # layers x targets x (A, B)
    again = make_adapters(tmp_path / "again", 3, model=model, seed=1)
    blobs = [Path(m.path, "adapter_model.safetensors").read_bytes() for m in (*modules, *again)]
    assert blobs[:3] == blobs[3:] and len(set(blobs[:3])) == 3


def test_the_engines_niceness_is_set_in_the_child_only() -> None:
    import functools
    import os
    import subprocess
    import sys

    from ace_extproc.procs import child

    ours = os.nice(0)
    run = subprocess.run(
        [sys.executable, "-c", "import os; print(os.nice(0))"],
        preexec_fn=functools.partial(child, 7),
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(run.stdout) == min(ours + 7, 19) and os.nice(0) == ours


def test_an_engine_s_session_is_niced_too() -> None:
    """With autogroups, niceness counts only within a session, so the engines' session
    groups are niced (run T's engines at niceness 10 alone still starved the sidecar)."""
    import subprocess
    import sys

    from ace_extproc.vllm_pods import nice_session

    own_group = Path("/proc/self/autogroup")
    # The file exists but reads empty where autogroups are off (sched_autogroup_enabled=0).
    if not own_group.exists() or not own_group.read_text().split():
        pytest.skip("no autogroups in this kernel")
    ours = own_group.read_text().split()[-1]
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(5)"], start_new_session=True
    )
    try:
        nice_session(child.pid, 7)
        assert Path(f"/proc/{child.pid}/autogroup").read_text().split()[-1] == "7"
    finally:
        child.kill()
        child.wait()
    assert own_group.read_text().split()[-1] == ours
    nice_session(child.pid, 7)  # gone: nothing to nice, nothing raised
