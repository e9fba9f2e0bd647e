"""The ``answer`` piece: the body answer the server sends, ``mutate.body_answer``
(serialized in C, ``native/_answer.c``, from ``changes`` and ``metadata``) against
``mutate.body_decided`` (built in upb), the reference; and the body splice.

Its contract: for every outcome, the bytes parse to exactly the message the reference
builds (map entries may come in another order, as protobuf allows); the server's
serializer sends them as they are. Bad arguments to the C encoder raise, never crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from ace_extproc import mutate
from ace_extproc.config import Mode, Pod, sim_fleet
from ace_extproc.native.wire import splice as splice_pure
from ace_extproc.processor import Outcome
from tests.conftest import load_speedups

speedups = load_speedups()

PODS = sim_fleet(["10.0.0.1:8000", "10.0.0.2:8001", "[fd00::7]:8000", "pod-é.svc:80"]).pods
BODIES = {
    "none": None,
    "empty": b"",
    "small": b'{"model":"m"}',
    "2-byte length": b"x" * 200,
    "3-byte length": b"y" * 20_000,
    "4-byte length": b"z" * 3_000_000,
}


def outcome(**kw: object) -> Outcome:
    base = Outcome(
        Mode.PROD,
        "hit",
        "0123456789abcdef",
        pod=PODS[1],
        would_pick=PODS[1],
        saved_tokens=4096,
        speedup=3.5,
        body=b"{}",
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _same(out: Outcome, client_upstream: bool) -> None:
    sent = mutate.body_answer(out, client_upstream)
    assert isinstance(sent, bytes)
    reference = mutate.body_decided(out, client_upstream)
    assert ProcessingResponse.FromString(sent) == reference
    assert mutate.serialize(sent) is sent
    # Same fields, same sizes: only the order of map entries may differ.
    assert len(sent) == len(reference.SerializeToString())


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
@pytest.mark.parametrize("endpoint", [False, True], ids=["cluster", "endpoint"])
@pytest.mark.parametrize("client_upstream", [False, True], ids=["", "client-upstream"])
def test_a_pinned_request_answers_as_the_reference(
    body: bytes | None, endpoint: bool, client_upstream: bool
) -> None:
    _same(outcome(body=body, endpoint=endpoint), client_upstream)


@pytest.mark.parametrize(
    "changes",
    [
        {"fallbacks": (PODS[2], PODS[0])},  # endpoint list with an IPv6 host
        {"pod": PODS[3], "would_pick": PODS[3]},  # a hostname pod, a non-ASCII key
        {"path": "/v1/chat/completions"},  # the native API's envelope became a chat
        {"pod": None, "mode": Mode.SHADOW, "body": None},  # shadow: report only
        {"pod": None, "would_pick": None, "action": "bypass_bad_json", "body": None},
        {"saved_tokens": 0, "speedup": 1.0, "action": "miss"},  # a 0.0 number is sent
        {"saved_tokens": 2**53, "prefix_key": "-"},
        {"mode": Mode.OFF, "pod": None, "would_pick": None, "action": "off", "body": None},
    ],
    ids=lambda c: ",".join(c),
)
@pytest.mark.parametrize("endpoint", [False, True], ids=["cluster", "endpoint"])
@pytest.mark.parametrize("client_upstream", [False, True], ids=["", "client-upstream"])
def test_every_kind_of_outcome_answers_as_the_reference(
    changes: dict[str, object], endpoint: bool, client_upstream: bool
) -> None:
    _same(outcome(endpoint=endpoint, **changes), client_upstream)


def test_an_empty_answer_still_names_its_phase() -> None:
    """No mutation at all: the answer must still carry an (empty) body response."""
    out = outcome(pod=None, would_pick=None, action="bypass_no_pod", body=None)
    sent = mutate.body_answer(out, False)
    assert isinstance(sent, bytes)
    parsed = ProcessingResponse.FromString(sent)
    assert parsed.WhichOneof("response") == "request_body"
    common = parsed.request_body.response
    assert not common.HasField("header_mutation") and not common.HasField("body_mutation")
    assert not common.clear_route_cache


def test_a_rejection_is_left_to_upb() -> None:
    out = outcome(pod=None, action="reject_unknown_key", reject_status=401, reject_body=b"{}")
    sent = mutate.body_answer(out, False)
    assert not isinstance(sent, bytes)
    assert sent.immediate_response.status.code == 401
    assert mutate.serialize(sent) == sent.SerializeToString()


def _reference(
    headers: Sequence[tuple[str, bytes]],
    remove: Sequence[str],
    clear: bool,
    body: bytes | None,
    namespaces: Sequence[tuple[str, Sequence[tuple[str, str | float]]]],
) -> ProcessingResponse:
    """What ``body_answer``'s arguments mean, built in upb."""
    resp = ProcessingResponse()
    common = resp.request_body.response
    common.SetInParent()
    for key, value in headers:
        option = common.header_mutation.set_headers.add()
        option.header.key = key
        option.header.raw_value = value
        option.append_action = option.OVERWRITE_IF_EXISTS_OR_ADD
    if remove:
        common.header_mutation.remove_headers.extend(remove)
    common.clear_route_cache = clear
    if body is not None:
        common.body_mutation.body = body
    for name, fields in namespaces:
        struct = resp.dynamic_metadata.fields[name].struct_value
        struct.SetInParent()
        for key, v in fields:
            if isinstance(v, str):
                struct.fields[key].string_value = v
            else:
                struct.fields[key].number_value = v
    return resp


values = st.one_of(st.text(max_size=300), st.floats(allow_nan=False))
unique_fields = st.lists(
    st.tuples(st.text(max_size=40), values), max_size=16, unique_by=lambda kv: kv[0]
)


@settings(max_examples=300, deadline=None)
@given(
    headers=st.lists(st.tuples(st.text(max_size=200), st.binary(max_size=300)), max_size=16),
    remove=st.lists(st.text(max_size=50), max_size=8),
    clear=st.booleans(),
    body=st.one_of(st.none(), st.binary(max_size=70_000)),
    namespaces=st.lists(
        st.tuples(st.text(max_size=30), unique_fields), max_size=4, unique_by=lambda ns: ns[0]
    ),
)
def test_any_arguments_encode_what_upb_would(
    headers: list[tuple[str, bytes]],
    remove: list[str],
    clear: bool,
    body: bytes | None,
    namespaces: list[tuple[str, list[tuple[str, str | float]]]],
) -> None:
    sent = speedups.body_answer(headers, remove, clear, body, namespaces)
    assert ProcessingResponse.FromString(sent) == _reference(
        headers, remove, clear, body, namespaces
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([("k", "not bytes")], [], True, None, []), TypeError),
        (([(b"k", b"v")], [], True, None, []), TypeError),
        (([("k", b"v", b"extra")], [], True, None, []), TypeError),
        ((["k"], [], True, None, []), TypeError),
        (({"k": b"v"}, [], True, None, []), TypeError),
        (([], [b"k"], True, None, []), TypeError),
        (([], [], 1, None, []), TypeError),
        (([], [], True, "body", []), TypeError),
        (([], [], True, None, [("ace", [("k", 1)])]), TypeError),  # an int, not a float
        (([], [], True, None, [("ace", [("k", None)])]), TypeError),
        (([], [], True, None, [(1, [])]), TypeError),
        (([], [], True, None, [("\ud800", [])]), UnicodeEncodeError),
        (([("k", b"v")] * 17, [], True, None, []), ValueError),
        (([], ["k"] * 9, True, None, []), ValueError),
        (([], [], True, None, [("n", [])] * 5), ValueError),
        (([], [], True, None, [("n", [("k", "v")] * 17)]), ValueError),
        (([], [], True, None), TypeError),
    ],
)
def test_bad_arguments_raise(args: tuple[object, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        speedups.body_answer(*args)


def test_answers_at_the_limits_still_encode() -> None:
    headers = [(f"h{i}", b"v") for i in range(16)]
    fields: list[tuple[str, str | float]] = [(f"k{i}", float(i)) for i in range(16)]
    namespaces = [(f"n{i}", fields) for i in range(4)]
    sent = speedups.body_answer(headers, ["r"] * 8, False, b"", namespaces)
    assert ProcessingResponse.FromString(sent) == _reference(
        headers, ["r"] * 8, False, b"", namespaces
    )


def test_pods_with_any_key_encode() -> None:
    for pod in (*PODS, Pod("d", "ü" * 300, "10.1.1.1", 1)):
        _same(outcome(pod=pod, would_pick=pod, endpoint=False), False)


@settings(max_examples=300, deadline=None)
@given(
    body=st.one_of(
        st.binary(max_size=64).map(lambda b: b + b"{" + b),
        st.builds(
            lambda ws, rest: b"{" + ws + rest,
            st.sampled_from([b"", b" ", b"\t\r\n ", b"\n"]),
            st.sampled_from([b"}", b'"a":1}', b"", b" }", b"\x00"]),
        ),
    ),
    fields=st.text(max_size=40),
)
def test_splice_is_the_reference_splice(body: bytes, fields: str) -> None:
    """The body's rewrite (processor.rewrite_body): the same bytes as the reference,
    whatever precedes the brace or follows it, any text in the fields."""
    assert speedups.splice(body, fields) == splice_pure(body, fields)


def test_splice_refuses_what_it_cannot_splice() -> None:
    for splice in (speedups.splice, splice_pure):
        with pytest.raises(ValueError):
            splice(b'"no object"', '"k":1')
    with pytest.raises(TypeError):
        speedups.splice("{}", '"k":1')
    with pytest.raises(TypeError):
        speedups.splice(b"{}", b'"k":1')
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate: not UTF-8, as .encode()
        speedups.splice(b"{}", "\ud800")


@settings(max_examples=400, deadline=None)
@given(
    mode=st.sampled_from(list(Mode)),
    action=st.text(max_size=40),
    prefix_key=st.text(max_size=30),
    saved_tokens=st.integers(0, 2**62),
    speedup=st.floats(allow_nan=True, allow_infinity=True),
    pod=st.sampled_from([None, *PODS]),
    would_pick=st.sampled_from([None, *PODS]),
    path=st.one_of(st.none(), st.text(max_size=40)),
    body=st.one_of(st.none(), st.binary(max_size=300)),
    auth=st.one_of(st.none(), st.binary(max_size=80)),
    client_upstream=st.booleans(),
    endpoint=st.booleans(),
    fallbacks=st.lists(st.sampled_from(PODS), max_size=3).map(tuple),
)
def test_any_outcome_is_written_as_upb_would(
    mode: Mode,
    action: str,
    prefix_key: str,
    saved_tokens: int,
    speedup: float,
    pod: Pod | None,
    would_pick: Pod | None,
    path: str | None,
    body: bytes | None,
    auth: bytes | None,
    client_upstream: bool,
    endpoint: bool,
    fallbacks: tuple[Pod, ...],
) -> None:
    """The answer for any outcome, in cluster or endpoint mode (the pod and its
    fallbacks by ip:port, the pod among them or not, an IPv6 host, a name), any speedup
    (nan, inf, -0.0) and any text: the message upb builds from ``changes`` and
    ``metadata``."""
    out = Outcome(
        mode,
        action,
        prefix_key,
        pod,
        would_pick,
        saved_tokens,
        speedup,
        body=body,
        path=path,
        fallbacks=fallbacks,
        endpoint=endpoint,
    )
    out.upstream_auth = auth
    sent = mutate.body_answer(out, client_upstream)
    assert isinstance(sent, bytes)
    assert ProcessingResponse.FromString(sent) == mutate.body_decided(out, client_upstream)
