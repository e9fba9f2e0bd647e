"""Request understanding: an OpenAI-style body to a typed request with its prompt
in one canonical byte form.

The canonical form is what prefix hashing sees. It keeps everything that makes up
the engine's prompt (tool definitions, roles, names, text, tool calls and results)
in conversation order, separated by control bytes that cannot occur in JSON text
unescaped, so two requests share a canonical prefix exactly as far as their
conversations agree. Decoding is one typed ``msgspec`` pass (measured faster than
``orjson`` into dicts, and it validates as it goes). Where the native ``prompt``
piece was built (``native/__init__.py``), bodies go through it first: it checks the
JSON and unescapes the text straight into the canonical bytes, and hands anything it
does not handle (an image or audio part, anything invalid) to this path.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import msgspec

from ace_extproc import native

# Separators: record (message), unit (field), group (tools / extras).
_MSG = b"\x1e"
_FIELD = b"\x1f"
_GROUP = b"\x1d"

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
ROUTABLE_PATHS = frozenset((CHAT_PATH, COMPLETIONS_PATH))

# Fields the router owns: a client's value is never trusted or forwarded.
ROUTER_FIELDS = ("cache_salt", "cache_prefix_id")


def canonical_path(raw: str) -> str:
    """A request's ``:path`` as an engine's server matches it, or more loosely: no
    query, percent-escapes decoded (uvicorn serves ``/v1/%63hat/completions`` as the
    chat path), repeated slashes merged, dot segments resolved. Envoy normalizes the
    same way before routing where its config is ours (``normalize_path``); this holds
    where it is not. Erring towards "an API path" only costs a salt on a 404."""
    path = raw.partition("?")[0].partition("#")[0]
    if "%" not in path and "//" not in path and "/." not in path:
        return path
    decoded = unquote(path)
    parts: list[str] = []
    for segment in decoded.split("/"):
        if segment == "..":
            if parts:
                parts.pop()
        elif segment and segment != ".":
            parts.append(segment)
    trailing = decoded.endswith(("/", "/.", "/..")) and parts
    return "/" + "/".join(parts) + ("/" if trailing else "")


class Function(msgspec.Struct):
    name: str = ""
    arguments: str = ""


class ToolCall(msgspec.Struct):
    function: Function
    id: str | None = None
    type: str = "function"


class Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class _RouterFields(msgspec.Struct):
    # UNSET tells "absent" from an explicit null, which must be stripped too.
    cache_salt: Any = msgspec.UNSET
    cache_prefix_id: Any = msgspec.UNSET

    @property
    def has_router_fields(self) -> bool:
        return self.cache_salt is not msgspec.UNSET or self.cache_prefix_id is not msgspec.UNSET


class ChatBody(_RouterFields):
    messages: list[Message] = []
    model: str = ""
    tools: list[msgspec.Raw] | None = None
    stream: bool = False
    stream_options: Any = msgspec.UNSET


class CompletionBody(_RouterFields):
    # str, list[str], list[int] or list[list[int]]: checked in _parse_completion.
    prompt: str | list[Any] | None = None
    model: str = ""
    stream: bool = False
    stream_options: Any = msgspec.UNSET


_chat_decoder = msgspec.json.Decoder(ChatBody)
_completion_decoder = msgspec.json.Decoder(CompletionBody)


# Every RequestError reason: a body the client got wrong (not_utf8 comes from a decode
# error's message). The engine answers these with an error of its own, which says
# nothing of the engine's health (observe.py).
BODY_FAULTS = frozenset(
    {"bad_json", "not_utf8", "not_object", "invalid_body", "empty_body", "empty_prompt"}
)


class RequestError(ValueError):
    """A body the router does not understand; ``reason`` becomes ``bypass_<reason>``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(slots=True)
class ParsedRequest:
    path: str
    model: str
    prompt: bytes  # canonical bytes
    # prompt[:cacheable_end] is the cacheable prefix; None: the prompt's leading full blocks
    cacheable_end: int | None
    has_router_fields: bool  # the client sent cache_salt / cache_prefix_id
    stream: bool
    stream_options: bool = False  # the client chose its own stream_options


# The C parsers by path, where the ``prompt`` piece is native (native/__init__.py).
_native_parsers = (
    {CHAT_PATH: native.chat_prompt, COMPLETIONS_PATH: native.completion_prompt}
    if native.chat_prompt is not None and native.completion_prompt is not None
    else {}
)


# Bodies parsed by the native code and handed to the Python parser (every body the C
# one does not handle, invalid ones included), since start: the metrics export them.
parsed_by = {"native": 0, "python": 0}


def parse(path: str, body: bytes) -> ParsedRequest:
    """Parse a chat or completions body. Raises ``RequestError`` on anything else."""
    fast_parse = _native_parsers.get(path)
    if fast_parse is not None:
        fields = fast_parse(body)
        if fields is not None:
            parsed_by["native"] += 1
            return ParsedRequest(path, *fields)
    parsed_by["python"] += 1
    return parse_pure(path, body)


def parse_pure(path: str, body: bytes) -> ParsedRequest:
    """``parse`` in Python alone: the reference, and the path for every body the
    C parser leaves to it."""
    if not body.strip():
        raise RequestError("empty_body", "request body is empty")
    try:
        if path == CHAT_PATH:
            return _parse_chat(path, _chat_decoder.decode(body))
        return _parse_completion(path, _completion_decoder.decode(body))
    except msgspec.ValidationError as exc:
        if " - at `$" not in str(exc):  # the body itself, not a field of it
            raise RequestError("not_object", "body is JSON but not an object") from None
        raise RequestError("invalid_body", str(exc)) from None
    except msgspec.DecodeError as exc:
        reason = "not_utf8" if "UTF-8" in str(exc) else "bad_json"
        raise RequestError(reason, str(exc)) from None
    except RecursionError:  # nested deeper than the decoder's stack allows
        raise RequestError("bad_json", "JSON is nested too deeply") from None


def _parse_chat(path: str, req: ChatBody) -> ParsedRequest:
    if not req.messages:
        raise RequestError("empty_prompt", "`messages` is missing or empty")
    parts: list[bytes] = []
    add = parts.append
    if req.tools:
        add(_GROUP + b"tools" + _FIELD)
        add(_FIELD.join(bytes(t) for t in req.tools))
    newest_user = -1  # index in parts where the newest user turn starts
    for msg in req.messages:
        if msg.role == "user":
            newest_user = len(parts)
        _add_message(add, msg)
    if newest_user < 0:  # no user turn (e.g. a lone system prompt): all of it is the prefix
        newest_user = len(parts)
    # One join (one copy of the prompt); the prefix's length is summed, not copied.
    head = sum(map(len, parts[:newest_user]))
    return ParsedRequest(
        path,
        req.model,
        b"".join(parts),
        head,
        req.has_router_fields,
        req.stream,
        req.stream_options is not msgspec.UNSET,
    )


def _add_message(add: Callable[[bytes], None], msg: Message) -> None:
    add(_MSG)
    add(msg.role.encode())
    add(_FIELD)
    if msg.name:
        add(msg.name.encode())
        add(_FIELD)
    content = msg.content
    if isinstance(content, str):
        add(content.encode())
    elif content:
        for part in content:
            text = part.get("text")
            if isinstance(text, str):
                add(text.encode())
            else:  # image, audio, file: identified by their JSON (urls, ids, data)
                add(msgspec.json.encode(part, order="sorted"))
            add(_FIELD)
    if msg.tool_calls:
        for call in msg.tool_calls:
            add(_GROUP + call.function.name.encode() + _FIELD + call.function.arguments.encode())
    if msg.tool_call_id:
        add(_GROUP + msg.tool_call_id.encode())


def _parse_completion(path: str, req: CompletionBody) -> ParsedRequest:
    prompt = req.prompt
    if prompt is None or len(prompt) == 0:
        raise RequestError("empty_prompt", "`prompt` is missing or empty")
    if isinstance(prompt, str):
        data = prompt.encode()
    elif all(isinstance(p, str) for p in prompt):
        # A batch of prompts goes to one pod; the first one's prefix leads.
        data = _MSG.join(p.encode() for p in prompt)
    elif _is_tokens(prompt):
        data = _token_bytes(prompt)
    elif all(isinstance(p, list) and p and _is_tokens(p) for p in prompt):
        data = _MSG.join(_token_bytes(p) for p in prompt)
    else:
        raise RequestError(
            "invalid_body", "`prompt` must be a string, strings, token ids or lists of token ids"
        )
    return ParsedRequest(
        path,
        req.model,
        data,
        None,
        req.has_router_fields,
        req.stream,
        req.stream_options is not msgspec.UNSET,
    )


def _is_tokens(items: list[Any]) -> bool:
    return all(type(t) is int for t in items)


def _token_bytes(tokens: list[int]) -> bytes:
    # Token ids as 4-byte ints (the ~4 bytes a token of text), so blocks fall on
    # token boundaries; array does the loop in C.
    try:
        return array("i", tokens).tobytes()
    except OverflowError:
        raise RequestError("invalid_body", "`prompt` holds a token id out of range") from None
