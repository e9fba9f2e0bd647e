"""The sim's block-level prefix cache, checked by hand on small numbers."""

from __future__ import annotations

from ace_extproc.sim.kvcache import Allocation, PrefixCache, block_hashes


def run(cache: PrefixCache, tokens: list[int], salt: str | None = None) -> Allocation:
    """One request start to finish: admit, prefill (commit), release."""
    alloc = cache.allocate(tokens, salt)
    assert alloc is not None
    cache.commit(alloc)
    cache.release(alloc)
    return alloc


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_miss_then_hit_of_full_blocks() -> None:
    cache = PrefixCache(block_size=16, num_gpu_blocks=64)
    prompt = seq(0, 40)  # 2 full blocks + an 8-token tail
    assert run(cache, prompt).cached_tokens == 0
    assert cache.cached_blocks == 2  # the tail is not cached
    assert cache.match(prompt) == 32
    assert cache.match([*prompt, 1, 2, 3]) == 32
    assert cache.match(prompt[:20] + [999] * 20) == 16  # diverges inside block 1
    assert cache.match([7, *prompt]) == 0  # shifted: no block matches
    assert run(cache, prompt).cached_tokens == 32
    assert (cache.queries, cache.hits) == (80, 32)


def test_a_fully_cached_prompt_recomputes_its_last_token() -> None:
    cache = PrefixCache(block_size=16, num_gpu_blocks=64)
    prompt = seq(0, 32)
    run(cache, prompt)
    assert cache.cached_blocks == 2
    assert cache.match(prompt) == 16  # (32 - 1) // 16 blocks
    assert cache.match([*prompt, 5]) == 32


def test_salt_isolates_every_block() -> None:
    cache = PrefixCache(block_size=4, num_gpu_blocks=64)
    prompt = seq(0, 20)
    run(cache, prompt, salt="tenant-a")
    assert cache.match(prompt, "tenant-a") == 16
    assert cache.match(prompt, "tenant-b") == 0
    assert cache.match(prompt) == 0
    a, b = block_hashes(prompt, 4, "tenant-a"), block_hashes(prompt, 4, "tenant-b")
    assert not set(a) & set(b)
    assert block_hashes(prompt, 4) == block_hashes(prompt, 4, None)


def test_partial_tail_is_never_cached() -> None:
    cache = PrefixCache(block_size=16, num_gpu_blocks=64)
    run(cache, seq(0, 15))
    assert cache.cached_blocks == 0
    assert cache.match(seq(0, 40)) == 0


def test_eviction_takes_leaves_first() -> None:
    cache = PrefixCache(block_size=2, num_gpu_blocks=4)
    a = seq(0, 5)  # 2 full blocks + tail: needs 3 blocks
    run(cache, a)
    assert cache.cached_blocks == 2
    run(cache, seq(100, 5))  # needs 3 blocks, 2 empty: evicts one of a's
    assert cache.evictions == 1
    assert cache.match(a) == 2  # a's root survived, its leaf went


def test_eviction_is_least_recently_used_first() -> None:
    cache = PrefixCache(block_size=2, num_gpu_blocks=6)
    a, b = [1, 2, 3], [4, 5, 6]  # one full block each, plus a tail
    run(cache, a)
    run(cache, b)
    run(cache, a)  # a is used again: b is now the least recent
    run(cache, seq(10, 9))  # 5 blocks: 4 empty, so one cached block must go
    assert cache.evictions == 1
    assert cache.match(a) == 2
    assert cache.match(b) == 0


def test_capacity_is_a_hard_bound_and_running_blocks_are_kept() -> None:
    cache = PrefixCache(block_size=4, num_gpu_blocks=8)
    held = cache.allocate(seq(0, 16))  # 4 blocks
    assert held is not None
    cache.commit(held)
    assert cache.allocate(seq(100, 20)) is None  # 5 > 4 free: nothing changes
    assert cache.usage == 0.5
    other = cache.allocate(seq(100, 16))
    assert other is not None
    assert cache.usage == 1.0
    assert cache.allocate([42]) is None
    cache.release(other)
    assert cache.match([*seq(0, 16), 0]) == 16  # the running request's blocks stayed
    cache.release(held)
    cache.release(held)  # idempotent
    assert cache.usage == 0.0
    assert cache.cached_blocks <= cache.num_gpu_blocks


def test_output_reservation_counts_against_capacity() -> None:
    cache = PrefixCache(block_size=4, num_gpu_blocks=4)
    assert cache.allocate(seq(0, 8), extra_tokens=9) is None  # 17 tokens: 5 blocks
    alloc = cache.allocate(seq(0, 8), extra_tokens=8)
    assert alloc is not None and alloc.anonymous == 4


def test_concurrent_identical_prompts_share_on_commit() -> None:
    cache = PrefixCache(block_size=4, num_gpu_blocks=16)
    prompt = seq(0, 10)
    first, second = cache.allocate(prompt), cache.allocate(prompt)
    assert first is not None and second is not None
    assert first.cached_tokens == second.cached_tokens == 0  # neither was computed yet
    cache.commit(first)
    cache.commit(second)
    assert cache.cached_blocks == 2
    assert cache.used_blocks == 2 + 2  # two shared full blocks + one tail each
    cache.release(first)
    cache.release(second)
    assert cache.used_blocks == 0
    assert cache.match(prompt) == 8


def test_reset_drops_only_unreferenced_blocks() -> None:
    cache = PrefixCache(block_size=4, num_gpu_blocks=16)
    run(cache, seq(0, 8))
    held = cache.allocate(seq(50, 8))
    assert held is not None
    cache.commit(held)
    assert cache.reset() == 2
    assert cache.match(seq(0, 9)) == 0
    assert cache.match(seq(50, 9)) == 8


# -- the key API: blocks keyed on UTF-8 text ----------------------------------------


def test_text_keys_give_the_token_api_hits() -> None:
    from random import Random

    from ace_extproc.sim.kvcache import text_block_keys, text_tokens
    from ace_extproc.sim.tokenizer import encode

    rng = Random(7)
    words = ["cache", "block", "prefix", "token", "pod", "a", "the", "router"]
    base = " ".join(rng.choice(words) for _ in range(200))
    texts = [base[:n] for n in (0, 1, 63, 64, 65, 200, 511, 512, 700)]
    texts += [base[:300] + "different ending " * 5, base + "!", "other " * 40]
    for salt in (None, "tenant-a"):
        by_tokens = PrefixCache(block_size=16, num_gpu_blocks=4096)
        by_text = PrefixCache(block_size=16, num_gpu_blocks=4096)
        for text in texts:
            tokens, data = encode(text), text.encode()
            assert text_tokens(data) == len(tokens)
            keys = text_block_keys(data, 16, salt)
            want = by_tokens.match(tokens, salt)
            assert by_text.match_keys(keys, len(tokens)) == want, text
            if tokens:
                assert run(by_tokens, tokens, salt).cached_tokens == want
                got = by_text.allocate_keys(keys, len(tokens))
                assert got is not None and got.cached_tokens == want
                by_text.commit(got)
                by_text.release(got)
        assert by_text.hits == by_tokens.hits > 0


def test_text_keys_chain_and_salt() -> None:
    from ace_extproc.sim.kvcache import prompt_keys, text_block_keys

    data = b"x" * 64 * 3 + b"tail"  # 3 full blocks and 1 more token
    keys = text_block_keys(data, 16)
    assert len(keys) == 3 and len(set(keys)) == 3  # same bytes, different place
    assert text_block_keys(data[:128], 16) == keys[:2]
    assert not set(text_block_keys(data, 16, "s")) & set(keys)
    assert text_block_keys(b"y" + data[1:], 16)[1] != keys[1]  # chained from block 0
    assert prompt_keys(data, 16) == (49, keys)  # 196 bytes
    assert prompt_keys([1, 2, 3], 2) == (3, block_hashes([1, 2, 3], 2))


def test_commit_in_chunks_indexes_blocks_as_they_are_computed() -> None:
    cache = PrefixCache(block_size=4, num_gpu_blocks=16)
    prompt = seq(0, 13)  # 3 full blocks
    alloc = cache.allocate(prompt)
    assert alloc is not None
    cache.commit(alloc, 1)
    assert cache.match(prompt) == 4
    cache.commit(alloc, 1)  # nothing new
    assert cache.cached_blocks == 1
    cache.commit(alloc)
    assert cache.match(prompt) == 12 and cache.cached_blocks == 3
    cache.release(alloc)
    assert cache.used_blocks == 0
