"""The simulated fleet's engine settings (one set for every pod)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ace_extproc import latency, vllm_pods
from bench.workloads.base import Workload


@dataclass(frozen=True)
class SimSettings:
    block_size: int = 16  # engine KV block, tokens (vLLM's default)
    # KV capacity per pod, in blocks. 16,384 x 16 = 262K tokens: about 17 average
    # Mooncake prompts (15K tokens), or a few hundred suite conversations, so a pod
    # cannot hold the whole fleet's working set and where a prefix goes matters.
    # (A 70B FP8 model on 4 H100s has room for a few times more; smaller is the
    # conservative choice for a cache-routing benchmark.)
    num_gpu_blocks: int = 16384
    ttft_model: str = latency.DEFAULT_MODEL
    max_num_batched_tokens: int = 8192  # per-step token budget (chunked prefill)
    max_num_seqs: int = 256  # most admitted requests per pod
    # Decode step time. None: from the model, a step costs max(t_step, sum over
    # decoding requests of a + b * context), ~t_step (11 ms for the default model)
    # at low concurrency. A number: every step that decodes takes at least this
    # long, and decode tokens add no work of their own.
    tpot_ms: float | None = None
    scrape_interval_s: float = 0.1  # how often the router's PodLoad view is refreshed
    # How long after a request is answered Envoy's access log reports it to the router
    # (observe.py; Envoy flushes the log every 0.1 s). None: no access log, as in a
    # gateway that does not send one (only the scrapes say a request has finished).
    access_log_s: float | None = 0.1
    pooled_cache: bool = False  # bound: all pods share ONE cache of pods x capacity
    unbounded_cache: bool = False  # bound: caches never evict (nor refuse admission)
    # Precise routing: the pods publish KV events (BlockStored as prefill chunks commit
    # blocks, BlockRemoved on eviction) and the destination has ``tokenizer: sim``, so
    # the router keys requests token-exact and routes the pods by what they hold.
    kv_events: bool = False
    # How long after the engine's step an event reaches the router's index (the
    # publisher's batching, ZMQ, the router's reader). Simulated seconds.
    event_delay_s: float = 0.05
    # The router's ``router.precise.speculate``: a pick counts as held on the pod
    # until its events confirm it (False: only what the events said).
    speculate: bool = True
    # LoRA, as vLLM's --enable-lora --max-loras N: adapter slots per pod (0: LoRA off, a
    # request's model is the base model whatever it says). A request naming another
    # model than ``base_model`` names an adapter (any name: the adapters are taken as
    # registered on every pod, as with --lora-modules listing them all).
    max_loras: int = 0
    base_model: str = "sim-llama"
    # Model time to load an adapter into a slot (ace_extproc.sim.lora). None: the TTFT
    # model's ``adapter_load_ms``, what the router prices it at.
    lora_load_ms: float | None = None
    # Pods slower (or faster) than the TTFT model the router prices them by: pod i's
    # prefill and steps take ``pod_slowdown[i % len]`` times the model's (another GPU
    # generation in the pool, a throttled or shared host). Empty: as modelled.
    pod_slowdown: tuple[float, ...] = ()
    # The router's ``router.learn_pace``: learn each pod's pace from the TTFT it reports.
    learn_pace: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_gpu_blocks < 1:
            raise ValueError("block_size and num_gpu_blocks must be positive")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.tpot_ms is not None and self.tpot_ms <= 0:
            raise ValueError("tpot_ms must be positive (or None)")
        if self.scrape_interval_s <= 0:
            raise ValueError("scrape_interval_s must be positive")
        if self.access_log_s is not None and self.access_log_s < 0:
            raise ValueError("access_log_s must be >= 0 (or None)")
        if self.event_delay_s < 0:
            raise ValueError("event_delay_s must be >= 0")
        if self.kv_events and self.pooled_cache:
            raise ValueError("kv_events: a pooled cache is no pod's own (no events to publish)")
        if self.max_loras < 0 or not (self.lora_load_ms is None or self.lora_load_ms >= 0):
            raise ValueError("max_loras and lora_load_ms must not be negative")
        latency.get_model(self.ttft_model)  # raises on an unknown name
        if not all(0 < f < 1000 for f in self.pod_slowdown):
            raise ValueError("pod_slowdown: factors must be between 0 and 1000")

    def pod_model(self, slot: int) -> latency.TTFTModel:
        """The TTFT model pod ``slot`` really runs: the router's, its compute slowed by
        its ``pod_slowdown`` (the API server's share is the same)."""
        model = latency.get_model(self.ttft_model)
        if not self.pod_slowdown:
            return model
        f = self.pod_slowdown[slot % len(self.pod_slowdown)]
        return replace(
            model, a_ms=model.a_ms * f, b_ms=model.b_ms * f, t_step_ms=model.t_step_ms * f
        )


def for_workload(settings: SimSettings, workload: Workload) -> SimSettings:
    """The settings with the engine flags the workload is meant for: a workload of LoRA
    adapters runs on pods with --enable-lora --max-loras (its ``max_loras``) unless
    the settings set their own."""
    if workload.max_loras and not settings.max_loras:
        return replace(settings, max_loras=workload.max_loras)
    return settings


def cpu_vllm(num_gpu_blocks: int | None = None) -> SimSettings:
    """The real-engine tier's pods (``vllm_pods``: the CPU build and the tiny model): their
    block size, KV blocks, calibrated TTFT model and batch limit, the shape
    ``bench.live --engine vllm`` runs, for the simulation to predict it."""
    return SimSettings(
        block_size=vllm_pods.BLOCK_SIZE,
        num_gpu_blocks=num_gpu_blocks or vllm_pods.DEFAULT_KV_BLOCKS,
        ttft_model=vllm_pods.TTFT_MODEL,
        max_num_seqs=vllm_pods.MAX_NUM_SEQS,
    )
