# TEMPORARY STUB (replaced by the helper's module on merge)
from __future__ import annotations

from dataclasses import dataclass

import msgspec

BlockHash = int | bytes


@dataclass(slots=True)
class Stored:
    hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora: str | None
    salt: str | None
    keyable: int


@dataclass(slots=True)
class Removed:
    hashes: list[BlockHash]
    medium: str


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None
    skipped: int


class WireError(ValueError):
    pass


END_SEQ = -1


def decode_batch(payload: bytes) -> Batch:
    try:
        doc = msgspec.msgpack.decode(payload)
    except Exception as exc:
        raise WireError(str(exc)) from None
    if not isinstance(doc, list) or len(doc) < 2 or not isinstance(doc[1], list):
        raise WireError("not a batch")
    out: list[Event] = []
    skipped = 0
    for e in doc[1]:
        if not isinstance(e, dict):
            skipped += 1
            continue
        t = e.get("type")
        if t == "BlockStored":
            ek = e.get("extra_keys") or [None]
            salt = None
            if e.get("parent_block_hash") is None and ek and ek[0]:
                salt = next((x for x in ek[0] if isinstance(x, str)), None)
            out.append(
                Stored(
                    e["block_hashes"],
                    e.get("parent_block_hash"),
                    e["token_ids"],
                    e["block_size"],
                    (e.get("medium") or "GPU").upper(),
                    e.get("lora_name"),
                    salt,
                    len(e["block_hashes"]),
                )
            )
        elif t == "BlockRemoved":
            out.append(Removed(e["block_hashes"], (e.get("medium") or "GPU").upper()))
        elif t == "AllBlocksCleared":
            out.append(Cleared())
        else:
            skipped += 1
    return Batch(float(doc[0]), out, doc[2] if len(doc) > 2 else None, skipped)


def decode_frames(frames: list[bytes]) -> tuple[int, Batch]:
    if len(frames) == 3:
        _, seq, payload = frames
    elif len(frames) == 2:
        seq, payload = frames
    else:
        raise WireError("frames")
    if len(seq) != 8:
        raise WireError("seq")
    return int.from_bytes(seq, "big", signed=True), decode_batch(payload)


def replay_request(start_seq: int) -> list[bytes]:
    return [b"", start_seq.to_bytes(8, "big")]


def decode_replay(frames: list[bytes]) -> tuple[int, Batch | None]:
    if len(frames) != 4:
        raise WireError("frames")
    _, _, seq, payload = frames
    s = int.from_bytes(seq, "big", signed=True)
    if s == END_SEQ:
        return END_SEQ, None
    return s, decode_batch(payload)
