"""bench.ceiling: the most any router could serve from cache, checked against the
simulated engine's own prefix cache."""

from __future__ import annotations

import msgspec

from ace_extproc.sim.kvcache import PrefixCache, prompt_keys
from bench.ceiling import BLOCK_TOKENS, ceiling, prompts_of
from bench.workloads.base import Request
from tests.test_bench_live import tiny_workload


def chat(*contents: str) -> Request:
    messages = [{"role": "user", "content": c} for c in contents]
    body = msgspec.json.encode({"model": "m", "messages": messages})
    return Request(0.0, "/v1/chat/completions", body, 4, "chat", "s")


def completion(prompt: object) -> Request:
    body = msgspec.json.encode({"model": "m", "prompt": prompt})
    return Request(0.0, "/v1/completions", body, 4, "text", "s")


def one_engine(requests: list[Request]) -> tuple[int, int]:
    """(prompt, cached) tokens when every request runs, one after another, on one
    simulated engine whose cache never fills."""
    cache = PrefixCache(BLOCK_TOKENS, num_gpu_blocks=1_000_000)
    for request in requests:
        for prompt in prompts_of(request):
            tokens, keys = prompt_keys(prompt, BLOCK_TOKENS)
            alloc = cache.allocate_keys(keys, tokens)
            assert alloc is not None
            cache.commit(alloc)
            cache.release(alloc)
    return cache.queries, cache.hits


def test_a_repeated_prompt_is_cached_but_its_last_token() -> None:
    text = "x" * 4 * 100  # 100 tokens of the sim's tokenizer
    first = ceiling([completion(text)])
    assert (first.prompt_tokens, first.cached_tokens) == (100, 0)
    both = ceiling([completion(text), completion(text)])
    assert both.cached_tokens == (100 - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # 96
    assert both.share == 96 / 200


def test_prompts_share_only_their_leading_blocks() -> None:
    a = "a" * 4 * 64
    ids = list(range(64))
    c = ceiling(
        [
            completion(a + "b" * 4 * 64),
            completion(a + "c" * 4 * 64),  # shares the first 64 tokens
            completion("c" * 4 * 64 + a),  # shares nothing: the head differs
            completion(ids),
            completion(ids[:32] + [7] * 32),  # token ids: the first two blocks
        ]
    )
    assert c.cached_tokens == 64 + 0 + 32


def test_equals_one_engine_that_never_evicts_on_a_real_workload() -> None:
    requests = tiny_workload(sessions=4, turns=4).requests
    c = ceiling(requests)
    prompt, cached = one_engine(requests)
    assert (c.prompt_tokens, c.cached_tokens) == (prompt, cached)
    assert 0.5 < c.share < 1.0  # the shared system prompt and each session's history


def test_chat_batches_and_token_lists_are_rendered_as_the_engine_sees_them() -> None:
    rendered = prompts_of(chat("hello"))
    assert len(rendered) == 1 and isinstance(rendered[0], bytes) and b"hello" in rendered[0]
    assert prompts_of(completion(["p", "q"])) == [b"p", b"q"]
    assert prompts_of(completion([[1, 2], [3]])) == [[1, 2], [3]]
