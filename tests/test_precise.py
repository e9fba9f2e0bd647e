"""The event-driven index (routing/precise.py): stores, removals, clears, tiers,
speculation and its expiry, tenants, bounds, and the block-size check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from ace_extproc.routing.kv_wire import Cleared, Removed, Stored
from ace_extproc.routing.precise import PreciseIndex
from ace_extproc.tokens import block_keys, chain_seed

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(
    hashes: list[int],
    ids: list[int],
    parent: int | None = None,
    *,
    salt: str | None = "s",
    medium: str = "GPU",
    keyable: int | None = None,
) -> Stored:
    return Stored(
        hashes,
        parent,
        ids,
        BS,
        medium,
        None,
        salt if parent is None else None,
        len(hashes) if keyable is None else keyable,
    )


IDS = list(range(1, 17))  # four blocks of four


def keys(ids: list[int] = IDS, salt: str | None = "s") -> list[int]:
    return block_keys(ids, BS, chain_seed(salt))


def live_index(*slots: int, clock: Clock | None = None) -> PreciseIndex:
    index = PreciseIndex(confirm_s=5.0, clock=clock or Clock())
    for slot in slots:
        index.add_pod(slot)
        index.set_live(slot, True)
    return index


def test_a_stored_chain_matches_a_request_with_the_same_tokens_and_salt() -> None:
    index = live_index(0, 1)
    index.apply(0, [stored([10, 11], IDS[:8]), stored([12], IDS[8:12], parent=11)])
    assert index.match(keys(), 0b11) == {0: (3, 3)}
    assert index.match(keys(salt="other"), 0b11) == {}  # another tenant's salt
    assert index.match(keys(salt=None), 0b11) == {}  # unsalted: nobody's


def test_a_block_whose_parent_was_never_seen_is_not_keyed() -> None:
    index = live_index(0)
    index.apply(0, [stored([12], IDS[8:12], parent=999)])
    assert index.match(keys(), 1) == {}
    assert index.pods[0].orphans == 1


def test_removal_and_clear() -> None:
    index = live_index(0)
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    index.apply(0, [Removed([12], "GPU")])
    assert index.match(keys(), 1) == {0: (2, 2)}  # the chain breaks at the removed block
    index.apply(0, [Cleared()])
    assert index.match(keys(), 1) == {} and index.blocks_held(0) == 0


def test_an_offloaded_block_is_held_but_not_warm() -> None:
    index = live_index(0)
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    index.apply(0, [stored([12, 13], IDS[8:], parent=11, medium="CPU"), Removed([12, 13], "GPU")])
    assert index.match(keys(), 1) == {0: (2, 4)}
    index.apply(0, [Removed([12, 13], "CPU")])
    assert index.match(keys(), 1) == {0: (2, 2)} and index.blocks_held(0) == 2


def test_speculation_is_confirmed_by_a_store_or_expires() -> None:
    clock = Clock()
    index = live_index(0, 1, clock=clock)
    index.speculate(1, keys())
    assert index.match(keys(), 0b11) == {1: (4, 4)}  # found at once, before any event
    index.apply(1, [stored([20, 21], IDS[:8])])  # the engine stored half of it
    clock.now += 10  # past confirm_s: the unconfirmed half expires
    assert index.match(keys(), 0b11) == {1: (2, 2)}
    assert index.confirmed == 2 and index.expired == 2


def test_a_block_sent_again_waits_once_from_its_latest_send() -> None:
    clock = Clock()
    index = live_index(0, clock=clock)
    for _ in range(50):  # the same prompt, again and again, none of it stored yet
        index.speculate(0, keys())
        clock.now += 0.1
    assert len(index._expiry) == len(keys())  # one entry a waiting block, not 50
    clock.now += 5.0 - 0.1 - 0.01  # past the first send's deadline, not the last's
    assert index.match(keys(), 1) == {0: (4, 4)} and index.expired == 0
    clock.now += 0.02
    assert index.match(keys(), 1) == {} and index.expired == 4


def test_only_live_pods_answer() -> None:
    index = live_index(0)
    index.apply(0, [stored([10], IDS[:4])])
    index.set_live(0, False)
    assert index.match(keys(), 1) == {}
    index.set_live(0, True)
    assert index.match(keys(), 1) == {0: (1, 1)}


def test_a_block_size_that_disagrees_with_the_engine_untrusts_the_pod() -> None:
    index = live_index(0)
    index.set_engine_cache(0, 16, 16 * 100)
    index.apply(0, [stored([10], IDS[:4])])  # events cut blocks of 4
    assert index.pods[0].mismatched and not index.live_mask
    index.set_live(0, True)  # a stream's refresh cannot trust it again
    assert not index.live_mask


def test_what_a_queued_pick_pushes_out_is_evicted_until_the_engine_stores_that_pick() -> None:
    """A pick pushing blocks out of a full pod's recency model dooms them: the engine
    will evict them when it admits that pick, behind its queue, before a removal can
    say so. Once it has stored the pick, its events are believed: another replica's
    hits may have kept the blocks warm, and say nothing."""
    index = live_index(0)
    index.set_engine_cache(0, BS, BS * 6)
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    other_ids = [i + 100 for i in IDS]
    index.speculate(0, keys(other_ids))  # eight blocks in a cache of six
    assert index.match(keys(), 1) == {0: (2, 2)}  # its tail pushed out by a queued pick
    assert len(index.pods[0].recent) == 6  # the recency model is bounded all the same
    index.apply(0, [stored([20, 21, 22], other_ids[:12])])
    assert index.match(keys(), 1) == {0: (2, 2)}  # the pick's last block not stored yet
    index.apply(0, [stored([23], other_ids[12:], parent=22)])  # the pick is in
    assert index.match(keys(), 1) == {0: (4, 4)}  # no removal came: still held
    index.apply(0, [Removed([13], "GPU")])  # the engine's own word
    assert index.match(keys(), 1) == {0: (3, 3)}


def test_a_doomed_block_sent_there_again_is_held_once_that_is_admitted() -> None:
    index = live_index(0)
    index.set_engine_cache(0, BS, BS * 7)
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    index.speculate(0, keys([i + 100 for i in IDS]))  # pushes out the tail block
    assert index.match(keys(), 1) == {0: (3, 3)}
    index.speculate(0, keys())  # the engine will compute it again for this one
    assert index.match(keys(), 1) == {0: (4, 4)}


def test_a_doomed_block_still_held_offloaded_counts_as_offloaded() -> None:
    index = live_index(0)
    index.set_engine_cache(0, BS, BS * 6)
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    index.apply(0, [stored([10, 11, 12, 13], IDS, medium="CPU")])
    index.speculate(0, keys([i + 100 for i in IDS]))
    assert index.match(keys(), 1) == {0: (2, 4)}


def test_events_alone_doom_nothing() -> None:
    """Blocks stored by the engine were admitted: whatever they evicted, its removal
    says so, so what they push out of the recency model is still believed held."""
    index = live_index(0)
    index.set_engine_cache(0, BS, BS * 6)
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    index.apply(0, [stored(list(range(20, 28)), [i + 100 for i in IDS])])
    assert index.match(keys(), 1) == {0: (4, 4)}


def test_a_lost_removal_ages_out_with_the_least_recently_used() -> None:
    index = live_index(0)
    index.set_engine_cache(0, BS, BS * 2)  # the map is trimmed past twice this
    index.apply(0, [stored([10, 11, 12, 13], IDS)])
    index.apply(0, [stored([20], [i + 100 for i in IDS[:4]])])
    # Kept: the chain's head (touched last) and the newest block; the rest forgotten.
    assert index.match(keys(), 1) == {0: (1, 1)}
    assert index.match(block_keys([i + 100 for i in IDS[:4]], BS, chain_seed("s")), 1) == {
        0: (1, 1)
    }


def test_events_for_a_pod_that_left_change_nothing() -> None:
    index = live_index(0)
    index.drop_pod(0)
    index.apply(0, [stored([10], IDS[:4])])
    assert index.blocks_held(0) == 0 and index.match(keys(), 1) == {}


def test_an_unkeyable_block_ends_the_chain() -> None:
    index = live_index(0)
    index.apply(0, [stored([10, 11, 12], IDS[:12], keyable=1)])
    assert index.match(keys(), 1) == {0: (1, 1)}


def test_a_destination_without_a_tokenizer_is_approximate_and_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ace_extproc.app import build
    from ace_extproc.config import Config, Settings, sim_fleet

    app = build(Config(sim_fleet(["127.0.0.1:1"]), Settings(probe_interval_s=0)))
    assert app.kv_events is None and app.processor.precise is None
    assert "tokenizer" not in caplog.text


def test_a_tokenizer_that_fails_to_load_leaves_its_destination_approximate(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from dataclasses import replace

    from ace_extproc.app import build
    from ace_extproc.config import Config, Fleet, Settings, sim_fleet

    fleet = sim_fleet(["127.0.0.1:1"])
    broken = replace(fleet.destinations[0], tokenizer=str(tmp_path / "nowhere"))
    app = build(Config(Fleet((broken,)), Settings(probe_interval_s=0)))
    assert app.kv_events is None and app.processor.precise is None
    assert "routed approximately" in caplog.text and "nowhere" in caplog.text
    text = generate_latest(app.telemetry.registry).decode()
    assert 'ace_tokenizer_loaded{destination="sim"} 0.0' in text


def test_sglang_pages_one_event_each_and_a_partial_last_page_is_ignored() -> None:
    index = live_index(0)
    # SGLang: one event a page, the salt on every one of them.
    index.apply(0, [stored([10], IDS[:4])])
    index.apply(0, [Stored([11], 10, IDS[4:8], BS, "GPU", None, "s", 1)])
    index.apply(0, [Stored([12], 11, IDS[8:10], 2, "GPU", None, "s", 1)])  # a partial page
    assert index.match(keys(), 1) == {0: (2, 2)} and index.pods[0].block_size == BS


class TwoPods:
    """A fleet of two pods through the production processor: pod 0 publishes events
    (live), pod 1 does not."""

    def __init__(self) -> None:
        from dataclasses import replace

        from ace_extproc.app import build
        from ace_extproc.config import Config, Fleet, Settings, sim_fleet

        base = sim_fleet(["127.0.0.1:1", "127.0.0.1:2"])
        fleet = Fleet((replace(base.destinations[0], tokenizer="sim"),))
        self.app = build(Config(fleet, Settings(salt_secret=b"k", probe_interval_s=0)))
        precise = self.app.processor.precise
        assert precise is not None
        self.precise = precise
        self.index = precise.index
        self.index.set_live(0, True)
        self.salt = self.app.processor.tenants.salt("anon")

    @staticmethod
    def body(topic: str) -> bytes:
        import msgspec

        messages = [
            {"role": "system", "content": f"{topic} " * 300},
            {"role": "user", "content": "?"},
        ]
        return msgspec.json.encode({"model": "sim-llama", "messages": messages})

    def send(self, topic: str) -> tuple[str, str]:
        head = {
            ":path": "/v1/chat/completions",
            ":method": "POST",
            "content-type": "application/json",
        }
        processor = self.app.processor
        outcome = processor.on_body(processor.on_headers(head, False), self.body(topic))
        assert outcome.pod is not None
        return outcome.pod.id, outcome.action

    def place_elsewhere(self, topic: str, hash_base: int = 1) -> None:
        """What another gateway placed on pod 0: its events; the router never saw it."""
        from ace_extproc.sim.tokens import SimTokens

        ids = SimTokens().token_ids("/v1/chat/completions", self.body(topic))
        assert ids is not None
        n = len(ids) // 16
        hashes = list(range(hash_base, hash_base + n))
        self.index.apply(0, [Stored(hashes, None, ids[: n * 16], 16, "GPU", None, self.salt, n)])

    def metrics(self) -> str:
        return generate_latest(self.app.telemetry.registry).decode()


def test_one_fleet_routes_event_pods_by_their_events_and_the_rest_approximately() -> None:
    """Two pods, one publishing (live) and one not: a prompt the publishing pod's events
    say it holds goes there though the router never sent it; a prompt the router sent
    to the other pod follows the approximate index there."""
    pods = TwoPods()
    pods.place_elsewhere("elsewhere")
    assert pods.send("elsewhere") == ("pod-0", "hit")
    # Pod 1 publishes nothing: a prompt first sent there is found by the approximate index.
    for i in range(8):
        pod, _ = pods.send(f"own-{i}")
        if pod == "pod-1":
            assert pods.send(f"own-{i}") == ("pod-1", "hit")
            break
    else:
        raise AssertionError("no new prompt was placed on pod 1")


def test_how_far_the_guess_is_from_the_events_is_counted() -> None:
    """The approximate index's guess against the events, for each keyed request: blocks
    another gateway placed are the events' alone (the guess would have steered
    elsewhere); blocks the engine evicted are the guess's alone; a prompt the router
    sent and the engine still holds is the same on both sides."""
    pods = TwoPods()
    precise = pods.precise

    def counts() -> tuple[int, int, float, float]:
        p = precise
        return p.guess_agreed, p.guess_differed, p.guess_only_blocks, p.events_only_blocks

    pods.place_elsewhere("elsewhere")
    assert pods.send("elsewhere") == ("pod-0", "hit")
    agreed, differed, guess_only, events_only = counts()
    assert (agreed, differed, guess_only) == (0, 1, 0.0) and events_only >= 3  # of ~6
    # The router's own pick, now in both (speculatively in the events' index).
    assert pods.send("elsewhere") == ("pod-0", "hit")
    assert counts()[:2] == (1, 1)
    # The engine evicts it: the guess still holds it, the events do not.
    pods.index.apply(0, [Cleared()])
    pods.send("elsewhere")
    agreed, differed, guess_only, _ = counts()
    assert (agreed, differed) == (1, 2) and guess_only >= 3
    text = pods.metrics()
    assert 'ace_precise_guess_picks_total{agreement="differs"} 2.0' in text
    assert 'ace_precise_guess_blocks_total{side="events_only"}' in text


def test_an_adapters_request_finds_its_adapters_blocks_and_no_others() -> None:
    """An engine keys an adapter's blocks by it and its events name it: the request's
    precise keys are seeded by the adapter it names, so it finds that adapter's blocks,
    not the base model's or another adapter's of the same text."""
    from dataclasses import replace

    import msgspec

    from ace_extproc.app import build
    from ace_extproc.config import Config, Fleet, Settings, sim_fleet
    from ace_extproc.sim.tokens import SimTokens

    base = sim_fleet(["127.0.0.1:1", "127.0.0.1:2"])
    fleet = Fleet((replace(base.destinations[0], tokenizer="sim"),))
    app = build(Config(fleet, Settings(salt_secret=b"k", probe_interval_s=0)))
    precise = app.processor.precise
    assert precise is not None
    for slot in (0, 1):  # both run LoRA (their scrapes said so) and publish events
        app.fleet.load[slot].lora.scraped("sim-llama", 4, ())
        precise.index.set_live(slot, True)
    salt = app.processor.tenants.salt("anon")
    messages = [{"role": "system", "content": "manual " * 300}, {"role": "user", "content": "?"}]
    ids = SimTokens().token_ids("/v1/chat/completions", msgspec.json.encode({"messages": messages}))
    assert ids is not None
    n = len(ids) // 16
    # The same text's blocks, under adapter "sql" on pod 0 and the base model on pod 1.
    for slot, lora in ((0, "sql"), (1, None)):
        hashes = list(range(100 * slot + 1, 100 * slot + n + 1))
        precise.index.apply(slot, [Stored(hashes, None, ids[: n * 16], 16, "GPU", lora, salt, n)])
    head = {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json"}

    def send(model: str) -> tuple[str, str]:
        body = msgspec.json.encode({"model": model, "messages": messages})
        outcome = app.processor.on_body(app.processor.on_headers(head, False), body)
        assert outcome.pod is not None
        return outcome.pod.id, outcome.action

    assert send("sql") == ("pod-0", "hit")
    assert send("sim-llama") == ("pod-1", "hit")
    assert send("chat")[1] == "miss"  # another adapter: nobody holds its blocks


def test_a_document_tokenized_aside_is_speculated_on_the_pod_it_went_to(
    tmp_path: Path,
) -> None:
    """The first request for a long new document is routed approximately while its ids
    are computed on a worker thread. Once they are, its pick is speculated on the pod
    it went to, so the next request for the document, sent before the engine reports
    it (a long prefill takes seconds), finds it there instead of missing on another
    pod (as on real vLLM pods, before)."""
    import asyncio

    app = _two_live_pods_with_a_model_tokenizer(tmp_path)
    assert app.processor.precise is not None
    tokenizer = app.processor.precise.tokenizers["sim"]
    document = "A long document about routing requests to warm pods. " * 400  # 22 KB

    def send() -> tuple[str, str]:
        return _send(app, document)

    async def go() -> tuple[tuple[str, str], tuple[str, str]]:
        first = send()
        for _ in range(500):
            await asyncio.sleep(0.01)
            if not tokenizer._pending:  # type: ignore[attr-defined]
                break
        return first, send()

    (pod, action), again = asyncio.run(go())
    assert action == "miss" and getattr(tokenizer, "deferred", 0) == 1
    assert again == (pod, "hit")


def test_a_tokenizer_that_raises_routes_the_request_approximately_and_says_so(
    tmp_path: Path,
) -> None:
    from tests.test_tokens import _Raising

    app = _two_live_pods_with_a_model_tokenizer(tmp_path)
    assert app.processor.precise is not None
    tokenizer = app.processor.precise.tokenizers["sim"]
    tokenizer._tokenizer = _Raising(tokenizer._tokenizer, inline=True)  # type: ignore[attr-defined]
    pod, action = _send(app, "a short question")
    assert pod in ("pod-0", "pod-1") and action == "miss"  # routed, by the guess
    text = generate_latest(app.telemetry.registry).decode()
    assert 'ace_tokenizer_failures_total{destination="sim"} 1.0' in text
    assert 'ace_precise_requests_total{result="unkeyed"} 1.0' in text


def _two_live_pods_with_a_model_tokenizer(tmp_path: Path) -> Any:
    """An app whose two pods' events are live, keyed by a model directory's tokenizer."""
    from dataclasses import replace

    from ace_extproc.app import build
    from ace_extproc.config import Config, Fleet, Settings, sim_fleet
    from tests.model_files import write_model_files

    model = write_model_files(tmp_path, corpus_bytes=200_000)
    base = sim_fleet(["127.0.0.1:1", "127.0.0.1:2"])
    fleet = Fleet((replace(base.destinations[0], tokenizer=str(model)),))
    app = build(Config(fleet, Settings(salt_secret=b"k", probe_interval_s=0)))
    precise = app.processor.precise
    assert precise is not None
    for slot in (0, 1):
        precise.index.set_engine_cache(slot, 16, None)
        precise.index.set_live(slot, True)
    return app


def _send(app: Any, content: str) -> tuple[str, str]:
    """One chat request through the processor: the pod it went to, and why."""
    import msgspec

    body = msgspec.json.encode(
        {"model": "sim-llama", "messages": [{"role": "user", "content": content}]}
    )
    head = {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json"}
    processor = app.processor
    outcome = processor.on_body(processor.on_headers(head, False), body)
    assert outcome.pod is not None
    return outcome.pod.id, outcome.action
