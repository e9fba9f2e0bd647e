"""The ``prompt`` piece (``ace_extproc.native._speedups``) against its Python reference.

Its contract: ``chain`` equals ``native.hashing.chain`` exactly, and for ANY bytes
``chat_prompt`` returns either None (the pure path decides) or exactly the fields
``request.parse_pure`` returns, never accepting what the pure path rejects; so does
``completion_prompt`` for /v1/completions bodies. Both must also accept the plain
shape (for chat: text messages, tool definitions, tool calls), or the fast path is
never taken. (The block LRU's functions: ``test_lru.py``.)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tracemalloc
from array import array
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ace_extproc import request
from ace_extproc.native.hashing import chain as chain_pure
from ace_extproc.native.hashing import prefix_hashes as prefix_hashes_pure
from ace_extproc.request import CHAT_PATH, COMPLETIONS_PATH, RequestError, parse_pure
from tests.conftest import load_speedups

speedups = load_speedups()

Fields = tuple[str, bytes, int, bool, bool, bool]
CompletionFields = tuple[str, bytes, None, bool, bool, bool]


def _pure(path: str, body: bytes) -> Any:
    """``parse_pure``'s fields, or None where it rejects the body."""
    try:
        p = parse_pure(path, body)
    except RequestError:
        return None
    return (p.model, p.prompt, p.cacheable_end, p.has_router_fields, p.stream, p.stream_options)


def pure_fields(body: bytes) -> Fields | None:
    fields: Fields | None = _pure(CHAT_PATH, body)
    return fields


def pure_completion_fields(body: bytes) -> CompletionFields | None:
    fields: CompletionFields | None = _pure(COMPLETIONS_PATH, body)
    return fields


def _agrees(native: Any, path: str, body: bytes) -> Any:
    """Assert the invariant: ``native`` is None or exactly the pure path's fields."""
    if native is not None:
        expected = _pure(path, body)
        assert native == expected, body
        # == says True == 1; the types must match too.
        assert [type(x) for x in native] == [type(x) for x in expected], body
    return native


def check(body: bytes) -> Fields | None:
    """Assert the invariant for a chat body; returns the native result."""
    native: Fields | None = _agrees(speedups.chat_prompt(body), CHAT_PATH, body)
    return native


def check_completion(body: bytes) -> CompletionFields | None:
    """``check`` for ``completion_prompt``."""
    native: CompletionFields | None = _agrees(
        speedups.completion_prompt(body), COMPLETIONS_PATH, body
    )
    return native


def body(*messages: dict[str, Any], **top: Any) -> bytes:
    return json.dumps({"messages": list(messages), **top}).encode()


M = b'"messages":[{"role":"user","content":"x"}]'


def _in_content(raw: bytes) -> bytes:
    return b'{"messages":[{"role":"user","content":"' + raw + b'"}]}'


def _top(key: bytes, value: bytes) -> bytes:
    return b'{"' + key + b'":' + value + b"," + M + b"}"


# ---------------------------------------------------------------------------- chain

BLOCK_SIZES = (1, 7, 64, 512, 4096)
SEEDS = (0, 1, 2**63, 2**64 - 1, random.Random(7).getrandbits(64))


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s:x}")
def test_chain_equals_pure(block: int, seed: int) -> None:
    rng = random.Random(block * 31 + seed)
    # Empty, shorter than a block, exact multiples, a multiple plus one (an unhashed tail).
    for n in sorted({0, max(block - 1, 0), block, 3 * block, 3 * block + 1, 5000}):
        data = rng.randbytes(n)
        native = speedups.chain(data, block, seed)
        assert type(native) is list
        assert native == chain_pure(data, block, seed)
        assert len(native) == n // block


def test_chain_of_less_than_a_block_is_empty() -> None:
    assert speedups.chain(b"", 512, 1) == []
    assert speedups.chain(b"x" * 511, 512, 1) == []
    assert speedups.chain(b"x" * 512, 513, 1) == []


@pytest.mark.parametrize("block", [0, -1, -512])
def test_chain_rejects_nonpositive_block_size(block: int) -> None:
    with pytest.raises(ValueError):
        speedups.chain(b"abc", block, 0)


def test_chain_takes_any_buffer_but_not_text() -> None:
    data = random.Random(3).randbytes(1000)
    for buf in (bytearray(data), memoryview(data)):
        assert speedups.chain(buf, 64, 5) == chain_pure(data, 64, 5)
    with pytest.raises(TypeError):
        speedups.chain("abc", 1, 0)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=3000),
    block=st.integers(1, 700),
    seed=st.integers(0, 2**64 - 1),
)
def test_chain_property(data: bytes, block: int, seed: int) -> None:
    assert speedups.chain(data, block, seed) == chain_pure(data, block, seed)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=3000),
    block=st.integers(1, 700),
    seed=st.integers(0, 2**64 - 1),
    end=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_prefix_hashes_property(data: bytes, block: int, seed: int, end: float | None) -> None:
    """The blocks and the prefix key (the chain at the prefix's last full block,
    extended by its partial tail) exactly as the reference gives them."""
    cacheable_end = None if end is None else int(len(data) * end)
    blocks, key = speedups.prefix_hashes(data, cacheable_end, block, seed)
    assert (blocks, key) == prefix_hashes_pure(data, cacheable_end, block, seed)
    assert blocks == chain_pure(data, block, seed) and len(key) == 16


@pytest.mark.parametrize("end", [-1, 11, 2**70])
def test_prefix_hashes_refuse_an_end_outside_the_prompt(end: int) -> None:
    for prefix_hashes in (speedups.prefix_hashes, prefix_hashes_pure):
        with pytest.raises((IndexError, OverflowError)):
            prefix_hashes(b"0123456789", end, 4, 1)
    with pytest.raises(TypeError):
        speedups.prefix_hashes(bytearray(b"ab"), None, 1, 0)  # the parser's bytes only
    with pytest.raises(ValueError):
        speedups.prefix_hashes(b"ab", None, 0, 0)


# ------------------------------------------------------- chat_prompt: the plain shape

U = {"role": "user", "content": "hi"}

# Bodies of the plain shape, written out byte for byte: the native path must take them.
PLAIN: list[tuple[str, bytes]] = [
    ("minimal", b'{"messages":[{"role":"user","content":"hi"}]}'),
    ("model_system_user", body({"role": "system", "content": "Be terse."}, U, model="m")),
    (
        "unicode_raw",
        json.dumps(
            {"model": "m\u00e9", "messages": [{"role": "user", "content": "é 日本語 😀 \x7f"}]},
            ensure_ascii=False,
        ).encode(),
    ),
    (
        "unicode_escaped",
        b'{"messages":[{"role":"user","content":"\\u00e9 \\u65e5\\u672c\\u8a9e \\ud83d\\ude00'
        b' \\uD83D\\uDE00 \\u0000 \\uffff \\udbff\\udfff"}]}',
    ),
    (
        "every_escape",
        b'{"model":"a\\/b","messages":[{"role":"us\\u0065r",'
        b'"content":"q\\"b\\\\s\\/f\\bb\\ff\\nn\\rr\\tt\\u001f\\u007f"}]}',
    ),
    (
        "whitespace_everywhere",
        b' \t\r\n{ \t"messages" \r: \n[ \t{ "role" : "user" ,\r\n"content"\t:\t"x" } ,'
        b'{"role":"assistant","content":null}\n] , "model" :"m" ,"stream" : true ,'
        b'"x" : [ 1 , { "a" : null } , [ ] , { } ] \n}\r\n\t ',
    ),
    (
        "key_order_varied",
        b'{"stream":false,"model":"m","messages":[{"content":"c","name":"n","role":"user"},'
        b'{"tool_call_id":"t","content":"r","role":"tool"}],"cache_salt":"s"}',
    ),
    (
        "unknown_top_level_keys",
        b'{"temperature":0.7,"max_tokens":12E+2,"n":-1,"z":0,"nz":-0,"y":1.5e-3,"w":-0.0e0,'
        b'"big":18446744073709551616,"huge":1e308,"tiny":5e-324,"long":1' + b"0" * 300 + b","
        b'"meta":{"a":[1,{"b":null}],"c":true,"d":false,"e":"\\ud83d\\ude00\\n"},"t":true,'
        b'"f":false,"nil":null,"s":"}]\\"{[","":"empty key","arr":[[[[]]]],'
        b'"messages":[{"role":"user","content":"x"}],"after":{"k":"v"}}',
    ),
    (
        "number_forms",
        b'{"a":[1e01,0e0,-0.0E+00,1E-0,1e-05,123456789012345678901234567890],'
        # In the fields msgspec decodes, exponents are left to it (range checks).
        b'"cache_salt":[0,-0.0,-12.5,123456789012345678901234567890],'
        b'"stream_options":{"n":1,"m":-12.5},"messages":[{"role":"user","x":-0}]}',
    ),
    (
        "utf8_boundaries",  # the first and last code point of each UTF-8 length
        b'{"messages":[{"role":"user","content":"\xc2\x80\xdf\xbf\xe0\xa0\x80\xed\x9f\xbf'
        b'\xee\x80\x80\xef\xbf\xbf","name":"\xf0\x90\x80\x80\xf4\x8f\xbf\xbf"}]}',
    ),
    (
        "near_miss_keys",  # prefixes / extensions of known keys are unknown keys
        b'{"models":1,"model_":2,"mode":3,"message":4,"messages_":5,"streams":6,'
        b'"stream_option":7,"stream_options_x":8,"cache_salts":9,"cache_prefix":10,"tool":11,'
        b'"toolsx":12,"messages":[{"rol":1,"roles":2,"role":"user","contents":3,"conten":4,'
        b'"content":"x","names":5,"tool_call":6,"tool_call_ids":7,"tool_callss":8}]}',
    ),
    (
        "unknown_message_keys",
        body(
            {
                "role": "user",
                "extra": {"k": [1, 2.5, {"z": "w"}], "n": None},
                "content": "x",
                "weight": 0,
                "flag": True,
                "list": [],
            }
        ),
    ),
    ("content_null", body({"role": "system", "content": None}, {"role": "assistant"}, U)),
    ("content_empty", body({"role": "user", "content": ""}, {"role": "system", "content": ""})),
    ("name_set", body({"role": "user", "name": "alice", "content": "x"})),
    ("name_empty", body({"role": "user", "name": "", "content": "x"})),
    ("name_null", body({"role": "user", "name": None, "content": "x"})),
    (
        "tool_call_id",
        body(
            {"role": "assistant", "content": None, "tool_calls": None},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "", "content": "e"},
            {"role": "tool", "tool_call_id": None, "content": "n"},
            U,
        ),
    ),
    (
        "several_user_messages",
        body(
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "four"},
        ),
    ),
    ("no_user_message", body({"role": "system", "content": "only"}, {"role": "assistant"})),
    ("model_missing", body(U)),
    ("model_escaped", b'{"model":"m\\u00e9\\/x\\"y","messages":[{"role":"user","content":"x"}]}'),
    ("model_empty", body(U, model="")),
    ("stream_true", body(U, stream=True)),
    ("stream_false", body(U, stream=False)),
    ("stream_options_null", body(U, stream=True, stream_options=None)),
    ("stream_options_object", body(U, stream=True, stream_options={"include_usage": True})),
    ("stream_options_scalar", body(U, stream_options=[1, "a", {"b": [None]}])),
    ("cache_salt", body(U, cache_salt="s")),
    ("cache_salt_null", body(U, cache_salt=None)),
    ("cache_prefix_id", body(U, cache_prefix_id={"nested": [1, 2]})),
    ("tools_null", body(U, tools=None)),
    ("tools_empty", body(U, tools=[])),
    ("tools_list", body(U, tools=[{"type": "function", "function": {"name": "f"}}])),
    ("tools_after_messages", b'{"messages":[{"role":"user"}],"tools":[{"a":1}]}'),
    (
        "tools_several_nested",
        body(
            {"role": "system", "content": "sys"},
            U,
            model="m",
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather in a city.",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "units": {"type": "string", "enum": ["c", "f"]},
                                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                            },
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                        "strict": True,
                    },
                },
                {"type": "function", "function": {"name": "noop", "parameters": {}}},
                {"type": "custom", "custom": {"name": "x", "format": None, "n": [[], [{}]]}},
            ],
        ),
    ),
    (
        # The raw bytes of each element: whitespace inside one is kept, around it is not.
        "tools_whitespace",
        b'{ "tools" :\r\n[ \t{ "type" : "function" ,\n "function":{ "name":"f" , "p" : [ 1 ,2 ] } }'
        b' ,\t[ 1 , 2 ] , "s p" , 1.5e3,-0 , null ,true,false , { } , [ ] ,{"a":{"b":[{}]}}\r\n] ,'
        b' "messages" : [ { "role" : "user" , "content" : "x" } ] }',
    ),
    (
        "tools_escapes",  # kept as written, not unescaped
        b'{"tools":[{"name":"q\\"b\\\\s\\/f\\bb\\ff\\nn\\rr\\tt\\u0000\\u001f",'
        b'"e":"\\ud83d\\ude00 \\uD83D\\uDE00 \\u00e9 \\uffff"},"\\"]}\\\\",'
        b'"[{\\u0022"],"messages":[{"role":"user","content":"x"}]}',
    ),
    (
        "tools_unicode",
        json.dumps(
            {
                "tools": [{"name": "天気", "d": "é 😀 \x7f", "é": ["日本語"]}, "\u00e9\U0001f600"],
                "messages": [U],
            },
            ensure_ascii=False,
        ).encode(),
    ),
    (
        "tools_scalars",
        b'{"tools":[1],"messages":[{"role":"user"}]}',
    ),
    (
        "tools_number_forms",  # skipped numbers: any valid form, kept as written
        b'{"tools":[0,-0,1e01,0e0,-0.0E+00,1E-0,1e-05,123456789012345678901234567890,'
        b"1e308,5e-324,-1.7976931348623157e308," + b"1" + b"0" * 300 + b"],"
        b'"messages":[{"role":"user"}]}',
    ),
    (
        "tools_with_all_top_keys",
        b'{"stream":true,"tools":[{"a":1}],"model":"m","cache_salt":"s","stream_options":{},'
        b'"cache_prefix_id":null,"x":[1],"messages":[{"role":"user","content":"x"}]}',
    ),
    (
        "tool_calls",
        body(
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
            },
            U,
        ),
    ),
    ("tool_calls_empty", body({"role": "assistant", "tool_calls": []}, U)),
    (
        "tool_calls_several",
        body(
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    },
                    {"id": None, "type": "", "function": {"name": "", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
            {"role": "user", "content": "thanks"},
        ),
    ),
    (
        "tool_calls_unknown_keys",
        body(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "x": {"deep": [1, 2.5e-3, None, {"k": "v"}]},
                        "function": {"extra": [True, {}], "arguments": "a", "name": "n", "z": 0},
                        "index": 0,
                        "id": None,
                        "type": "function",
                        "": "",
                    }
                ],
                "content": None,
            },
            U,
        ),
    ),
    (
        "tool_calls_defaults",  # name and arguments default to ""
        body(
            {
                "role": "assistant",
                "tool_calls": [
                    {"function": {}},
                    {"function": {"name": "only_name"}},
                    {"function": {"arguments": "only_args"}},
                    {"function": {"name": "", "arguments": ""}, "type": "function"},
                ],
            },
        ),
    ),
    (
        "tool_calls_escapes",
        b'{"messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f\\u00e9\\/g",'
        b'"arguments":"{\\"city\\": \\"Par\\u00eds\\", \\"n\\": \\"a\\\\nb\\\\u0041\\"}'
        b'\\n\\t\\ud83d\\ude00\\u0000"},"id":"\\u0063","type":"f\\u0075nction"}]},'
        b'{"role":"user","content":"x"}]}',
    ),
    (
        "tool_calls_unicode",
        json.dumps(
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "识别", "function": {"name": "天気", "arguments": "😀 é"}}
                        ],
                    }
                ]
            },
            ensure_ascii=False,
        ).encode(),
    ),
    (
        "tool_calls_whitespace",
        b'{"messages":[ { "role" : "assistant" , "tool_calls" : [ { "function" : { "name" :'
        b' "f" , "arguments" : "{ }" } , "id" : null } ,\n\t{ "function":{ } } ] } ,'
        b' {"role":"user"} ] }',
    ),
    (
        "tool_calls_every_message_field",  # name, content, tool calls, tool_call_id: that order
        b'{"messages":[{"tool_call_id":"t","tool_calls":[{"function":{"name":"f",'
        b'"arguments":"a"}}],"content":"c","name":"n","role":"user"},'
        b'{"role":"assistant","tool_calls":null,"content":"d"}]}',
    ),
    ("roles_any_string", body({"role": "", "content": "a"}, {"role": "dév", "content": "b"})),
    ("large_content", body({"role": "user", "content": "x\u00e9\n" * 40_000})),
    (
        "many_messages",
        body(*({"role": ("user", "assistant")[i % 2], "content": str(i)} for i in range(2000))),
    ),
]


@pytest.mark.parametrize("data", [b for _, b in PLAIN], ids=[i for i, _ in PLAIN])
def test_plain_bodies_take_the_native_path(data: bytes) -> None:
    assert pure_fields(data) is not None  # the case itself is valid
    assert check(data) is not None


def test_native_cacheable_end_is_where_the_newest_user_turn_starts() -> None:
    data = body(
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "name": "u", "content": "three"},
        {"role": "assistant", "content": "four"},
    )
    native = speedups.chat_prompt(data)
    assert native is not None
    _, prompt, end, *_ = native
    assert prompt[:end] == b"\x1esystem\x1fsys\x1euser\x1fone\x1eassistant\x1ftwo"
    assert prompt[end:] == b"\x1euser\x1fu\x1fthree\x1eassistant\x1ffour"
    # No user turn: all of it is the prefix.
    only = speedups.chat_prompt(body({"role": "system", "content": "s"}))
    assert only is not None and only[2] == len(only[1]) == len(b"\x1esystem\x1fs")


def test_native_fields() -> None:
    native = speedups.chat_prompt(
        b'{"model":"m\\u00e9","stream":true,"stream_options":null,"cache_salt":null,'
        b'"messages":[{"role":"user","content":"a\\"\\ud83d\\ude00"}]}'
    )
    assert native == ("mé", '\x1euser\x1fa"😀'.encode(), 0, True, True, True)
    assert speedups.chat_prompt(body(U)) == ("", b"\x1euser\x1fhi", 0, False, False, False)


def test_native_tools_and_tool_calls() -> None:
    data = (
        b'{"messages":[{"role":"assistant","content":"c","tool_calls":[{"function":'
        b'{"name":"f","arguments":"{\\"a\\": 1}"},"id":"i","type":"function"},{"function":{}}],'
        b'"tool_call_id":"t"},{"role":"user","content":"q"}],"tools":[ {"a" : [1]} ,2 ]}'
    )
    head = b'\x1dtools\x1f{"a" : [1]}\x1f2\x1eassistant\x1fc\x1df\x1f{"a": 1}\x1d\x1f\x1dt'
    assert check(data) == ("", head + b"\x1euser\x1fq", len(head), False, False, False)
    # Empty or null tools and tool calls add nothing.
    for empty in (b"[]", b"null", b" [ ] "):
        data = b'{"tools":' + empty + b',"messages":[{"role":"a","tool_calls":' + empty + b"}]}"
        assert check(data) == ("", b"\x1ea\x1f", 3, False, False, False)


# ------------------------------------------------ chat_prompt: what it may leave to pure

# Either answer is right here (None, or the pure one): duplicates, escaped keys, empty
# lists, and values the pure path skips without validating.
EITHER: list[tuple[str, bytes]] = [
    ("dup_model", b'{"model":"a","messages":[{"role":"user","content":"x"}],"model":"b"}'),
    ("dup_stream", b'{"stream":true,"messages":[{"role":"user","content":"x"}],"stream":false}'),
    (
        "dup_messages",
        b'{"messages":[{"role":"user","content":"a"}],"messages":[{"role":"system","content":"b"}]}',
    ),
    ("dup_role", b'{"messages":[{"role":"user","content":"x","role":"system"}]}'),
    ("dup_content", b'{"messages":[{"role":"user","content":"x","content":null}]}'),
    ("dup_name", b'{"messages":[{"role":"user","name":"a","content":"x","name":""}]}'),
    ("dup_cache_salt", b'{"cache_salt":1,"cache_salt":null,"messages":[{"role":"user"}]}'),
    ("dup_unknown", b'{"x":1,"x":[2],"messages":[{"role":"user","y":1,"y":2}]}'),
    # msgspec matches keys after unescaping them.
    ("escaped_key_model", b'{"mod\\u0065l":"m","messages":[{"role":"user","content":"x"}]}'),
    ("escaped_key_messages", b'{"\\u006dessages":[{"role":"user","content":"x"}]}'),
    ("escaped_key_role", b'{"messages":[{"r\\u006fle":"user","content":"x"}]}'),
    ("escaped_key_content", b'{"messages":[{"role":"user","c\\u006fntent":"x"}]}'),
    ("escaped_key_stream", b'{"stre\\u0061m":true,"messages":[{"role":"user"}]}'),
    ("escaped_key_salt", b'{"cache\\u005fsalt":null,"messages":[{"role":"user"}]}'),
    ("escaped_key_tools", b'{"t\\u006fols":[{"a":1}],"messages":[{"role":"user"}]}'),
    ("escaped_key_slash", b'{"m\\/odel":"m","messages":[{"role":"user"}]}'),
    ("content_list_empty", body({"role": "user", "content": []})),
    # Text parts: each part's text, then a field separator.
    ("content_list_text", body({"role": "user", "content": [{"type": "text", "text": "hi"}]})),
    (
        "content_list_texts",
        body(
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"text": ""}]},
            {"role": "user", "content": [{"text": "\u00e9", "type": "text", "x": [1, {}]}]},
            tools=[{"type": "function"}],
        ),
    ),
    (
        "content_list_dup_text",
        b'{"messages":[{"role":"user","content":[{"text":"a","text":"b"}]}]}',
    ),
    ("content_list_text_null", b'{"messages":[{"role":"user","content":[{"text":null}]}]}'),
    ("content_list_text_number", b'{"messages":[{"role":"user","content":[{"text":1}]}]}'),
    ("content_list_empty_part", b'{"messages":[{"role":"user","content":[{}]}]}'),
    (
        "content_list_part_exponent",
        b'{"messages":[{"role":"user","content":[{"text":"a","n":1e5}]}]}',
    ),
    (
        "content_list_escaped_text_key",
        b'{"messages":[{"role":"user","content":[{"t\\u0065xt":"a"}]}]}',
    ),
    (
        "content_list_part_deep",
        b'{"messages":[{"role":"user","content":[{"text":"a","x":'
        + b"[" * 100
        + b"]" * 100
        + b"}]}]}",
    ),
    ("dup_tools", b'{"tools":[1],"messages":[{"role":"user"}],"tools":[{"a":2}]}'),
    ("dup_tools_then_null", b'{"tools":[1],"messages":[{"role":"user"}],"tools":null}'),
    (
        "dup_tool_calls",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{}}],"tool_calls":[]}]}',
    ),
    (
        "dup_function",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":"f"},"function":{}}]}]}',
    ),
    (
        "dup_function_name",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":"f","name":"g"}}]}]}',
    ),
    (
        "dup_call_id",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"id":"a","id":null}]}]}',
    ),
    ("escaped_key_tool_calls", b'{"messages":[{"role":"a","tool\\u005fcalls":[{"function":{}}]}]}'),
    (
        "escaped_key_function",
        b'{"messages":[{"role":"a","tool_calls":[{"functio\\u006e":{"name":"f"}}]}]}',
    ),
    (
        "escaped_key_name",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"n\\u0061me":"f"}}]}]}',
    ),
    (
        "escaped_key_arguments",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"\\u0061rguments":"{}"}}]}]}',
    ),
    (
        "escaped_key_id",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"\\u0069d":"c"}]}]}',
    ),
    # A key written with escapes, even inside a skipped or raw value.
    ("escaped_key_in_tool", b'{"tools":[{"n\\u0061me":"f"}],"messages":[{"role":"user"}]}'),
    ("escaped_key_in_unknown", b'{"x":[{"\\u0061":1}],"messages":[{"role":"user"}]}'),
    # Tool definitions are kept raw: msgspec checks their syntax, not their numbers' range
    # nor their strings' UTF-8.
    ("tools_number_overflow", b'{"tools":[1e999,[-1e400]],"messages":[{"role":"user"}]}'),
    ("tools_long_integer", b'{"tools":[1' + b"0" * 5000 + b'],"messages":[{"role":"user"}]}'),
    ("tools_bad_utf8", b'{"tools":["\xff",{"\xc0\x80":1}],"messages":[{"role":"user"}]}'),
    (
        "tool_call_unknown_bad_utf8",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"x":"\xff"},"y":"\xed\xa0\x80"}]}]}',
    ),
    (
        "tool_call_unknown_number_overflow",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"x":1e999},"y":-1e999}]}]}',
    ),
    # The pure path skips unknown values without checking their UTF-8.
    ("unknown_value_bad_utf8", b'{"x":"\xff\xc0\x80","messages":[{"role":"user"}]}'),
    ("unknown_key_bad_utf8", b'{"\xff":1,"messages":[{"role":"user","\xed\xa0\x80":2}]}'),
    # Values msgspec decodes (not skips) that are still in range.
    ("salt_400_digit_integer", _top(b"cache_salt", b"1" + b"0" * 400)),
    ("salt_max_double", _top(b"cache_salt", b"-1.7976931348623157e308")),
    ("salt_tiny_double", _top(b"cache_salt", b"[1e-400, 0." + b"0" * 500 + b"1]")),
    (
        "stream_options_uint64",
        _top(b"stream_options", b"[18446744073709551616, -9223372036854775809]"),
    ),
    (
        "salt_in_range_edges",
        _top(b"cache_salt", b"[1e-99999, 0e99999, -0.0e999, 0.0" + b"0" * 400 + b"1e400]"),
    ),
    ("salt_4300_char_integer", _top(b"cache_salt", b"-1" + b"0" * 4298)),
    ("unknown_deep_ok", b'{"x":' + b"[" * 200 + b"]" * 200 + b',"messages":[{"role":"user"}]}'),
]


@pytest.mark.parametrize("data", [b for _, b in EITHER], ids=[i for i, _ in EITHER])
def test_native_agrees_or_declines(data: bytes) -> None:
    assert pure_fields(data) is not None  # all of these are valid
    check(data)


# Text parts (and an empty list) are the native path's: it must take them.
TEXT_PARTS = {
    "content_list_empty",
    "content_list_text",
    "content_list_texts",
    "content_list_dup_text",
}


@pytest.mark.parametrize(
    "data", [b for i, b in EITHER if i in TEXT_PARTS], ids=[i for i, _ in EITHER if i in TEXT_PARTS]
)
def test_text_parts_take_the_native_path(data: bytes) -> None:
    assert check(data) is not None


def test_text_parts_are_written_text_then_field() -> None:
    data = body({"role": "user", "content": [{"type": "text", "text": "a\nb"}, {"text": "c"}]})
    native = speedups.chat_prompt(data)
    assert native is not None
    assert native[1] == b"\x1euser\x1fa\nb\x1fc\x1f"


# The pure path handles these, the native one must not: the fallback matters.
# (Non-text content parts: msgspec's sorted JSON encoding of the part.)
IMAGE = {"type": "image_url", "image_url": {"url": "data:,x", "detail": "low"}}
UNSUPPORTED: list[tuple[str, bytes]] = [
    ("content_list_image", body({"role": "user", "content": [IMAGE]})),
    (
        "content_list_late",
        body(U, U, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
    ),
    (
        "content_list_text_then_image",
        body({"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}),
    ),
    (
        "content_list_with_tools",
        body({"role": "user", "content": [IMAGE]}, tools=[{"type": "function"}]),
    ),
    (
        "content_list_with_tool_calls",
        body(
            {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
            {"role": "user", "content": [IMAGE]},
        ),
    ),
]


@pytest.mark.parametrize("data", [b for _, b in UNSUPPORTED], ids=[i for i, _ in UNSUPPORTED])
def test_unsupported_shapes_fall_back(data: bytes) -> None:
    assert pure_fields(data) is not None
    assert speedups.chat_prompt(data) is None


# Bodies the pure path rejects: the native path must decline them all.
REJECTED: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("whitespace_only", b" \t\r\n"),
    ("vertical_tab_only", b"\x0b"),
    ("bom", b"\xef\xbb\xbf{" + M + b"}"),
    ("form_feed_ws", b"\x0c{" + M + b"}"),
    ("nbsp_ws", b"{\xc2\xa0" + M + b"}"),
    ("lone_high_surrogate", _in_content(b"\\ud800")),
    ("lone_low_surrogate", _in_content(b"\\udc00")),
    ("high_then_non_low", _in_content(b"\\ud800\\u0041")),
    ("high_then_char", _in_content(b"\\ud83dx")),
    ("high_then_high", _in_content(b"\\ud83d\\ud83d")),
    ("reversed_pair", _in_content(b"\\ude00\\ud83d")),
    ("lone_surrogate_in_model", b'{"model":"\\udfff",' + M + b"}"),
    ("lone_surrogate_in_key", b'{"\\ud800":1,' + M + b"}"),
    ("lone_surrogate_in_unknown", _top(b"x", b'["\\ud800"]')),
    ("lone_surrogate_in_salt", _top(b"cache_salt", b'"\\ud800"')),
    ("lone_surrogate_in_message_extra", b'{"messages":[{"role":"user","x":"\\udc00"}]}'),
    ("bad_utf8_ff", _in_content(b"\xff")),
    ("bad_utf8_truncated", _in_content(b"\xe6\x97")),
    ("bad_utf8_truncated_end", b'{"messages":[{"role":"user","content":"\xf0\x9f\x98'),
    ("bad_utf8_lone_continuation", _in_content(b"a\x80b")),
    ("bad_utf8_overlong", _in_content(b"\xc0\x80")),
    ("bad_utf8_overlong_3", _in_content(b"\xe0\x80\xaf")),
    ("bad_utf8_encoded_surrogate", _in_content(b"\xed\xa0\x80")),
    ("bad_utf8_above_max", _in_content(b"\xf4\x90\x80\x80")),
    ("bad_utf8_f5", _in_content(b"\xf5\x80\x80\x80")),
    ("bad_utf8_in_role", b'{"messages":[{"role":"us\xc3","content":"x"}]}'),
    ("bad_utf8_in_model", b'{"model":"\xfe",' + M + b"}"),
    ("bad_utf8_in_name", b'{"messages":[{"role":"user","name":"\x80"}]}'),
    ("bad_utf8_in_salt", _top(b"cache_salt", b'"\xff"')),
    ("bad_utf8_in_stream_options", _top(b"stream_options", b'{"\xff":1}')),
    ("raw_nul_in_content", _in_content(b"a\x00b")),
    ("raw_0x1f_in_content", _in_content(b"\x1f")),
    ("raw_newline_in_content", _in_content(b"a\nb")),
    ("raw_tab_in_role", b'{"messages":[{"role":"us\ter"}]}'),
    ("raw_control_in_key", b'{"mo\x01del":"m",' + M + b"}"),
    ("raw_control_in_unknown", _top(b"x", b'"\x01"')),
    ("bad_escape_x", _in_content(b"\\x41")),
    ("bad_escape_upper_u", _in_content(b"\\U0041")),
    ("bad_escape_short_u", _in_content(b"\\u12")),
    ("bad_escape_hex", _in_content(b"\\uZZZZ")),
    ("bad_escape_in_unknown", _top(b"x", b'"\\q"')),
    ("bad_escape_trailing_backslash", b'{"messages":[{"role":"user","content":"\\'),
    ("number_leading_zero", _top(b"x", b"01")),
    ("number_trailing_dot", _top(b"x", b"1.")),
    ("number_leading_dot", _top(b"x", b".5")),
    ("number_negative_leading_zero", _top(b"x", b"-01")),
    ("number_double_zero", _top(b"x", b"00")),
    ("number_negative_trailing_dot", _top(b"x", b"-0.")),
    ("number_two_exponent_signs", _top(b"x", b"1.0e+-1")),
    ("number_fraction_after_exponent", _top(b"x", b"1e5.5")),
    ("number_then_letter", _top(b"x", b"1x")),
    ("number_then_literal", _top(b"x", b"[1true]")),
    ("number_minus_space", _top(b"x", b"- 1")),
    ("number_bad_in_salt", _top(b"cache_salt", b"[1.]")),
    ("number_bad_in_stream_options", _top(b"stream_options", b'{"a":01}')),
    ("number_plus", _top(b"x", b"+1")),
    ("number_minus_only", _top(b"x", b"-")),
    ("number_double_minus", _top(b"x", b"--1")),
    ("number_bare_exponent", _top(b"x", b"1e")),
    ("number_exponent_sign_only", _top(b"x", b"1e+")),
    ("number_dot_exponent", _top(b"x", b"1.e5")),
    ("number_hex", _top(b"x", b"0x10")),
    ("number_nan", _top(b"x", b"NaN")),
    ("number_infinity", _top(b"x", b"-Infinity")),
    ("number_in_array", _top(b"x", b"[1,01]")),
    ("literal_tru", _top(b"x", b"tru")),
    ("literal_nul", _top(b"x", b"nul")),
    ("literal_True", _top(b"x", b"True")),
    ("literal_fals", _top(b"stream", b"fals")),
    ("literal_truex", _top(b"x", b"truex")),
    ("literal_nullx", _top(b"stream_options", b"nullx")),
    # msgspec decodes these fields to Python values, so their numbers must fit a float.
    ("salt_number_overflow", _top(b"cache_salt", b"1e999")),
    ("salt_number_just_over", _top(b"cache_salt", b"1.8e308")),
    ("salt_long_integer", _top(b"cache_salt", b"1" + b"0" * 4300)),  # Python's 4300 digits
    ("stream_options_long_negative", _top(b"stream_options", b"[-1" + b"0" * 4300 + b"]")),
    ("stream_options_overflow", _top(b"stream_options", b'{"a":[-1e400]}')),
    ("salt_float_just_over", _top(b"cache_salt", b"1" + b"0" * 309 + b".0")),  # 1e309
    ("salt_4301_char_integer", _top(b"cache_salt", b"-1" + b"0" * 4299)),
    ("prefix_id_overflow", _top(b"cache_prefix_id", b"[1" + b"0" * 400 + b".5]")),
    ("trailing_garbage", b"{" + M + b"} x"),
    ("trailing_brace", b"{" + M + b"}}"),
    ("trailing_comma_after", b"{" + M + b"},"),
    ("two_objects", b"{" + M + b"}{" + M + b"}"),
    ("trailing_nul", b"{" + M + b"}\x00"),
    ("trailing_comma_object", b"{" + M + b",}"),
    ("trailing_comma_array", b'{"messages":[{"role":"user"},]}'),
    ("trailing_comma_message", b'{"messages":[{"role":"user",}]}'),
    ("trailing_comma_unknown_array", _top(b"x", b"[1,]")),
    ("trailing_comma_unknown_object", _top(b"x", b'{"a":1,}')),
    ("missing_comma", b'{"model":"m" ' + M + b"}"),
    ("missing_colon", b'{"model" "m",' + M + b"}"),
    ("leading_comma", b"{," + M + b"}"),
    ("double_comma", b'{"model":"m",,' + M + b"}"),
    ("unquoted_key", b"{model:1," + M + b"}"),
    ("single_quotes", b"{'model':'m'," + M + b"}"),
    ("comment", b"{/*c*/" + M + b"}"),
    ("nonstring_key_in_unknown", _top(b"x", b"{1:2}")),
    ("unclosed_unknown_array", _top(b"x", b"[1,2")),
    ("mismatched_brackets", _top(b"x", b"[1}")),
    ("truncated", b'{"messages":[{"role":"user","content":"x"}]'),
    ("truncated_in_string", b'{"messages":[{"role":"user","content":"x'),
    ("truncated_in_key", b'{"messages":[{"role":"user","cont'),
    ("empty_messages", b'{"messages":[]}'),
    ("missing_messages", b'{"model":"m"}'),
    ("empty_object", b"{}"),
    ("messages_null", b'{"messages":null}'),
    ("messages_object", b'{"messages":{"role":"user"}}'),
    ("messages_string", b'{"messages":"hi"}'),
    ("message_string", b'{"messages":["hi"]}'),
    ("message_null", b'{"messages":[null]}'),
    ("message_array", b'{"messages":[[]]}'),
    ("second_message_bad", b'{"messages":[{"role":"user"},{"content":"x"}]}'),
    ("top_array", b"[{" + M + b"}]"),
    ("top_string", b'"messages"'),
    ("top_number", b"1"),
    ("top_null", b"null"),
    ("top_true", b"true"),
    ("model_number", b'{"model":1,' + M + b"}"),
    ("model_null", b'{"model":null,' + M + b"}"),
    ("model_object", b'{"model":{},' + M + b"}"),
    ("stream_string", b'{"stream":"true",' + M + b"}"),
    ("stream_number", b'{"stream":1,' + M + b"}"),
    ("stream_null", b'{"stream":null,' + M + b"}"),
    ("role_missing", b'{"messages":[{"content":"x"}]}'),
    ("role_null", b'{"messages":[{"role":null,"content":"x"}]}'),
    ("role_number", b'{"messages":[{"role":1}]}'),
    ("content_number", b'{"messages":[{"role":"user","content":1}]}'),
    ("content_true", b'{"messages":[{"role":"user","content":true}]}'),
    ("content_object", b'{"messages":[{"role":"user","content":{"text":"x"}}]}'),
    ("content_list_of_strings", b'{"messages":[{"role":"user","content":["x"]}]}'),
    ("content_list_null_part", b'{"messages":[{"role":"user","content":[{"text":"a"},null]}]}'),
    ("content_list_trailing_comma", b'{"messages":[{"role":"user","content":[{"text":"a"},]}]}'),
    (
        "content_part_bad_utf8",
        b'{"messages":[{"role":"user","content":[{"text":"x","y":"\xed\xa0\x80"}]}]}',
    ),
    (
        "content_part_bad_utf8_key",
        b'{"messages":[{"role":"user","content":[{"\xff":1,"text":"x"}]}]}',
    ),
    (
        "content_part_lone_surrogate",
        b'{"messages":[{"role":"user","content":[{"text":"x","y":"\\ud800"}]}]}',
    ),
    (
        "content_part_number_overflow",
        b'{"messages":[{"role":"user","content":[{"text":"x","n":1e999}]}]}',
    ),
    (
        "content_part_long_integer",
        b'{"messages":[{"role":"user","content":[{"text":"x","n":1' + b"0" * 5000 + b"}]}]}",
    ),
    ("name_number", b'{"messages":[{"role":"user","name":1}]}'),
    ("name_list", b'{"messages":[{"role":"user","name":[]}]}'),
    ("tool_call_id_number", b'{"messages":[{"role":"tool","tool_call_id":7}]}'),
    ("tools_object", b'{"tools":{},' + M + b"}"),
    ("tools_object_of_tools", b'{"tools":{"a":{"type":"function"}},' + M + b"}"),
    ("tools_string", b'{"tools":"x",' + M + b"}"),
    ("tools_number", b'{"tools":1,' + M + b"}"),
    ("tools_true", b'{"tools":true,' + M + b"}"),
    ("tools_bad_number", b'{"tools":[{"a":01}],' + M + b"}"),
    ("tools_missing_colon", b'{"tools":[{"a" 1}],' + M + b"}"),
    ("tools_trailing_comma", b'{"tools":[1,],' + M + b"}"),
    ("tools_trailing_comma_in_element", b'{"tools":[{"a":1,}],' + M + b"}"),
    ("tools_leading_comma", b'{"tools":[,1],' + M + b"}"),
    ("tools_missing_comma", b'{"tools":[1 2],' + M + b"}"),
    ("tools_bad_literal", b'{"tools":[tru],' + M + b"}"),
    ("tools_unclosed_element", b'{"tools":[{"a":[1}],' + M + b"}"),
    ("tools_unclosed", b'{"tools":[{"a":1},' + M + b"}"),
    ("tools_lone_surrogate", b'{"tools":["\\ud800"],' + M + b"}"),
    ("tools_bad_escape", b'{"tools":[{"\\q":1}],' + M + b"}"),
    ("tools_raw_control", b'{"tools":["a\x01"],' + M + b"}"),
    ("tools_nonstring_key", b'{"tools":[{1:2}],' + M + b"}"),
    ("tools_truncated", b'{"tools":[{"a":1}'),
    ("tools_no_messages", b'{"tools":[{"a":1}]}'),
    ("deep_tools", b'{"tools":[' + b"[" * 100_000 + b"]" * 100_000 + b"]," + M + b"}"),
    ("tool_calls_object", b'{"messages":[{"role":"assistant","tool_calls":{}}]}'),
    ("tool_calls_bad_item", b'{"messages":[{"role":"assistant","tool_calls":[1]}]}'),
    ("tool_calls_string", b'{"messages":[{"role":"assistant","tool_calls":"f"}]}'),
    ("tool_calls_null_item", b'{"messages":[{"role":"assistant","tool_calls":[null]}]}'),
    ("tool_calls_string_item", b'{"messages":[{"role":"assistant","tool_calls":["f"]}]}'),
    ("tool_calls_list_item", b'{"messages":[{"role":"assistant","tool_calls":[[]]}]}'),
    (
        "tool_calls_second_item_bad",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{}},{"id":"c"}]}]}',
    ),
    ("tool_call_function_missing", b'{"messages":[{"role":"a","tool_calls":[{"id":"c"}]}]}'),
    ("tool_call_empty_object", b'{"messages":[{"role":"a","tool_calls":[{}]}]}'),
    ("tool_call_function_null", b'{"messages":[{"role":"a","tool_calls":[{"function":null}]}]}'),
    ("tool_call_function_string", b'{"messages":[{"role":"a","tool_calls":[{"function":"f"}]}]}'),
    ("tool_call_function_list", b'{"messages":[{"role":"a","tool_calls":[{"function":[]}]}]}'),
    (
        "tool_call_name_null",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":null}}]}]}',
    ),
    (
        "tool_call_name_number",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":1}}]}]}',
    ),
    (
        "tool_call_arguments_object",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"arguments":{"a":1}}}]}]}',
    ),
    (
        "tool_call_arguments_null",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"arguments":null}}]}]}',
    ),
    (
        "tool_call_type_null",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"type":null}]}]}',
    ),
    (
        "tool_call_type_number",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"type":1}]}]}',
    ),
    ("tool_call_id_number", b'{"messages":[{"role":"a","tool_calls":[{"function":{},"id":1}]}]}'),
    ("tool_call_id_object", b'{"messages":[{"role":"a","tool_calls":[{"function":{},"id":{}}]}]}'),
    (
        "tool_call_id_bad_utf8",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"id":"\xff"}]}]}',
    ),
    (
        "tool_call_type_lone_surrogate",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"type":"\\udc00"}]}]}',
    ),
    (
        "tool_call_name_bad_utf8",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":"\xc3"}}]}]}',
    ),
    (
        "tool_call_arguments_bad_escape",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"arguments":"\\x"}}]}]}',
    ),
    (
        "tool_call_arguments_raw_newline",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"arguments":"a\nb"}}]}]}',
    ),
    (
        "tool_call_unknown_bad_number",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{},"x":01}]}]}',
    ),
    (
        "tool_call_function_unknown_bad",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"x":[1,]}}]}]}',
    ),
    (
        "tool_calls_trailing_comma",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{}},]}]}',
    ),
    ("tool_call_trailing_comma", b'{"messages":[{"role":"a","tool_calls":[{"function":{},}]}]}'),
    (
        "function_trailing_comma",
        b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":"f",}}]}]}',
    ),
    ("tool_calls_truncated", b'{"messages":[{"role":"a","tool_calls":[{"function":{"name":"f'),
    ("deep_unknown_array", _top(b"x", b"[" * 100_000 + b"]" * 100_000)),
    ("deep_unknown_object", _top(b"x", b'{"a":' * 100_000 + b"1" + b"}" * 100_000)),
    ("deep_stream_options", _top(b"stream_options", b"[" * 100_000 + b"]" * 100_000)),
    (
        "deep_message_extra",
        b'{"messages":[{"role":"user","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
    ),
    ("deep_unclosed", b"{" + M + b',"x":' + b"[" * 100_000),
]


@pytest.mark.parametrize("data", [b for _, b in REJECTED], ids=[i for i, _ in REJECTED])
def test_rejected_bodies_are_left_to_the_pure_path(data: bytes) -> None:
    assert pure_fields(data) is None  # the case itself is invalid
    assert speedups.chat_prompt(data) is None


@pytest.mark.parametrize("depth", [1, 32, 64, 100, 200, 255, 256, 257, 500, 900, 990, 1000, 2000])
def test_nesting_depths(depth: int) -> None:
    """Wherever the native depth limit lies, it never accepts what msgspec's rejects,
    and it leaves room for the nesting real bodies have."""
    for value in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"0" + b"}" * depth):
        for data in (
            _top(b"x", value),
            _top(b"stream_options", value),
            b'{"messages":[{"role":"user","x":' + value + b"}]}",
            b'{"tools":[' + value + b"]," + M + b"}",
            b'{"messages":[{"role":"a","tool_calls":[{"function":{"x":' + value + b"}}]}]}",
        ):
            native = check(data)
            assert native is not None or depth > 32, data[:80]


def test_native_rejects_non_bytes() -> None:
    with pytest.raises(TypeError):
        speedups.chat_prompt("{}")


def named(corpus: list[tuple[str, bytes]], *ids: str) -> list[bytes]:
    """The bodies of a corpus with these ids, in that order."""
    by_id = dict(corpus)
    return [by_id[i] for i in ids]


def test_no_memory_growth() -> None:
    """Every exit of the C code (accepted, declined, invalid) releases what it made:
    a leaked object per call would show as hundreds of KB here."""
    bodies = [
        *named(PLAIN, "unicode_escaped", "model_escaped", "tools_escapes", "tool_calls_escapes"),
        *named(UNSUPPORTED, "content_list_late"),
        *named(
            REJECTED,
            "high_then_non_low",
            "number_leading_zero",
            "tool_calls_second_item_bad",
            "tools_unclosed_element",
        ),
    ]
    completions = [
        *named(COMPLETION_PLAIN, "string_every_escape", "strings_escapes", "token_lists"),
        *named(
            COMPLETION_REJECTED,
            "int32_over_in_inner",
            "lone_surrogate_in_list",
            "dup_prompt_last_bad",
        ),
    ]
    data = random.Random(1).randbytes(4096)

    def run(n: int) -> None:
        for _ in range(n):
            for b in bodies:
                speedups.chat_prompt(b)
            for b in completions:
                speedups.completion_prompt(b)
            speedups.chain(data, 64, 1)

    run(100)  # warm up caches and interned objects
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run(2000)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024


# ------------------------------------------------------------------------ hypothesis

_KNOWN_TOP = {"messages", "model", "stream", "stream_options", "cache_salt", "cache_prefix_id"}
_KNOWN_MSG = {"role", "content", "name", "tool_call_id", "tool_calls"}
_KNOWN_CALL = {"function", "id", "type", "name", "arguments"}
_KNOWN = _KNOWN_TOP | _KNOWN_MSG | _KNOWN_CALL | {"tools", "prompt"}

# Any text but lone surrogates (which json.dumps would write as invalid JSON escapes).
_text = st.text(st.characters(codec="utf-8"), max_size=30)
_exact = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | _text
_scalar = _exact | st.floats(allow_nan=False, allow_infinity=False)


class _Shape:
    """Strategies for one ``ensure_ascii`` setting. Keys are ones json.dumps writes
    without escapes (the native path leaves a key spelled with escapes to msgspec)."""

    def __init__(self, ensure_ascii: bool) -> None:
        chars = st.characters(
            codec="utf-8",
            min_codepoint=0x20,
            max_codepoint=0x7E if ensure_ascii else None,
            exclude_characters='"\\',
        )
        key = st.text(chars, max_size=12)
        self.extra_key = key.filter(lambda k: k not in _KNOWN)
        self.json: st.SearchStrategy[Any] = st.recursive(
            _scalar,
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(key, inner, max_size=4),
            max_leaves=12,
        )
        # For the fields msgspec decodes into values: no floats, whose exponents the
        # native path leaves to msgspec's range checks.
        self.decoded: st.SearchStrategy[Any] = st.recursive(
            _exact,
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(key, inner, max_size=4),
            max_leaves=12,
        )
        # Tool definitions: kept raw, so any JSON value goes; most are function schemas.
        function = st.fixed_dictionaries(
            {"name": _text, "parameters": self.json},
            optional={"description": _text, "strict": st.booleans()},
        )
        self.tool: st.SearchStrategy[Any] = self.json | st.fixed_dictionaries(
            {"type": st.just("function"), "function": function}
        )


_SHAPES = {ascii_: _Shape(ascii_) for ascii_ in (False, True)}


def _shuffled(draw: st.DrawFn, items: dict[str, Any]) -> dict[str, Any]:
    return dict(draw(st.permutations(list(items.items()))))


def _tool_call(draw: st.DrawFn, shape: _Shape) -> dict[str, Any]:
    function: dict[str, Any] = {}
    if draw(st.booleans()):
        function["name"] = draw(_text)
    if draw(st.booleans()):
        # Arguments are JSON text in a JSON string: escapes within escapes.
        function["arguments"] = draw(_text | shape.json.map(json.dumps))
    function.update(draw(st.dictionaries(shape.extra_key, shape.json, max_size=2)))
    call: dict[str, Any] = {"function": _shuffled(draw, function)}
    if draw(st.booleans()):
        call["id"] = draw(st.none() | _text)
    if draw(st.booleans()):
        call["type"] = draw(_text)
    call.update(draw(st.dictionaries(shape.extra_key, shape.json, max_size=2)))
    return _shuffled(draw, call)


def _message(draw: st.DrawFn, shape: _Shape) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": draw(st.sampled_from(["user", "system", "assistant", "tool"]))}
    if draw(st.integers(0, 9)) == 0:
        msg["role"] = draw(_text)
    if draw(st.booleans()):
        msg["content"] = draw(st.none() | _text)
    if draw(st.booleans()):
        msg["name"] = draw(st.none() | _text)
    if draw(st.booleans()):
        msg["tool_call_id"] = draw(st.none() | _text)
    calls = draw(st.integers(0, 5))
    if calls == 0:
        msg["tool_calls"] = None
    elif calls == 1:
        msg["tool_calls"] = [_tool_call(draw, shape) for _ in range(draw(st.integers(0, 3)))]
    msg.update(draw(st.dictionaries(shape.extra_key, shape.json, max_size=3)))
    return _shuffled(draw, msg)


_WS = st.text(st.sampled_from(" \t\r\n"), max_size=3)


def _serialize(draw: st.DrawFn, top: dict[str, Any], ensure_ascii: bool) -> bytes:
    """``top`` written out in one of the many ways a client might."""
    item_sep, key_sep = draw(
        st.sampled_from([(",", ":"), (", ", ": "), (" ,\t", "\r: \n"), (",\n", " :")])
    )
    text = json.dumps(
        _shuffled(draw, top),
        ensure_ascii=ensure_ascii,
        separators=(item_sep, key_sep),
        indent=draw(st.sampled_from([None, None, 0, 2, "\t"])),
    )
    return (draw(_WS) + text + draw(_WS)).encode()


def _optional(
    draw: st.DrawFn, top: dict[str, Any], shape: _Shape, more: dict[str, st.SearchStrategy[Any]]
) -> None:
    """The top-level keys chat and completions share, then ``more``, then unknown keys:
    each present or not."""
    optional: dict[str, st.SearchStrategy[Any]] = {
        "model": _text,
        "stream": st.booleans(),
        "stream_options": shape.decoded,
        "cache_salt": shape.decoded,
        "cache_prefix_id": shape.decoded,
        **more,
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            top[key] = draw(strategy)
    top.update(draw(st.dictionaries(shape.extra_key, shape.json, max_size=3)))


@st.composite
def plain_body(draw: st.DrawFn) -> bytes:
    """A plain chat body, serialized in one of the many ways a client might."""
    ensure_ascii = draw(st.booleans())
    shape = _SHAPES[ensure_ascii]
    n = draw(st.integers(1, 5))
    top: dict[str, Any] = {"messages": [_message(draw, shape) for _ in range(n)]}
    tools = st.none() | st.lists(shape.tool, max_size=4)
    _optional(draw, top, shape, {"tools": tools})
    return _serialize(draw, top, ensure_ascii)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_body())
def test_generated_plain_bodies_take_the_native_path(data: bytes) -> None:
    assert pure_fields(data) is not None
    assert check(data) is not None


def _mutate(data: bytes, edits: list[tuple[str, float, int]]) -> bytes:
    buf = bytearray(data)
    for kind, where, byte in edits:
        i = int(where * (len(buf) + (kind == "insert")))
        if kind == "replace" and buf:
            buf[i] = byte
        elif kind == "insert":
            buf.insert(i, byte)
        elif kind == "delete" and buf:
            del buf[i]
        elif kind == "truncate":
            del buf[i:]
    return bytes(buf)


# Bytes that change JSON structure, break strings or break UTF-8 (or, in token ids,
# make floats and overflows).
_INTERESTING = list(b'"\\{}[],:u0e-.+9 \x00\x1f\x80\xc3\xed\xf0\xff')
_KINDS = ["replace", "insert", "delete", "truncate"]
_edit = st.tuples(
    st.sampled_from(_KINDS),
    st.floats(0, 1, exclude_max=True),
    st.sampled_from(_INTERESTING) | st.integers(0, 255),
)


def _fuzz(
    check_one: Callable[[bytes], object],
    data: bytes,
    edits: list[tuple[str, float, int]],
    rng: random.Random,
) -> None:
    check_one(_mutate(data, edits))
    # Generating a body costs far more than checking one: check many mutants of each.
    for _ in range(40):
        more = [
            (
                rng.choice(_KINDS),
                rng.random(),
                rng.choice(_INTERESTING) if rng.random() < 0.7 else rng.randrange(256),
            )
            for _ in range(rng.randint(1, 3))
        ]
        check_one(_mutate(data, more))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_body(), st.lists(_edit, min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_mutated_bodies_keep_the_invariant(
    data: bytes, edits: list[tuple[str, float, int]], rng: random.Random
) -> None:
    _fuzz(check, data, edits, rng)


def _single_byte_edits(check_one: Callable[[bytes], object], data: bytes) -> None:
    for i in range(len(data)):
        check_one(data[:i])
        check_one(data[:i] + data[i + 1 :])
        for byte in b'"\\}],:\x00\x80\xff':
            check_one(data[:i] + bytes([byte]) + data[i + 1 :])


@pytest.mark.parametrize(
    "data",
    [b for _, b in PLAIN if len(b) < 700],
    ids=[i for i, b in PLAIN if len(b) < 700],
)
def test_every_single_byte_edit_of_plain_bodies_keeps_the_invariant(data: bytes) -> None:
    """The hand-written bodies hold what generated ones rarely do (escapes, odd
    spacing, near-miss keys): break each of their bytes in turn."""
    _single_byte_edits(check, data)


_FRAGMENTS = [b"\\u", b"\\ud83d", b"\\ude00", b"\\ud83d\\u", b"\\"]


def _splice_after_quotes(check_one: Callable[[bytes], object], data: bytes) -> None:
    """Escape fragments spliced in just after each opening quote of the body."""
    starts = [i + 1 for i, b in enumerate(data) if b == ord('"')]
    for fragment in _FRAGMENTS:
        for i in starts[:12]:
            check_one(data[:i] + fragment + data[i:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_body())
def test_escape_fragments_in_strings_keep_the_invariant(data: bytes) -> None:
    _splice_after_quotes(check, data)


@st.composite
def list_content_body(draw: st.DrawFn) -> bytes:
    """A chat body whose messages may hold multi-part content: text parts (with or
    without other keys) and other parts. The native path may take or leave these."""
    ensure_ascii = draw(st.booleans())
    shape = _SHAPES[ensure_ascii]
    extras = st.dictionaries(shape.extra_key, shape.json, max_size=2)
    text_part = st.builds(
        lambda text, more: {"type": "text", "text": text, **more},
        _text,
        st.just({}) | extras,
    )
    other_part = st.just(IMAGE) | st.dictionaries(shape.extra_key, shape.json, max_size=3)
    part = text_part | text_part | other_part
    messages = [_message(draw, shape) for _ in range(draw(st.integers(1, 3)))]
    for msg in messages:
        if draw(st.booleans()):
            msg["content"] = draw(st.lists(part, max_size=4))
    top: dict[str, Any] = {"messages": messages}
    _optional(draw, top, shape, {"tools": st.none() | st.lists(shape.tool, max_size=2)})
    return _serialize(draw, top, ensure_ascii)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(list_content_body(), st.randoms(use_true_random=False))
def test_list_content_bodies_keep_the_invariant(data: bytes, rng: random.Random) -> None:
    assert pure_fields(data) is not None
    check(data)
    _fuzz(check, data, [], rng)


# ------------------------------------------------------------------ completion_prompt

P = b'"prompt":"x"'


def cbody(prompt: Any, **top: Any) -> bytes:
    return json.dumps({"prompt": prompt, **top}).encode()


def _ctop(key: bytes, value: bytes) -> bytes:
    return b'{"' + key + b'":' + value + b"," + P + b"}"


def tokens(*ids: int) -> bytes:
    return array("i", ids).tobytes()


# Completions bodies of the plain shape: the native path must take them.
COMPLETION_PLAIN: list[tuple[str, bytes]] = [
    ("minimal", b'{"prompt":"hi"}'),
    ("one_space", b'{"prompt":" "}'),
    (
        "string_every_escape",
        b'{"prompt":"q\\"b\\\\s\\/f\\bb\\ff\\nn\\rr\\tt\\u0000\\u001f\\u007f\\u00e9'
        b'\\ud83d\\ude00\\uD83D\\uDE00\\udbff\\udfff\\uffff"}',
    ),
    (
        "string_unicode_raw",
        json.dumps({"prompt": "é 日本語 😀 \x7f", "model": "mé"}, ensure_ascii=False).encode(),
    ),
    (
        "string_utf8_boundaries",
        b'{"prompt":"\xc2\x80\xdf\xbf\xe0\xa0\x80\xed\x9f\xbf\xee\x80\x80\xef\xbf\xbf'
        b'\xf0\x90\x80\x80\xf4\x8f\xbf\xbf"}',
    ),
    ("string_large", cbody("x\u00e9\n" * 40_000)),
    ("strings", cbody(["a", "b", "c"])),
    ("strings_one", cbody(["only"])),
    ("strings_one_empty", b'{"prompt":[""]}'),
    ("strings_empty_items", cbody(["", "", "a", ""])),
    (
        "strings_escapes",
        b'{"prompt":["a\\nb","\\u00e9\\ud83d\\ude00","\\"\\\\","\xe6\x97\xa5"]}',
    ),
    ("tokens", cbody([1, 2, 3])),
    ("tokens_zero", b'{"prompt":[0]}'),
    ("tokens_negative_zero", b'{"prompt":[-0]}'),
    (
        "tokens_edges",
        b'{"prompt":[0,-1,2147483647,-2147483648,1,255,256,65535,65536,16777216,-2147483647]}',
    ),
    ("tokens_many", cbody(list(range(-5000, 5000)))),
    ("token_lists", cbody([[1, 2], [3], [0, -1, 2147483647, -2147483648]])),
    ("token_lists_one", b'{"prompt":[[7]]}'),
    ("token_lists_many", cbody([list(range(i, i + 50)) for i in range(100)])),
    (
        "whitespace_everywhere",
        b' \t\r\n{ "model" : "m" , "prompt" :\n[ [ 1 ,2 ] ,\t[ -3 ] ] , "stream" : true ,'
        b' "x" : [ 1 , { "a" : null } ] } \r\n',
    ),
    ("whitespace_tokens", b'{"prompt":[ 1 , 2 ,\n3\t]}'),
    ("whitespace_strings", b'{ "prompt" : [ "a" , "b" ] }'),
    (
        "all_keys",
        cbody(
            "p",
            model="m",
            stream=True,
            stream_options={"include_usage": True},
            cache_salt="s",
            cache_prefix_id=None,
        ),
    ),
    (
        "key_order_varied",
        b'{"stream":false,"cache_prefix_id":{"a":[1]},"prompt":"p","model":"m\\u00e9",'
        b'"stream_options":null}',
    ),
    ("model_escaped", b'{"model":"m\\u00e9\\/x\\"y","prompt":[1]}'),
    ("model_empty", b'{"model":"","prompt":"x"}'),
    ("stream_false", cbody("x", stream=False)),
    ("stream_options_scalar", cbody([1], stream_options=[1, "a", {"b": [None]}])),
    ("cache_salt_null", cbody(["a"], cache_salt=None)),
    (
        "decoded_number_forms",  # no exponents: msgspec range-checks those
        b'{"cache_salt":[0,-0.0,-12.5,123456789012345678901234567890],'
        b'"stream_options":{"n":1,"m":-12.5},"prompt":[[1]]}',
    ),
    (
        "unknown_keys",
        b'{"max_tokens":16,"temperature":0.7,"logprobs":null,"echo":false,"stop":["\\n"],'
        b'"n":1e2,"tiny":5e-324,"big":1' + b"0" * 300 + b',"nested":{"a":[1,{"b":null}]},'
        b'"s":"]}\\"{[","":"","prompt":"x","after":[]}',
    ),
    (
        # Keys chat knows are unknown here: skipped, whatever their values.
        "chat_keys_are_unknown",
        b'{"messages":{"not":"a list"},"tools":5,"tool_calls":"x","role":1,"content":[],'
        b'"prompt":"p"}',
    ),
    (
        "near_miss_keys",
        b'{"prompts":1,"promp":2,"prompt_":3,"Prompt":4,"prompt":"x","models":5,"streams":6,'
        b'"stream_option":7,"cache_salts":8,"cache_prefix":9}',
    ),
]


@pytest.mark.parametrize(
    "data", [b for _, b in COMPLETION_PLAIN], ids=[i for i, _ in COMPLETION_PLAIN]
)
def test_plain_completion_bodies_take_the_native_path(data: bytes) -> None:
    assert pure_completion_fields(data) is not None  # the case itself is valid
    assert check_completion(data) is not None


def test_native_completion_fields() -> None:
    cases: list[tuple[bytes, CompletionFields]] = [
        (b'{"prompt":"a\\"\\ud83d\\ude00"}', ("", 'a"😀'.encode(), None, False, False, False)),
        (
            b'{"model":"m\\u00e9","stream":true,"stream_options":null,"cache_salt":null,'
            b'"prompt":["a","","b"]}',
            ("mé", b"a\x1e\x1eb", None, True, True, True),
        ),
        (b'{"prompt":[""]}', ("", b"", None, False, False, False)),
        (
            b'{"prompt":[0,-1,2147483647,-2147483648]}',
            ("", tokens(0, -1, 2147483647, -(2**31)), None, False, False, False),
        ),
        (
            b'{"prompt":[[1,2],[3]],"cache_prefix_id":"p"}',
            ("", tokens(1, 2) + b"\x1e" + tokens(3), None, True, False, False),
        ),
    ]
    for data, expected in cases:
        assert check_completion(data) == expected


# Either answer is right here (None, or the pure one).
COMPLETION_EITHER: list[tuple[str, bytes]] = [
    ("dup_prompt", b'{"prompt":"a","prompt":[1]}'),
    ("dup_prompt_first_empty", b'{"prompt":"","prompt":"a"}'),
    ("dup_prompt_first_bad", b'{"prompt":[1.5],"prompt":[[1]]}'),
    ("dup_model", b'{"model":"a","prompt":"x","model":"b"}'),
    ("dup_stream", b'{"stream":true,"prompt":"x","stream":false}'),
    ("escaped_key_prompt", b'{"pr\\u006fmpt":"x"}'),
    ("escaped_key_model", b'{"mod\\u0065l":"m","prompt":"x"}'),
    ("escaped_key_stream", b'{"stre\\u0061m":true,"prompt":"x"}'),
    ("escaped_key_in_unknown", b'{"x":{"\\u0061":1},"prompt":"x"}'),
    ("unknown_value_bad_utf8", b'{"x":"\xff\xc0\x80","prompt":"x"}'),
    ("salt_exponent", _ctop(b"cache_salt", b"1e5")),
    ("stream_options_exponent", _ctop(b"stream_options", b'{"a":[-2.5E-3]}')),
    ("salt_400_digit_integer", _ctop(b"cache_salt", b"1" + b"0" * 400)),
    ("salt_tiny_double", _ctop(b"cache_salt", b"[1e-400]")),
]


@pytest.mark.parametrize(
    "data", [b for _, b in COMPLETION_EITHER], ids=[i for i, _ in COMPLETION_EITHER]
)
def test_native_completion_agrees_or_declines(data: bytes) -> None:
    assert pure_completion_fields(data) is not None  # all of these are valid
    check_completion(data)


def _prompt(value: bytes) -> bytes:
    return b'{"prompt":' + value + b"}"


# Bodies the pure path rejects: the native path must decline them all.
COMPLETION_REJECTED: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("whitespace_only", b" \t\r\n"),
    ("top_array", b"[" + _prompt(b'"x"') + b"]"),
    ("top_string", b'"prompt"'),
    ("top_null", b"null"),
    ("top_number", b"1"),
    ("empty_object", b"{}"),
    ("missing_prompt", b'{"model":"m","stream":true}'),
    ("chat_body", b'{"messages":[{"role":"user","content":"x"}]}'),
    ("prompt_null", _prompt(b"null")),
    ("prompt_empty_string", _prompt(b'""')),
    ("prompt_empty_list", _prompt(b"[]")),
    ("prompt_empty_list_ws", _prompt(b" [ ] ")),
    ("prompt_empty_inner", _prompt(b"[[]]")),
    ("prompt_empty_inner_second", _prompt(b"[[1],[]]")),
    ("prompt_object", _prompt(b'{"text":"x"}')),
    ("prompt_number", _prompt(b"1")),
    ("prompt_true", _prompt(b"true")),
    ("mixed_token_string", _prompt(b'[1,"a"]')),
    ("mixed_string_token", _prompt(b'["a",1]')),
    ("mixed_lists_string", _prompt(b'[[1],"a"]')),
    ("mixed_string_list", _prompt(b'["a",[1]]')),
    ("mixed_token_list", _prompt(b"[1,[2]]")),
    ("mixed_list_token", _prompt(b"[[1],2]")),
    ("strings_in_inner_list", _prompt(b'[["a"]]')),
    ("nested_three", _prompt(b"[[[1]]]")),
    ("object_item", _prompt(b'[{"a":1}]')),
    ("object_in_inner", _prompt(b"[[{}]]")),
    ("null_item", _prompt(b"[null]")),
    ("null_after_string", _prompt(b'["a",null]')),
    ("null_in_inner", _prompt(b"[[1,null]]")),
    ("float", _prompt(b"[1.0]")),
    ("float_exponent", _prompt(b"[1e2]")),
    ("float_exponent_upper", _prompt(b"[1E0]")),
    ("float_negative_zero", _prompt(b"[-0.0]")),
    ("float_after_ints", _prompt(b"[1,2,0.5]")),
    ("float_in_inner", _prompt(b"[[1],[2.5]]")),
    ("bool_true", _prompt(b"[true]")),
    ("bool_false", _prompt(b"[false]")),
    ("bool_after_int", _prompt(b"[1,true]")),
    ("bool_in_inner", _prompt(b"[[true]]")),
    ("int32_over", _prompt(b"[2147483648]")),
    ("int32_under", _prompt(b"[-2147483649]")),
    ("int32_over_in_inner", _prompt(b"[[1],[2147483648]]")),
    ("int32_over_late", _prompt(b"[1,2,3,4294967296]")),
    ("int64_over", _prompt(b"[9223372036854775808]")),
    ("uint64_max", _prompt(b"[18446744073709551615]")),
    ("uint64_over", _prompt(b"[18446744073709551616]")),
    ("int64_under", _prompt(b"[-9223372036854775809]")),
    ("int_400_digits", _prompt(b"[1" + b"0" * 400 + b"]")),
    ("int_4300_digits", _prompt(b"[1" + b"0" * 4300 + b"]")),
    ("int_leading_zeros", _prompt(b"[007]")),
    ("int_overflow_exponent", _prompt(b"[1e999]")),
    ("bad_utf8", _prompt(b'"\xff"')),
    ("bad_utf8_truncated", _prompt(b'"\xe6\x97"')),
    ("bad_utf8_encoded_surrogate", _prompt(b'"\xed\xa0\x80"')),
    ("bad_utf8_in_list", _prompt(b'["a","\xc0\x80"]')),
    ("lone_surrogate", _prompt(b'"\\ud800"')),
    ("lone_surrogate_in_list", _prompt(b'["a","\\udc00"]')),
    ("high_then_non_low", _prompt(b'"\\ud83d\\u0041"')),
    ("raw_newline", _prompt(b'"a\nb"')),
    ("raw_nul_in_list", _prompt(b'["\x00"]')),
    ("bad_escape", _prompt(b'"\\x41"')),
    ("bad_escape_short_u", _prompt(b'"\\u12"')),
    ("trailing_comma_tokens", _prompt(b"[1,]")),
    ("trailing_comma_strings", _prompt(b'["a",]')),
    ("trailing_comma_inner", _prompt(b"[[1,]]")),
    ("leading_comma", _prompt(b"[,1]")),
    ("missing_comma", _prompt(b"[1 2]")),
    ("minus_only", _prompt(b"[-]")),
    ("plus", _prompt(b"[+1]")),
    ("hex", _prompt(b"[0x10]")),
    ("unclosed_list", b'{"prompt":[1,2}'),
    ("unclosed_inner", b'{"prompt":[[1,2]}'),
    ("truncated", b'{"prompt":"x"'),
    ("truncated_in_string", b'{"prompt":"x'),
    ("truncated_in_tokens", b'{"prompt":[1,2'),
    ("trailing_garbage", b'{"prompt":"x"} x'),
    ("trailing_comma_object", b'{"prompt":"x",}'),
    ("two_objects", b'{"prompt":"x"}{"prompt":"x"}'),
    ("dup_prompt_last_null", b'{"prompt":"a","prompt":null}'),
    ("dup_prompt_last_empty", b'{"prompt":[1],"prompt":[]}'),
    ("dup_prompt_last_bad", b'{"prompt":[1],"prompt":[1.5]}'),
    ("model_number", _ctop(b"model", b"1")),
    ("model_null", _ctop(b"model", b"null")),
    ("stream_string", _ctop(b"stream", b'"true"')),
    ("stream_null", _ctop(b"stream", b"null")),
    ("salt_number_overflow", _ctop(b"cache_salt", b"1e999")),
    ("salt_long_integer", _ctop(b"cache_salt", b"1" + b"0" * 4300)),
    ("stream_options_overflow", _ctop(b"stream_options", b'{"a":[-1e400]}')),
    ("prefix_id_overflow", _ctop(b"cache_prefix_id", b"[1" + b"0" * 400 + b".5]")),
    ("salt_lone_surrogate", _ctop(b"cache_salt", b'"\\ud800"')),
    ("unknown_bad_number", _ctop(b"x", b"01")),
    ("unknown_bad_literal", _ctop(b"x", b"tru")),
    ("unknown_lone_surrogate", _ctop(b"x", b'["\\ud800"]')),
    ("unknown_trailing_comma", _ctop(b"x", b"[1,]")),
    ("messages_bad_json", _ctop(b"messages", b"[{]")),
    ("deep_prompt", _prompt(b"[" * 100_000 + b"]" * 100_000)),
    ("deep_unknown", _ctop(b"x", b"[" * 100_000 + b"]" * 100_000)),
    ("deep_stream_options", _ctop(b"stream_options", b'{"a":' * 100_000 + b"1" + b"}" * 100_000)),
]


@pytest.mark.parametrize(
    "data", [b for _, b in COMPLETION_REJECTED], ids=[i for i, _ in COMPLETION_REJECTED]
)
def test_rejected_completion_bodies_are_left_to_the_pure_path(data: bytes) -> None:
    assert pure_completion_fields(data) is None  # the case itself is invalid
    assert speedups.completion_prompt(data) is None


def test_completion_prompt_rejects_non_bytes() -> None:
    with pytest.raises(TypeError):
        speedups.completion_prompt('{"prompt":"x"}')


def test_the_other_endpoint_is_declined() -> None:
    """A body of one endpoint is not one of the other."""
    assert speedups.completion_prompt(body(U)) is None
    assert speedups.chat_prompt(cbody("x")) is None


@pytest.mark.parametrize(
    "data",
    [b for _, b in COMPLETION_PLAIN if len(b) < 700],
    ids=[i for i, b in COMPLETION_PLAIN if len(b) < 700],
)
def test_every_single_byte_edit_of_plain_completion_bodies_keeps_the_invariant(
    data: bytes,
) -> None:
    _single_byte_edits(check_completion, data)


_token = st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, -1, 2**31 - 1, -(2**31)])
_prompts = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=30),
    st.lists(_text, min_size=1, max_size=4),
    st.lists(_token, min_size=1, max_size=30),
    st.lists(st.lists(_token, min_size=1, max_size=10), min_size=1, max_size=4),
)


@st.composite
def plain_completion_body(draw: st.DrawFn) -> bytes:
    """A plain completions body, its prompt of any of the four shapes."""
    ensure_ascii = draw(st.booleans())
    shape = _SHAPES[ensure_ascii]
    top: dict[str, Any] = {"prompt": draw(_prompts)}
    # The chat keys are unknown keys here.
    _optional(draw, top, shape, {"messages": shape.json, "tools": shape.json})
    return _serialize(draw, top, ensure_ascii)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_completion_body())
def test_generated_plain_completion_bodies_take_the_native_path(data: bytes) -> None:
    assert pure_completion_fields(data) is not None
    assert check_completion(data) is not None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plain_completion_body(),
    st.lists(_edit, min_size=1, max_size=4),
    st.randoms(use_true_random=False),
)
def test_mutated_completion_bodies_keep_the_invariant(
    data: bytes, edits: list[tuple[str, float, int]], rng: random.Random
) -> None:
    _fuzz(check_completion, data, edits, rng)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_completion_body())
def test_escape_fragments_in_completion_strings_keep_the_invariant(data: bytes) -> None:
    _splice_after_quotes(check_completion, data)


# ----------------------------------------------------------- the public entry point


def test_the_request_path_loads_the_extension() -> None:
    from ace_extproc import native

    pure_only = os.environ.get("ACE_EXTPROC_PURE_PYTHON") == "1"
    assert native.extension is (None if pure_only else speedups)


CHAT_PUBLIC = (
    [b for _, b in PLAIN[:8]]
    + [b for i, b in PLAIN if i.startswith("tool")]
    + [b for _, b in UNSUPPORTED]
    + [b for _, b in EITHER[:4]]
)


PUBLIC = [(CHAT_PATH, b) for b in CHAT_PUBLIC] + [
    (COMPLETIONS_PATH, b)
    for b in [b for _, b in COMPLETION_PLAIN] + [b for _, b in COMPLETION_EITHER]
]
PUBLIC_REJECTED = [(CHAT_PATH, i, b) for i, b in REJECTED] + [
    (COMPLETIONS_PATH, i, b) for i, b in COMPLETION_REJECTED
]


@pytest.mark.parametrize(("path", "data"), PUBLIC)
def test_public_parse_matches_pure(path: str, data: bytes) -> None:
    assert request.parse(path, data) == parse_pure(path, data)


@pytest.mark.parametrize(
    ("path", "data"),
    [(p, b) for p, _, b in PUBLIC_REJECTED],
    ids=[i for _, i, _ in PUBLIC_REJECTED],
)
def test_public_parse_rejects_as_pure_does(path: str, data: bytes) -> None:
    with pytest.raises(RequestError) as pure:
        parse_pure(path, data)
    with pytest.raises(RequestError) as public:
        request.parse(path, data)
    assert public.value.reason == pure.value.reason


def test_the_type_stub_matches_the_extension() -> None:
    """``_speedups.pyi`` names exactly the functions the built module has, with their
    arguments (mypy's stubtest): a function renamed or added in C fails here."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "--mypy-config-file",
            "pyproject.toml",
            "ace_extproc.native._speedups",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
