"""kv_wire: the engines' KV event frames decode field for field, and nothing crashes it.

* vLLM: batches and frames made by vLLM's own classes (``KVEventBatch``, ``BlockStored``
  with ``to_event_extra_keys``, a real ``ZmqEventPublisher`` with its replay ROUTER), in
  a subprocess of the ``make engines`` venv; skipped without it.
* SGLang cannot run here. Its messages are built from msgspec Structs that mirror its
  ``python/sglang/srt/disaggregation/kv_events.py`` field for field (0.5.23: tagged
  maps; older releases: tagged arrays). With ``ACE_SGLANG_KV_EVENTS`` pointing at an
  sglang wheel (``pip download sglang --no-deps``) or that file, and the engines venv
  for its imports (pydantic, msgspec, zmq), its own classes encode the same events and
  must give the same bytes as the mirrors.
* Hand-built msgpack for the other layouts and every kind of damage, and a hypothesis
  fuzz: only WireError ever escapes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc.routing.kv_wire import (
    END_SEQ,
    Batch,
    Cleared,
    Removed,
    Stored,
    WireError,
    decode_batch,
    decode_frames,
    decode_replay,
    replay_request,
)
from ace_extproc.vllm_pods import engines_dir

enc = msgspec.msgpack.encode


def engine_python() -> Path:
    python = engines_dir() / "venv" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no engines venv at {python} (make engines, or set ACE_ENGINES_DIR)")
    return python


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


def stored(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def one(event: Any) -> Batch:
    return decode_batch(enc([0.0, [event]]))


# --- vLLM, with its own classes --------------------------------------------------------

VLLM_SIDE = r"""
import json, os, sys, tempfile, time
import msgspec, zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)
from vllm.v1.core.kv_cache_utils import to_event_extra_keys

LORA = ("lora", "adapter-a", "/loras/a")

def stored(hashes, parent, tokens, bs, keys=None, **kw):
    kw.setdefault("lora_id", None)
    kw.setdefault("medium", "GPU")
    kw.setdefault("lora_name", None)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, extra_keys=to_event_extra_keys(keys), **kw)

# Extra keys tagged as BlockPool builds them; to_event_extra_keys untags them.
events = [
    stored([11, 12], None, list(range(8)), 4, [(LORA, ("cache_salt", "tenant-1")), (LORA,)],
           lora_id=3, lora_name="adapter-a", group_idx=0),
    stored([13], 12, [8, 9, 10, 11], 4, medium="cpu"),
    stored([b"\x01" * 32, b"\x02" * 32], b"\x00" * 32, list(range(8)), 4),
    stored([21, 22, 23], None, list(range(12)), 4, [None, (("mm", "img-hash", 2),), None]),
    stored([31], None, [1, 2, 3, 4], 4,
           [(("cache_salt", "s"), ("prompt_embeds", b"\x07" * 32))]),
    stored([41], None, [5, 6, 7, 8], 4, lora_id=7, medium=None),
    stored([51, 52], None, [1, 2, 3], 4),
    BlockRemoved(block_hashes=[11, 12], medium="GPU"),
    BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU", group_idx=1),
    AllBlocksCleared(),
]
encoder = msgspec.msgpack.Encoder()
out = {"payload": encoder.encode(
    KVEventBatch(ts=1234.5, events=events, data_parallel_rank=2)).hex()}

# The real publisher's frames, live and replayed.
d = tempfile.mkdtemp()
pub_ep, replay_ep = f"ipc://{d}/pub", f"ipc://{d}/replay"
publisher = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv@pod")
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB)
sub.connect(pub_ep)
sub.setsockopt(zmq.SUBSCRIBE, b"")
time.sleep(0.5)  # let the subscription reach the PUB
publisher.publish(KVEventBatch(ts=5.0, events=events[:2]))
publisher.publish(KVEventBatch(ts=6.0, events=events[7:]))
live = []
for _ in range(2):
    assert sub.poll(10000), "no live frames"
    live.append(sub.recv_multipart())
dealer = ctx.socket(zmq.DEALER)
dealer.connect(replay_ep)
dealer.send_multipart([bytes.fromhex(f) for f in json.loads(sys.argv[1])])
replay = []
while not replay or replay[-1][2:] != [(-1).to_bytes(8, "big", signed=True), b""]:
    assert dealer.poll(10000), "no replay"
    replay.append(dealer.recv_multipart())
publisher.shutdown()
out["live"] = [[f.hex() for f in m] for m in live]
out["replay"] = [[f.hex() for f in m] for m in replay]
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def vllm() -> dict[str, Any]:
    python = engine_python()
    request = json.dumps([f.hex() for f in replay_request(1)])
    proc = subprocess.run(
        [str(python), "-c", VLLM_SIDE, request],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_vllm_batch_every_field(vllm: dict[str, Any]) -> None:
    batch = decode_batch(bytes.fromhex(vllm["payload"]))
    assert batch.ts == 1234.5 and batch.dp_rank == 2
    assert batch.skipped == 1  # the event whose token ids do not fill its blocks
    salted, tail, raw, image, embeds, lora_id, removed, removed_cpu, cleared = batch.events
    assert salted == Stored(
        hashes=[11, 12],
        parent=None,
        token_ids=list(range(8)),
        block_size=4,
        medium="GPU",
        lora="adapter-a",
        salt="tenant-1",
        keyable=2,
    )
    assert tail == Stored([13], 12, [8, 9, 10, 11], 4, "CPU", None, None, 1)
    assert isinstance(raw, Stored) and raw.hashes == [b"\x01" * 32, b"\x02" * 32]
    assert raw.parent == b"\x00" * 32
    assert isinstance(image, Stored) and image.keyable == 1 and image.salt is None
    assert isinstance(embeds, Stored) and embeds.salt == "s" and embeds.keyable == 0
    assert isinstance(lora_id, Stored) and lora_id.lora == "7" and lora_id.medium == "GPU"
    assert removed == Removed([11, 12], "GPU")
    assert removed_cpu == Removed([b"\x01" * 32], "CPU")
    assert cleared == Cleared()


def test_vllm_publisher_frames_and_replay(vllm: dict[str, Any]) -> None:
    live = [decode_frames([bytes.fromhex(f) for f in m]) for m in vllm["live"]]
    assert [seq for seq, _ in live] == [0, 1]
    first, second = live[0][1], live[1][1]
    assert first.ts == 5.0 and first.dp_rank == 0  # the publisher stamps its rank
    assert [type(e) for e in first.events] == [Stored, Stored]
    assert [type(e) for e in second.events] == [Removed, Removed, Cleared]

    replies = [decode_replay([bytes.fromhex(f) for f in m]) for m in vllm["replay"]]
    assert replies[-1] == (END_SEQ, None)
    assert [seq for seq, _ in replies[:-1]] == [1]  # asked from seq 1
    replayed = replies[0][1]
    assert replayed is not None and replayed.events == second.events


# --- SGLang: mirrored classes, checked against its own when available -------------------


class SgStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    """SGLang 0.5.23 BlockStored (tagged map, optional fields omitted when None)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SgRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None


class SgCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


class SgBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[SgStored | SgRemoved | SgCleared]
    attn_dp_rank: int | None = None


class SgOldStored(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True):
    """SGLang before 0.5.x's switch to maps: tagged arrays, medium added later."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SgOldRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None


class SgOldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[SgOldStored | SgOldRemoved]
    attn_dp_rank: int | None = None


# (class name, kwargs) for each event, built by the mirrors here and by SGLang's classes.
SG_EVENTS: list[tuple[str, dict[str, Any]]] = [
    (
        "BlockStored",
        dict(
            block_hashes=[-5, 6],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            cache_salt="tenant-1",
            session_id="sess",
            lora_name="adapter-a",
        ),
    ),
    (
        "BlockStored",
        dict(
            block_hashes=[7],
            parent_block_hash=6,
            token_ids=[5, 6],
            block_size=2,
            lora_id=None,
            medium="CPU_PINNED",
            cache_salt="tenant-1",
        ),
    ),
    # An EAGLE bigram page: token "ids" are pairs.
    (
        "BlockStored",
        dict(
            block_hashes=[8],
            parent_block_hash=None,
            token_ids=[[1, 2], [2, 3]],
            block_size=2,
            lora_id=None,
            medium="GPU",
        ),
    ),
    ("BlockRemoved", dict(block_hashes=[6, 7], medium="DISK")),
    ("AllBlocksCleared", {}),
]
SG_MIRRORS = {"BlockStored": SgStored, "BlockRemoved": SgRemoved, "AllBlocksCleared": SgCleared}


def sg_mirror_payload() -> bytes:
    events = [SG_MIRRORS[name](**kw) for name, kw in SG_EVENTS]
    return enc(SgBatch(ts=3.5, events=events, attn_dp_rank=1))


def check_sglang_batch(batch: Batch) -> None:
    assert batch.ts == 3.5 and batch.dp_rank == 1
    assert batch.skipped == 1  # the bigram page
    first, second, removed, cleared = batch.events
    assert first == Stored([-5, 6], None, [1, 2, 3, 4], 2, "GPU", "adapter-a", "tenant-1", 2)
    # SGLang repeats the salt on every event of the sequence.
    assert second == Stored([7], 6, [5, 6], 2, "CPU_PINNED", None, "tenant-1", 1)
    assert removed == Removed([6, 7], "DISK")
    assert cleared == Cleared()


def test_sglang_mirrored_map_events() -> None:
    check_sglang_batch(decode_batch(sg_mirror_payload()))


def test_sglang_mirrored_older_array_events_and_replay() -> None:
    old = SgOldBatch(
        ts=2.0,
        events=[
            SgOldStored([1, 2], None, [1, 2, 3, 4], 2, lora_id=5),
            SgOldStored([3], 2, [5, 6], 2, lora_id=None, medium="GPU"),
            SgOldRemoved([1]),
        ],
    )
    payload = enc(old)
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really array-tagged
    batch = decode_batch(payload)
    assert batch.dp_rank is None and batch.skipped == 0
    assert batch.events == [
        Stored([1, 2], None, [1, 2, 3, 4], 2, "GPU", "5", None, 2),
        Stored([3], 2, [5, 6], 2, "GPU", None, None, 1),
        Removed([1], "GPU"),
    ]
    # Older SGLang replays without the topic frame.
    seq, replayed = decode_replay([b"", seq8(9), payload])
    assert seq == 9 and replayed == batch
    assert decode_replay([b"", seq8(-1), b""]) == (END_SEQ, None)


SGLANG_SIDE = r"""
import importlib.util, json, os, sys, tempfile, types, zipfile
import msgspec
src = sys.argv[1]
if src.endswith(".whl"):
    with zipfile.ZipFile(src) as z:
        code = z.read("sglang/srt/disaggregation/kv_events.py")
    src = os.path.join(tempfile.mkdtemp(), "kv_events.py")
    with open(src, "wb") as f:
        f.write(code)
# The module imports two sglang-internal helpers used only for endpoints and ranks.
for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
    sys.modules[name] = types.ModuleType(name)
runtime = types.ModuleType("sglang.srt.runtime_context")
runtime.get_parallel = None
network = types.ModuleType("sglang.srt.utils.network")
network.NetworkAddress = None
sys.modules["sglang.srt.runtime_context"] = runtime
sys.modules["sglang.srt.utils.network"] = network
spec = importlib.util.spec_from_file_location("sglang_kv_events", src)
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)
events = [getattr(kv, name)(**kw) for name, kw in json.loads(sys.argv[2])]
batch = kv.KVEventBatch(ts=3.5, events=events, attn_dp_rank=1)
print(msgspec.msgpack.Encoder().encode(batch).hex())
"""


def test_sglang_own_classes_match_mirrors() -> None:
    source = os.environ.get("ACE_SGLANG_KV_EVENTS")
    if not source or not Path(source).exists():
        pytest.skip("set ACE_SGLANG_KV_EVENTS to an sglang wheel or its kv_events.py")
    proc = subprocess.run(
        [str(engine_python()), "-c", SGLANG_SIDE, source, json.dumps(SG_EVENTS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = bytes.fromhex(proc.stdout.strip().splitlines()[-1])
    assert payload == sg_mirror_payload()
    check_sglang_batch(decode_batch(payload))


# --- hand-built layouts ---------------------------------------------------------------


def test_older_map_batch() -> None:
    batch = decode_batch(enc({"ts": 7, "events": [stored(), {"type": "AllBlocksCleared"}]}))
    assert batch.ts == 7.0 and batch.dp_rank is None and batch.skipped == 0
    assert [type(e) for e in batch.events] == [Stored, Cleared]
    ranked = decode_batch(enc({"ts": 1.0, "events": [], "data_parallel_rank": 3}))
    assert ranked.dp_rank == 3


def test_array_tagged_events_with_vllm_tail() -> None:
    event = ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "cpu", "ad", [["ad", "s"], ["ad"]]]
    batch = decode_batch(enc([1.0, [event, ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]], 0]))
    assert batch.skipped == 0
    assert batch.events == [
        Stored([1, 2], None, [1, 2, 3, 4], 2, "CPU", "ad", "s", 2),
        Removed([1], "GPU"),
        Cleared(),
    ]


def test_unknown_types_and_fields() -> None:
    batch = decode_batch(
        enc(
            [
                1.0,
                [
                    {"type": "BlockPinned", "block_hashes": [1]},
                    ["SomethingNew", 1, 2],
                    {"no_type": 1},
                    42,
                    stored(brand_new_field={"x": [1]}, group_idx=3),
                ],
                None,
                "a trailing field from a future version",
            ]
        )
    )
    assert batch.skipped == 4
    assert len(batch.events) == 1 and isinstance(batch.events[0], Stored)


def test_missing_optional_fields() -> None:
    minimal = stored(lora_id=..., medium=..., lora_name=...)
    assert set(minimal) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size"}
    (event,) = one(minimal).events
    assert event == Stored([1, 2], None, [1, 2, 3, 4], 2, "GPU", None, None, 2)
    (removed,) = one({"type": "BlockRemoved", "block_hashes": [9]}).events
    assert removed == Removed([9], "GPU")
    # A required field missing is a wrong shape: skipped.
    assert one(stored(token_ids=...)).skipped == 1


def test_extra_keys_bound_keyable_and_give_the_salt() -> None:
    def ev(keys: Any, parent: int | None = None, lora: str | None = None) -> Stored:
        hashes = [1, 2, 3]
        fields = stored(
            block_hashes=hashes,
            token_ids=list(range(6)),
            extra_keys=keys,
            parent_block_hash=parent,
            lora_name=lora,
        )
        (event,) = one(fields).events
        assert isinstance(event, Stored)
        return event

    mm = ev([["salt"], [["img", 0]], None])
    assert (mm.keyable, mm.salt) == (1, "salt")
    assert ev([[["img", 3]], None, None]).keyable == 0
    assert ev([None, None, [b"digest"]]).keyable == 2
    lora = ev([["ad", "salt"], ["ad"], ["ad"]], lora="ad")
    assert (lora.keyable, lora.salt, lora.lora) == (3, "salt", "ad")
    # A salt is only ever on a sequence's block 0: elsewhere it is an unknown key.
    assert ev([None, ["late"], None]).keyable == 1
    not_first = ev([["x"], None, None], parent=9)
    assert (not_first.keyable, not_first.salt) == (0, None)
    assert ev([None, 5, None]).keyable == 1  # an entry that is not a list


@pytest.mark.parametrize(
    "fields",
    [
        {"block_size": 0, "token_ids": []},
        {"block_size": -2},
        {"token_ids": [1, 2, 3]},
        {"token_ids": [1, 2, 3, "4"]},
        {"token_ids": [1, 2, 3, 4.0]},
        {"token_ids": [1, 2, 3, True]},
        {"token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]]},
        {"block_hashes": ["a", "b"]},
        {"block_hashes": None},
        {"parent_block_hash": "p"},
        {"extra_keys": [None]},
        {"extra_keys": "salt"},
        {"medium": 3},
    ],
)
def test_inconsistent_stored_is_skipped(fields: dict[str, Any]) -> None:
    batch = decode_batch(enc([1.0, [stored(**fields), {"type": "AllBlocksCleared"}]]))
    assert batch.skipped == 1 and batch.events == [Cleared()]


def test_nesting_inside_an_event() -> None:
    def payload(depth: int) -> bytes:
        return b"\x92\x01\x92" + b"\x91" * depth + b"\xc0" + enc({"type": "AllBlocksCleared"})

    batch = decode_batch(payload(200))  # a nested event: skipped
    assert batch.skipped == 1 and batch.events == [Cleared()]
    with pytest.raises(WireError):  # past msgspec's recursion limit: the frame is lost
        decode_batch(payload(100_000))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"garbage bytes \x00\xff",
        enc(5),
        enc("a string"),
        enc(None),
        enc([]),
        enc([1.0]),
        enc([1.0, "not events"]),
        enc(["ts", []]),
        enc({"ts": 1.0}),
        enc({"events": []}),
        enc([1.0, [], "rank"]),
        enc([1.0, [stored()]])[:-3],  # truncated
        b"\x91" * 1_000_000,
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4G elements
    ],
)
def test_not_a_batch(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)
    with pytest.raises(WireError):
        decode_frames([b"topic", seq8(1), payload])


def test_frames() -> None:
    payload = enc([1.0, [], 0])
    assert decode_frames([b"topic", seq8(7), payload])[0] == 7
    assert decode_frames([seq8(8), payload])[0] == 8
    for frames in ([], [payload], [b"t", seq8(1), payload, b"x"], [b""] * 5):
        with pytest.raises(WireError):
            decode_frames(frames)
    for seq in (b"\x00" * 7, b"\x00" * 9, b""):
        with pytest.raises(WireError):
            decode_frames([b"topic", seq, payload])
    with pytest.raises(WireError):
        decode_frames(None)  # type: ignore[arg-type]
    with pytest.raises(WireError):
        decode_frames([b"t", 5, payload])  # type: ignore[list-item]


def test_replay() -> None:
    assert replay_request(258) == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02"]
    payload = enc([2.0, [stored()], 0])
    seq, batch = decode_replay([b"", b"topic", seq8(4), payload])
    assert seq == 4 and batch is not None and len(batch.events) == 1
    assert decode_replay([b"", b"", seq8(END_SEQ), b""]) == (END_SEQ, None)
    for frames in (
        [],
        [b"", b"topic", seq8(4)][:2],
        [b"x", b"topic", seq8(4), payload],
        [b"", b"topic", seq8(4), payload, b""],
        [b"", b"topic", b"\x01", payload],
        [b"", b"topic", seq8(4), b"junk"],
    ):
        with pytest.raises(WireError):
            decode_replay(frames)


# --- fuzz -----------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
OBJECTS = st.recursive(
    SCALARS,
    lambda kids: (
        st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=6), kids, max_size=5)
    ),
    max_leaves=30,
)
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
FIELDS = st.sampled_from(
    [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "cache_salt",
    ]
)
EVENTS = (
    st.builds(lambda t, f: {"type": t, **f}, TAGS, st.dictionaries(FIELDS, OBJECTS, max_size=8))
    | st.builds(lambda t, rest: [t, *rest], TAGS, st.lists(OBJECTS, max_size=9))
    | st.builds(lambda f: stored(**f), st.dictionaries(FIELDS, OBJECTS, max_size=3))
    | OBJECTS
)


def check(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except WireError:
        return
    assert batch.skipped >= 0
    for event in batch.events:
        if isinstance(event, Stored):
            assert event.block_size > 0
            assert len(event.token_ids) == len(event.hashes) * event.block_size
            assert all(type(t) is int for t in event.token_ids)
            assert 0 <= event.keyable <= len(event.hashes)
            assert event.medium == event.medium.upper() and event.medium
        elif isinstance(event, Removed):
            assert all(type(h) in (int, bytes) for h in event.hashes)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_bytes(data: bytes) -> None:
    check(data)
    for frames in ([data], [b"t", data, data], [b"", b"t", data, data], [b"", data, data]):
        with contextlib.suppress(WireError):
            decode_frames(frames)
        with contextlib.suppress(WireError):
            decode_replay(frames)


@settings(max_examples=400, deadline=None)
@given(OBJECTS | st.tuples(OBJECTS, st.lists(EVENTS, max_size=6), OBJECTS).map(list))
def test_fuzz_msgpack(doc: Any) -> None:
    check(enc(doc))
    if isinstance(doc, list) and len(doc) == 3:
        check(enc({"ts": doc[0], "events": doc[1], "data_parallel_rank": doc[2]}))
