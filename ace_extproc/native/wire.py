"""The reference for the ``headers`` and ``answer`` pieces: Envoy's request headers
read from upb's parsed message, and the router's fields spliced into a body."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderMap


def header_map(headers: HeaderMap) -> dict[str, str]:
    """Envoy's request headers as a dict: each key to its ``raw_value`` (where Envoy
    1.40 puts values) decoded as latin-1, the last of a repeated key kept."""
    return {h.key: h.raw_value.decode("latin-1") for h in headers.headers}


def splice(body: bytes, fields: str) -> bytes:
    """``fields`` (a JSON object fragment, no braces) inserted after the body's opening
    brace, with a comma unless the object is empty; the client's bytes otherwise as
    they were."""
    start = body.index(b"{") + 1
    first = start
    while body[first : first + 1] in _JSON_SPACE:
        first += 1
    sep = b"" if body[first : first + 1] == b"}" else b","
    # One copy of the client's bytes (join reads the memoryview in place).
    return b"".join((body[:start], fields.encode(), sep, memoryview(body)[start:]))


_JSON_SPACE = (b" ", b"\t", b"\r", b"\n")
