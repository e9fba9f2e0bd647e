"""One real vLLM pod and one simulated pod configured like it, for the comparisons
(``bench.sim_vs_real``, ``bench.calibrate_vllm``, tests/engines/test_sim_parity.py).

The real pod is ``vllm_pods``' (the CPU build, the tiny model, 32-token blocks, its
``max_model_len``, dev mode for ``/reset_prefix_cache``). The simulated one is
``ace-extproc sim`` with the same served names, block size, context length, running-seat
and batch limits, default answer length, and the real pod's KV size in blocks, read from
its ``vllm:cache_config_info`` once it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from ace_extproc.vllm_pods import BLOCK_SIZE, TTFT_MODEL, Pods, VllmOptions
from bench.parity import exposition, labels_of

ROOT = Path(__file__).resolve().parent.parent
# vLLM's CPU defaults for the OpenAI server (engine/arg_utils.py): 2048 batched tokens.
MAX_NUM_BATCHED_TOKENS = 2048
MAX_TOKENS_DEFAULT = 16  # the tiny model's generation_config.json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sim_argv(
    port: int,
    options: VllmOptions,
    num_gpu_blocks: int,
    *,
    time_scale: float = 1.0,
    extra: Sequence[str] = (),
) -> list[str]:
    """``ace-extproc sim`` set up like a real pod with ``options``."""
    return [
        sys.executable, "-m", "ace_extproc.cli", "sim",
        "--port", str(port), "--pod-id", "sim",
        "--model", *options.served_names,
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks", str(num_gpu_blocks),
        "--max-model-len", str(options.max_model_len),
        "--max-num-seqs", str(options.max_num_seqs),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--max-tokens-default", str(MAX_TOKENS_DEFAULT),
        "--ttft-model", TTFT_MODEL,
        "--time-scale", str(time_scale),
        *extra,
    ]  # fmt: skip


async def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s:g} s")


@contextlib.asynccontextmanager
async def sim_pod(argv: list[str], url: str, log: Path) -> AsyncIterator[str]:
    """A simulated pod as its own process (stopped with its process group)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        await wait_healthy(url)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def kv_blocks(url: str) -> int:
    """The pod's ``num_gpu_blocks`` from its ``vllm:cache_config_info``."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return int(labels_of(exposition(text), "vllm:cache_config_info")["num_gpu_blocks"])


@contextlib.asynccontextmanager
async def real_pod(workdir: Path, options: VllmOptions | None = None) -> AsyncIterator[Pods]:
    """One real vLLM pod on a free port (raises EnginesMissing without ``make engines``)."""
    options = options or VllmOptions.find(dev_mode=True)
    async with Pods(options, [free_port()], workdir) as pods:
        yield pods


@contextlib.asynccontextmanager
async def pair(
    workdir: Path, *, time_scale: float = 1.0, sim_extra: Sequence[str] = ()
) -> AsyncIterator[tuple[str, str, dict[str, list[str]]]]:
    """``(sim url, real url, argv of each)``: the real pod first, then the sim sized to it."""
    options = VllmOptions.find(dev_mode=True)
    async with real_pod(workdir, options) as pods:
        real = pods.urls[0]
        port = free_port()
        argv = sim_argv(
            port, options, await kv_blocks(real), time_scale=time_scale, extra=sim_extra
        )
        sim = f"http://127.0.0.1:{port}"
        async with sim_pod(argv, sim, workdir / "sim.log"):
            real_argv = options.argv("127.0.0.1", pods.ports[0])
            yield sim, real, {"sim": argv[1:], "real": real_argv[1:]}
