from collections import Counter

from ace_extproc.config import sim_fleet
from ace_extproc.prefix import PrefixHashes
from ace_extproc.routing import (
    BlockIndex,
    FleetState,
    PrefixAffinityPicker,
    RoutingRequest,
    rendezvous,
)


def test_longest_match_and_holders():
    idx = BlockIndex(100)
    for slot in range(3):
        idx.add_pod(slot)
    idx.record(0, [1, 2, 3])
    idx.record(1, [1, 2])
    idx.record(2, [9])
    assert idx.longest_match([1, 2, 3, 4], 0b111) == (3, 0b001)
    assert idx.longest_match([1, 2, 5], 0b111) == (2, 0b011)
    assert idx.longest_match([1, 2, 3], 0b110) == (2, 0b010)  # pod 0 not a candidate
    assert idx.longest_match([7], 0b111) == (0, 0)
    assert idx.longest_match([], 0b111) == (0, 0)


def test_lru_evicts_a_conversations_newest_blocks_first():
    idx = BlockIndex(4)
    idx.add_pod(0)
    idx.record(0, [1, 2, 3])  # head (1) is touched last, so it is the most recent
    idx.record(0, [10, 11])  # over capacity by one: the oldest is block 3, the tail
    assert idx.longest_match([1, 2, 3], 1) == (2, 1)
    assert idx.blocks_held(0) == 4
    idx.record(0, [1, 2])  # a hit refreshes the prefix ...
    idx.record(0, [20, 21])  # ... so the other conversation's tail goes first
    assert idx.longest_match([1, 2], 1) == (2, 1)
    assert idx.longest_match([10, 11], 1) == (0, 0)


def test_drop_pod_forgets_only_that_pod():
    idx = BlockIndex(10)
    idx.add_pod(0)
    idx.add_pod(1)
    idx.record(0, [1, 2])
    idx.record(1, [1])
    idx.drop_pod(0)
    assert idx.longest_match([1, 2], 0b11) == (1, 0b10)
    assert len(idx) == 1


def seeds(n, weight=1.0):
    return [(rendezvous.pod_seed(f"d/pod-{i}"), weight) for i in range(n)]


def test_rendezvous_spreads_evenly_and_moves_little_when_a_pod_joins():
    four, five = seeds(4), seeds(5)
    before = [rendezvous.best(k, four) for k in range(20000)]
    after = [rendezvous.best(k, five) for k in range(20000)]
    counts = Counter(before)
    assert all(4000 < counts[i] < 6000 for i in range(4))
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == 4 for _, a in moved)  # keys only move to the new pod
    assert 0.15 < len(moved) / 20000 < 0.25  # about 1/5 of them


def test_rendezvous_respects_weights_and_allowed_mask():
    w = [(rendezvous.pod_seed("a"), 3.0), (rendezvous.pod_seed("b"), 1.0)]
    counts = Counter(rendezvous.best(k, w) for k in range(20000))
    assert 0.70 < counts[0] / 20000 < 0.80
    assert {rendezvous.best(k, w, allowed=0b10) for k in range(100)} == {1}
    assert rendezvous.best(1, w, allowed=0) == -1
    order = rendezvous.rank(12345, w)
    assert order[0] == rendezvous.best(12345, w)


def hashes(blocks, key=None):
    h = PrefixHashes(list(blocks), f"{key if key is not None else blocks[0]:016x}", 0)
    return RoutingRequest(h, b"", len(blocks) * 128, "t", "m")


def test_affinity_picker_sticks_a_conversation_and_spreads_new_ones():
    fleet = FleetState(sim_fleet([f"127.0.0.1:{8001 + i}" for i in range(4)]))
    picker = PrefixAffinityPicker(fleet, BlockIndex(1000))
    everyone = fleet.available
    first = picker.pick(hashes([100, 101]), everyone)
    assert first is not None and first.action == "miss" and first.matched_blocks == 0
    later = picker.pick(hashes([100, 101, 102, 103]), everyone)
    assert later is not None and later.action == "hit" and later.matched_blocks == 2
    assert later.pod == first.pod
    pods = Counter(picker.pick(hashes([k * 1000]), everyone).slot for k in range(1, 2000))
    assert len(pods) == 4 and min(pods.values()) > 350
    # A pod that is not a candidate is never chosen, even if it holds the prefix.
    without = everyone & ~(1 << first.slot)
    moved = picker.pick(hashes([100, 101, 102]), without)
    assert moved is not None and moved.slot != first.slot and moved.action == "miss"
    assert picker.pick(hashes([1]), 0) is None


def test_match_depths_equal_a_linear_scan_of_an_exact_lru_model():
    """The binary search is exact as long as held blocks of a chain form a leading run;
    check it against a plain per-pod LRU scanned block by block, with evictions, shared
    prefixes, capacity changes and a dropped pod."""
    import random
    from collections import OrderedDict

    from ace_extproc.native import chain

    rng = random.Random(7)
    pods, capacity = 4, 60
    idx = BlockIndex(capacity)
    model: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(pods)]
    for slot in range(pods):
        idx.add_pod(slot)
    docs = [rng.randbytes(512 * rng.randint(1, 12)) for _ in range(12)]
    for step in range(3000):
        prompt = rng.choice(docs) + rng.randbytes(512 * rng.randint(0, 6))
        blocks = chain(prompt, 512, 1)
        want = {}
        for slot, lru in enumerate(model):
            depth = 0
            while depth < len(blocks) and blocks[depth] in lru:
                depth += 1
            if depth:
                want[slot] = depth
        assert idx.match_depths(blocks, (1 << pods) - 1) == want, step
        slot = rng.randrange(pods)
        idx.record(slot, blocks)
        for h in reversed(blocks):
            model[slot].pop(h, None)
            model[slot][h] = None
        while len(model[slot]) > idx.capacity_of(slot):
            model[slot].popitem(last=False)
        if step == 1000:
            idx.set_capacity(2, 25)
            while len(model[2]) > 25:
                model[2].popitem(last=False)
        if step == 2000:
            idx.drop_pod(1)
            idx.add_pod(1)
            model[1].clear()
    assert len(idx) == sum(len(lru) for lru in model)
