"""The C block LRU (``_lru.c``) against the index's Python reference.

Its contract: a ``BlockLRU`` holds the same hashes in the same recency order as the
reference dict after any sequence of the index's operations, and ``record``, ``evict``
and ``match`` on it leave the roots and return the depths that the reference's
``record``, ``evict`` and ``match`` (``native/lru.py``) do on the dict; a ``BlockIndex``
on C structures
answers every query as one on the Python ones.
"""

from __future__ import annotations

import random
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc.native import chain
from ace_extproc.native.lru import evict as evict_pure
from ace_extproc.native.lru import match as match_pure
from ace_extproc.native.lru import record as record_pure
from ace_extproc.routing.index import BlockIndex
from tests.conftest import load_speedups

speedups = load_speedups()
BlockLRU = speedups.BlockLRU

hashes = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))


def test_holds_hashes_oldest_first_and_a_repeat_moves_to_the_end() -> None:
    lru = BlockLRU([5, 2**64 - 1, 7, 5])
    assert list(lru) == [2**64 - 1, 7, 5]
    assert len(lru) == 3 and bool(lru)
    assert 7 in lru and 2**64 - 1 in lru
    assert 8 not in lru
    assert not BlockLRU() and list(BlockLRU()) == []


def test_what_is_not_a_hash_is_not_held_and_cannot_be_added() -> None:
    lru = BlockLRU([1])
    for other in (-1, 2**64, 1.0, "1", None):
        assert other not in lru
    for bad, error in (([-1], OverflowError), ([2**64], OverflowError), (["a"], TypeError)):
        with pytest.raises(error):
            BlockLRU(bad)
    with pytest.raises(TypeError):
        BlockLRU(5)
    with pytest.raises(TypeError):
        BlockLRU([1], [2])
    with pytest.raises(TypeError):
        BlockLRU(hashes=[1])


def test_iterating_takes_a_snapshot() -> None:
    lru = BlockLRU(range(10))
    roots: dict[int, int] = {}
    it = iter(lru)
    speedups.evict(lru, roots, 1, 5)
    assert list(it) == list(range(10))
    assert list(lru) == list(range(5, 10))


def test_its_size_counts_its_arrays_and_not_a_python_object_a_block() -> None:
    small, large = BlockLRU(range(10)), BlockLRU(range(100_000))
    per_block = (sys.getsizeof(large) - sys.getsizeof(small)) / (100_000 - 10)
    # 16 bytes an entry (grown by half), 4 a table slot (under 0.7 full): at most ~39.
    assert 16 <= per_block <= 40


@settings(max_examples=300, deadline=None)
@given(
    held=st.lists(hashes, max_size=30, unique=True),
    touched=st.lists(hashes, max_size=30),
    roots=st.dictionaries(hashes, st.integers(1, 2**70)),
    slot=st.sampled_from([0, 3, 63, 64, 100]),
    capacity=st.integers(-2, 50),
)
def test_record_leaves_the_lru_and_roots_as_the_pure_loop(
    held: list[int], touched: list[int], roots: dict[int, int], slot: int, capacity: int
) -> None:
    # Held blocks, some touched again (moved to the end, the first touched last), some
    # new; repeats within one prompt too. The capacity may be under what is held: the
    # oldest go, and roots they were lose the pod.
    touched = touched + held[::3]
    native, pure = BlockLRU(held), dict.fromkeys(held)
    native_roots, pure_roots = dict(roots), dict(roots)
    assert speedups.record(native, touched, native_roots, 1 << slot, capacity) is None
    record_pure(pure, touched, pure_roots, 1 << slot, capacity)
    assert list(native) == list(pure)
    assert native_roots == pure_roots


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(hashes, max_size=30, unique=True),
    touched=st.lists(hashes, max_size=30),
    roots=st.dictionaries(hashes, st.integers(1, 2**70)),
    capacity=st.integers(-2, 50),
)
def test_a_uint64_array_records_as_the_list_of_its_ints(
    held: list[int], touched: list[int], roots: dict[int, int], capacity: int
) -> None:
    """Another replica's placement decodes to an ``array("Q")``, read in place."""
    touched = touched + held[::3]
    from_list, list_roots = BlockLRU(held), dict(roots)
    speedups.record(from_list, touched, list_roots, 1 << 5, capacity)
    packed = array("Q", touched)
    for blocks in (packed, memoryview(packed.tobytes()).cast("Q")):
        lru, lru_roots = BlockLRU(held), dict(roots)
        assert speedups.record(lru, blocks, lru_roots, 1 << 5, capacity) is None
        assert list(lru) == list(from_list)
        assert lru_roots == list_roots
        assert all(type(h) is int for h in lru_roots)


def test_arrays_of_other_items_are_read_as_sequences_of_ints() -> None:
    for blocks in (array("I", [3, 4]), array("q", [3, 4]), array("B", [3, 4])):
        lru, roots = BlockLRU([9]), {}
        speedups.record(lru, blocks, roots, 2, 10)
        assert list(lru) == [9, 4, 3] and roots == {3: 2}
    with pytest.raises(OverflowError):  # a negative hash is no hash
        speedups.record(BlockLRU(), array("q", [-1]), {}, 2, 10)


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(hashes, max_size=40, unique=True),
    roots=st.dictionaries(hashes, st.integers(1, 2**70)),
    bit=st.sampled_from([1, 8, 1 << 64, 1 << 100]),
    count=st.integers(-1, 45),
)
def test_evict_forgets_the_oldest_as_the_pure_loop(
    held: list[int], roots: dict[int, int], bit: int, count: int
) -> None:
    roots.update(dict.fromkeys(held[::2], bit | 2))  # some held blocks are roots
    native, pure = BlockLRU(held), dict.fromkeys(held)
    native_roots, pure_roots = dict(roots), dict(roots)
    speedups.evict(native, native_roots, bit, count)
    evict_pure(pure, pure_roots, bit, max(count, 0))
    assert list(native) == list(pure)
    assert native_roots == pure_roots


def test_a_long_run_of_records_keeps_the_order_of_the_pure_lru() -> None:
    """Thousands of prompts from a small pool of hashes: the table grows, entries are
    freed and reused, deletions shift probe runs back (wrapping the table's end); after
    every record the order and the roots equal the reference's."""
    rng = random.Random(11)
    pool = [rng.getrandbits(64) for _ in range(3000)] + list(range(200))
    native, pure = BlockLRU(), {}
    native_roots: dict[int, int] = {}
    pure_roots: dict[int, int] = {}
    for step in range(4000):
        blocks = rng.sample(pool, rng.randint(1, 40))
        capacity = rng.choice([50, 400, 2000, 5000])
        speedups.record(native, blocks, native_roots, 4, capacity)
        record_pure(pure, blocks, pure_roots, 4, capacity)
        assert len(native) == len(pure), step
        if step % 97 == 0:
            assert list(native) == list(pure), step
            assert native_roots == pure_roots, step
    assert list(native) == list(pure)
    assert all(h in native for h in pure)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 70),
    slots=st.sets(st.sampled_from([0, 1, 5, 63, 64, 65, 127, 128, 300]), min_size=1),
)
def test_match_finds_each_holders_run_as_the_pure_search(
    data: st.DataObject, n: int, slots: set[int]
) -> None:
    # Each holder holds a leading run of the chain (1..n blocks) and unrelated blocks;
    # some also hold a few later blocks past a gap, which the chain rules out for a real
    # index but both searches must read alike.
    blocks = [b * 2**40 + 7 for b in range(n)]
    native: dict[int, object] = {}
    pure: dict[int, dict[int, None]] = {}
    for slot in slots:
        run = data.draw(st.integers(1, n), label=f"run {slot}")
        held = blocks[:run] + data.draw(st.lists(st.sampled_from(blocks), max_size=3))
        held.append(2**63 + slot)
        native[slot], pure[slot] = BlockLRU(held), dict.fromkeys(held)
    holders = sum(1 << slot for slot in slots)
    assert speedups.match(native, blocks, holders) == match_pure(pure, blocks, holders)


def test_match_of_a_holder_without_an_lru_or_a_bad_argument_raises() -> None:
    with pytest.raises(KeyError):
        speedups.match({0: BlockLRU([1])}, [1], 0b10)
    with pytest.raises(KeyError):
        speedups.match({}, [1], 1 << 100)
    with pytest.raises(ValueError):
        speedups.match({}, [1], -1)
    for args in (
        ([], [1], 1),
        ({}, 5, 1),
        ({}, [1], 1.0),
        ({0: [1]}, [1], 1),
        ({0: {1: None}}, [1], 1),  # the reference's dict is not the C path's LRU
        ({0: BlockLRU([1])}, ["1"], 1),
        ({}, [1]),
    ):
        with pytest.raises(TypeError):
            speedups.match(*args)
    with pytest.raises(OverflowError):
        speedups.match({0: BlockLRU([1])}, [-1], 1)
    assert speedups.match({}, [], 0b1) == {}  # no blocks: nothing held


def test_record_and_evict_reject_what_is_not_an_lru_of_blocks() -> None:
    lru = BlockLRU()
    for args in (
        ({}, [1], {}, 1, 10),
        (lru, 5, {}, 1, 10),
        (lru, [1], [], 1, 10),
        (lru, [1], {}, 1.0, 10),
        (lru, [1], {}, 1, "10"),
        (lru, ["a"], {}, 1, 10),
        (lru, [1], {}, 1),
    ):
        with pytest.raises(TypeError):
            speedups.record(*args)
    with pytest.raises(OverflowError):
        speedups.record(lru, [2**64], {}, 1, 10)
    for args in (({}, {}, 1, 1), (lru, [], 1, 1), (lru, {}, "1", 1), (lru, {}, 1, 1.0)):
        with pytest.raises(TypeError):
            speedups.evict(*args)


def test_an_index_on_c_structures_answers_as_one_on_the_python_ones() -> None:
    """Real chained prompts over 70 pods (bitmasks past a machine word): records, match
    depths, rooms, capacities lowered and raised, pods dropped and re-added."""
    rng = random.Random(3)
    pods = 70
    native, pure = BlockIndex(40), BlockIndex(40, pure=True)
    for index in (native, pure):
        for slot in range(pods):
            index.add_pod(slot)
    docs = [rng.randbytes(512 * rng.randint(1, 10)) for _ in range(20)]
    everyone = (1 << pods) - 1
    for step in range(3000):
        blocks = chain(rng.choice(docs) + rng.randbytes(512 * rng.randint(0, 5)), 512, 9)
        assert native.match_depths(blocks, everyone) == pure.match_depths(blocks, everyone)
        assert native.longest_match(blocks, everyone) == pure.longest_match(blocks, everyone)
        slot = rng.randrange(pods)
        native.record(slot, blocks)
        pure.record(slot, blocks)
        event = rng.random()
        if event < 0.02:
            capacity = rng.randint(1, 60)
            native.set_capacity(slot, capacity)
            pure.set_capacity(slot, capacity)
        elif event < 0.03:
            native.drop_pod(slot)
            pure.drop_pod(slot)
            native.add_pod(slot)
            pure.add_pod(slot)
        assert native.room(slot) == pure.room(slot), step
        assert native.blocks_held(slot) == pure.blocks_held(slot), step
    assert len(native) == len(pure)
    assert native._roots == pure._roots
    for slot in range(pods):
        assert list(native._lru[slot]) == list(pure._lru[slot])
    # The C structures are the smaller: no int object a block.
    assert native.approx_bytes() < pure.approx_bytes()
