"""The id of a stored Responses-API answer, read from the answer as it passes
(observe.py), so that later turns naming it can be sent where it is stored
(routing/homes.py).

A non-streamed answer is one JSON object whose top-level ``id`` is the response's;
vLLM writes it first, so it is read as soon as the first bytes arrive, and an answer
that puts it elsewhere is decoded whole at its end (if it fit in ``HEAD_BYTES``). A
streamed one (SSE) opens with ``response.created``, whose ``response.id`` it is; its
data is small (no output yet), so that first event is decoded whole. vLLM stores a
streamed response only once it has finished (its ``response.completed``, or an
``incomplete`` end), so a stream counts as stored only once that event has passed.
The bytes are never changed: this only reads them.
"""

from __future__ import annotations

import re

import msgspec

HEAD_BYTES = 65_536  # what is held of an answer's start while its id is sought
# The terminal event after which vLLM has stored a streamed response (OpenAI's API
# also ends an unfinished one with response.incomplete), as an event line or a data
# object's type: neither can occur inside a JSON string (no raw newline, no raw quote),
# so generated text that says "response.completed" does not end anything.
_END = re.compile(rb'(?:\nevent:[ ]?|"type":[ ]?")response\.(?:completed|incomplete)\b')
_CARRY = 40  # bytes kept across chunks, so an event name split between two is found
# A JSON string (escapes included) right after `{"id":` at the very start of the body.
_LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*("(?:[^"\\]|\\.)*")')


class _Response(msgspec.Struct):
    id: str = ""


class _Event(msgspec.Struct):
    type: str = ""
    response: _Response | None = None


_response = msgspec.json.Decoder(_Response)
_event = msgspec.json.Decoder(_Event)
_string = msgspec.json.Decoder(str)


class StoredId:
    """Fed an answer's body chunk by chunk; ``result`` is its response id once the
    engine has stored it (as far as the bytes tell), else None."""

    __slots__ = ("_done", "_ended", "_head", "_id", "_sse", "_tail")

    def __init__(self) -> None:
        self._head = bytearray()
        self._id = ""
        self._done = False  # the id is known, or will never be
        self._sse: bool | None = None  # not yet known
        self._ended = False  # a stream's terminal event has passed
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if self._sse:
            self._watch_end(chunk)
        if self._done:
            return
        head = self._head
        head += chunk[: HEAD_BYTES - len(head)]
        if self._sse is None:
            start = head.lstrip()[:1]
            if not start:
                return
            self._sse = start != b"{"
            if self._sse:
                self._watch_end(chunk)
        if self._sse:
            self._first_event()
        else:
            found = _LEADING_ID.match(head)
            if found is not None:
                self._id = _unquote(found.group(1))
                self._finish()
        if not self._done and len(head) >= HEAD_BYTES:
            self._finish()  # no id in reach: the answer is not remembered

    def ready(self) -> str | None:
        """The stored response's id as soon as the bytes so far tell it: a JSON answer's
        once its leading id has passed (vLLM stores the response before it answers), a
        stream's once its terminal event has (stored just before it). None: not yet."""
        if not self._done or not self._id:
            return None
        return self._id if not self._sse or self._ended else None

    def result(self) -> str | None:
        """The stored response's id, at the answer's end (None: none, or not stored)."""
        if not self._done and not self._sse and self._head:
            # An id not in front: the whole answer, if it fit.
            try:
                self._id = _response.decode(self._head).id
            except msgspec.DecodeError:  # cut off at HEAD_BYTES, or not JSON
                self._id = ""
            self._finish()
        if self._sse and not self._ended:
            return None  # cut short: vLLM stores a stream only at its end
        return self._id or None

    def _first_event(self) -> None:
        head = bytes(self._head).replace(b"\r\n", b"\n")
        end = head.find(b"\n\n")
        if end < 0:
            return
        data = b"".join(
            line[5:].lstrip() for line in head[:end].split(b"\n") if line.startswith(b"data:")
        )
        try:
            event = _event.decode(data)
        except msgspec.DecodeError:
            event = _Event()
        if event.type == "response.created" and event.response is not None:
            self._id = event.response.id
        self._finish()

    def _watch_end(self, chunk: bytes) -> None:
        if self._ended:
            return
        window = self._tail + chunk
        if _END.search(window) is not None:
            self._ended = True
        self._tail = window[-_CARRY:]

    def _finish(self) -> None:
        self._done = True
        self._head = bytearray()


def _unquote(quoted: bytes) -> str:
    try:
        return _string.decode(quoted)
    except msgspec.DecodeError:
        return ""
