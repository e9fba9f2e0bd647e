"""The body phase's answer (``mutate.body_decided``) and the body splice
(``processor.splice``) that rewrites what the client sent."""

from __future__ import annotations

import msgspec
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc import mutate
from ace_extproc.config import Mode
from ace_extproc.outcome import Outcome
from ace_extproc.processor import splice


def test_an_empty_answer_still_names_its_phase() -> None:
    """No mutation at all: the answer must still carry an (empty) body response."""
    out = Outcome(Mode.PROD, "bypass_no_pod")
    sent = mutate.body_decided(out, False)
    parsed = ProcessingResponse.FromString(sent.SerializeToString())
    assert parsed.WhichOneof("response") == "request_body"
    common = parsed.request_body.response
    assert not common.HasField("header_mutation") and not common.HasField("body_mutation")
    assert not common.clear_route_cache


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    members=st.dictionaries(st.text(max_size=10).map(lambda k: "c_" + k), JSON_VALUES),
    space=st.sampled_from([b"", b" ", b"\t\r\n ", b"\n"]),
    salt=st.text(max_size=40),
)
def test_splice_adds_the_fields_and_keeps_every_client_byte(
    members: dict[str, object], space: bytes, salt: str
) -> None:
    body = space + msgspec.json.encode(members)
    fields = '"cache_salt":' + msgspec.json.encode(salt).decode()
    out = splice(body, fields)
    assert msgspec.json.decode(out) == {"cache_salt": salt, **members}
    brace = body.index(b"{") + 1
    assert out.endswith(body[brace:]) and out.startswith(body[:brace])


def test_splice_refuses_what_it_cannot_splice() -> None:
    with pytest.raises(ValueError):
        splice(b'"no object"', '"k":1')
