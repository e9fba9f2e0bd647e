# The C fast path (_speedups.c, _answer.c, _price.c, _lru.c, _pick.c, _headers.c);
# request.py, prefix.py, processor.py, server.py, routing/index.py,
# routing/pipeline.py and mutate.py hold the reference in Python.
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import final

from ace_extproc.routing.fleet import PodLoad
from ace_extproc.routing.index import RoomView
from ace_extproc.routing.pipeline import PriceParams

def chat_prompt(body: bytes, /) -> tuple[str, bytes, int, bool, bool, bool] | None: ...
def completion_prompt(body: bytes, /) -> tuple[str, bytes, None, bool, bool, bool] | None: ...
def header_map(data: bytes, /) -> dict[str, str]: ...
def chain(data: bytes, block_bytes: int, seed: int, /) -> list[int]: ...
def prefix_hashes(
    prompt: bytes, cacheable_end: int | None, block_bytes: int, seed: int, /
) -> tuple[list[int], str]: ...

@final
class BlockLRU:
    def __new__(cls, hashes: Iterable[int] = ..., /) -> BlockLRU: ...
    def __len__(self) -> int: ...
    def __contains__(self, h: object, /) -> bool: ...
    def __iter__(self) -> Iterator[int]: ...

def match(
    lrus: Mapping[int, BlockLRU], blocks: Sequence[int], holders: int, /
) -> dict[int, int]: ...
def record(
    lru: BlockLRU, blocks: Sequence[int], roots: dict[int, int], bit: int, capacity: int, /
) -> None: ...
def evict(lru: BlockLRU, roots: dict[int, int], bit: int, count: int, /) -> None: ...
def price(
    slots: tuple[int, ...],
    depths: Mapping[int, int],
    rooms: RoomView,
    load: list[PodLoad],
    n: int,
    tokens: int,
    params: PriceParams,
    keep: int,
    /,
) -> tuple[int, int, tuple[int, ...]]: ...
def pick(
    blocks: list[int],
    slots: tuple[int, ...],
    rooms: RoomView,
    roots: dict[int, int],
    load: list[PodLoad],
    seeds: list[tuple[int, float]],
    params: PriceParams,
    fallbacks: int,
    max_kv_usage: float,
    tokens: int,
    route_key: int,
    home: int,
    min_match: float,
    steer: bool,
    /,
) -> tuple[int, int, str, tuple[int, ...]]: ...
def outcome_answer(outcome: object, client_upstream: bool, /) -> bytes: ...  # an Outcome
def splice(body: bytes, fields: str, /) -> bytes: ...
def body_answer(
    headers: Sequence[tuple[str, bytes]],
    remove: Sequence[str],
    clear_route_cache: bool,
    body: bytes | None,
    namespaces: Sequence[tuple[str, Sequence[tuple[str, str | float]]]],
    /,
) -> bytes: ...
