"""Envoy's request headers read from the message's wire bytes: ``native.header_map``
(``_headers.c``) against ``native.wire.header_map`` on the parsed message, the
reference.

Its contract: for any ProcessingRequest, the same dict (the last of a repeated key
kept, raw values as latin-1, {} for another kind of message); malformed bytes raise,
never crash.
"""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc.native.wire import header_map as header_map_pure
from ace_extproc.server import request_headers
from tests.conftest import load_speedups

speedups = load_speedups()


def message(headers: list[tuple[str, bytes, str]], end_of_stream: bool = False) -> bytes:
    msg = ProcessingRequest()
    http = msg.request_headers
    http.end_of_stream = end_of_stream
    for key, raw, value in headers:
        h = http.headers.headers.add()
        h.key = key
        h.raw_value = raw
        h.value = value  # Envoy 1.40 leaves it empty; ignored either way
    msg.observability_mode = True
    return msg.SerializeToString()


def both(data: bytes) -> dict[str, str]:
    msg = ProcessingRequest.FromString(data)
    expected = header_map_pure(msg.request_headers.headers)
    assert speedups.header_map(data) == expected
    assert request_headers(msg, data) == expected == request_headers(msg, None)
    return expected


@settings(max_examples=300, deadline=None)
@given(
    headers=st.lists(
        st.tuples(
            st.sampled_from([":path", ":method", "authorization", "x-session-id"]) | st.text(),
            st.binary(max_size=300),
            st.text(max_size=20),
        ),
        max_size=40,
    ),
    end_of_stream=st.booleans(),
)
def test_the_wire_bytes_give_the_reference_dict(
    headers: list[tuple[str, bytes, str]], end_of_stream: bool
) -> None:
    out = both(message(headers, end_of_stream))
    assert set(out) == {key for key, _, _ in headers}


def test_a_message_sent_in_parts_merges_as_protobuf_does() -> None:
    """Two encodings of request_headers back to back are one message whose header
    lists concatenate (the later value of a repeated key wins)."""
    first = message([(":path", b"/a", ""), ("x", b"1", "")])
    second = message([(":path", b"/v1/chat/completions", ""), ("y", b"\xff", "")])
    assert both(first + second) == {":path": "/v1/chat/completions", "x": "1", "y": "\xff"}


def test_other_kinds_of_message_have_no_request_headers() -> None:
    msg = ProcessingRequest()
    msg.request_body.body = b'{"model":"m"}'
    assert both(msg.SerializeToString()) == {}
    assert both(b"") == {}
    response = ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    assert both(response.SerializeToString()) == {}


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\x02\x18\x01\x33\x34",  # an empty group of an unknown field after the headers
        b"\x3b\x3c\x50\x01",  # the same before another field
    ],
)
def test_what_upb_accepts_and_the_c_reader_does_not_falls_back(data: bytes) -> None:
    """A byte fuzz found messages upb parses and ``native.header_map`` refuses (groups,
    a wire form Envoy never sends): the server reads those from the parsed message
    rather than passing the request through unrouted."""
    msg = ProcessingRequest.FromString(data)
    with pytest.raises(ValueError):
        speedups.header_map(data)
    assert request_headers(msg, data) == header_map_pure(msg.request_headers.headers)


@pytest.mark.parametrize(
    "data",
    [
        b"\x12",  # request_headers with no length
        b"\x12\x05\x0a",  # a length past the end
        b"\x12\x02\x0a\x05",  # a HeaderMap past the end of request_headers
        b"\x13",  # a group (wire type 3)
        b"\x12\x04\x0a\x02\x0a\x02",  # a HeaderValue cut short
        b"\x12\x03\x0a\x01\x0b",  # a group inside a HeaderValue's map
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint past 64 bits
        b"\x12\x08\x0a\x06\x0a\x02\xc3\x28\x1a\x00",  # a key that is not UTF-8
    ],
)
def test_malformed_bytes_raise(data: bytes) -> None:
    with pytest.raises(ValueError):
        speedups.header_map(data)


def test_only_bytes() -> None:
    with pytest.raises(TypeError):
        speedups.header_map(bytearray(message([])))
