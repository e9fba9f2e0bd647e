"""The simulated fleet's engine settings (one set for every pod)."""

from __future__ import annotations

from dataclasses import dataclass

from ace_extproc import latency


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
    pooled_cache: bool = False  # bound: all pods share ONE cache of pods x capacity
    unbounded_cache: bool = False  # bound: caches never evict (nor refuse admission)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_gpu_blocks < 1:
            raise ValueError("block_size and num_gpu_blocks must be positive")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.tpot_ms is not None and self.tpot_ms <= 0:
            raise ValueError("tpot_ms must be positive (or None)")
        if self.scrape_interval_s <= 0:
            raise ValueError("scrape_interval_s must be positive")
        latency.get_model(self.ttft_model)  # raises on an unknown name
