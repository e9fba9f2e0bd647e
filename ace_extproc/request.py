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

The Responses API (``/v1/responses``) is read into the same canonical form, item by
item as vLLM turns its input into chat messages, so a conversation sent either way
shares its prefix key where the engine's prompt would be the same: ``instructions``
is the system message, a string ``input`` one user message, message items their
role and content (``input_text``/``output_text`` parts read as chat's ``text`` parts),
a ``function_call`` joins the assistant message before it as a tool call, and a
``function_call_output`` is a tool message. What differs: Responses tools are flat
(``{"type": "function", "name": ...}``) where chat nests them under ``function``, so
a conversation with tools keys differently in each API; media parts are keyed by
their JSON, which differs between the APIs; and item kinds chat has no word for
(reasoning, references to stored items) are keyed by their JSON as they came. A
turn that names a ``previous_response_id`` carries only its new input: the engine
prepends the stored conversation, which the router never sees, so such a turn is
pinned to the pod that stored it rather than routed by its prefix (processor.py).
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
_ASSISTANT = _MSG + b"assistant" + _FIELD

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
ROUTABLE_PATHS = frozenset((CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH))

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


class ResponsesBody(_RouterFields):
    # A string or a list of items, each read on its own (_add_items): a kind the
    # router does not know is keyed by its bytes as they came.
    input: str | list[msgspec.Raw] | None = None
    instructions: str | None = None
    model: str | None = ""  # vLLM's fields may be null where chat's may not
    tools: list[msgspec.Raw] | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True  # vLLM's default, as OpenAI's


class ResponsesItem(msgspec.Struct):
    """What the router reads of one Responses input item (the rest is ignored)."""

    type: str | None = None  # absent on an "easy" message: {role, content}
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    name: str = ""
    namespace: str | None = None
    arguments: str = ""  # function_call
    input: str = ""  # custom_tool_call
    call_id: str = ""
    output: str | list[dict[str, Any]] | None = None  # *_call_output


_chat_decoder = msgspec.json.Decoder(ChatBody)
_completion_decoder = msgspec.json.Decoder(CompletionBody)
_responses_decoder = msgspec.json.Decoder(ResponsesBody)
_item_decoder = msgspec.json.Decoder(ResponsesItem)


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
    # Responses API: the stored response this turn continues, and whether the engine
    # is asked to store this one (store defaults to true there; never elsewhere).
    previous_response_id: str | None = None
    stored: bool = False


def continues(prompt: bytes) -> bool:
    """Whether a canonical prompt carries earlier turns of its conversation (an
    assistant message): a later request of its session, wherever the first went."""
    return _ASSISTANT in prompt


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
        if path == RESPONSES_PATH:
            return _parse_responses(path, _responses_decoder.decode(body))
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


def _parse_responses(path: str, req: ResponsesBody) -> ParsedRequest:
    given = req.input
    if given is None:
        raise RequestError("empty_prompt", "`input` is missing")
    continued = req.previous_response_id
    if not given and continued is None:  # a continuation's input may be empty
        raise RequestError("empty_prompt", "`input` is empty")
    parts: list[bytes] = []
    add = parts.append
    if req.tools:
        add(_GROUP + b"tools" + _FIELD)
        add(_FIELD.join(bytes(t) for t in req.tools))
    if req.instructions:  # vLLM's system message, first
        _add_message(add, Message("system", req.instructions))
    if isinstance(given, str):
        newest_user = len(parts)
        _add_message(add, Message("user", given))
    else:
        newest_user = _add_items(add, parts, given)
    if newest_user < 0:
        newest_user = len(parts)
    head = sum(map(len, parts[:newest_user]))
    return ParsedRequest(
        path,
        req.model or "",
        b"".join(parts),
        head,
        req.has_router_fields,
        bool(req.stream),
        False,  # Responses streams carry their usage anyway (response.completed)
        continued,
        req.store is not False,
    )


def _add_items(add: Callable[[bytes], None], parts: list[bytes], items: list[msgspec.Raw]) -> int:
    """The items' canonical bytes, as vLLM makes chat messages of them; returns where
    in ``parts`` the newest user message starts (-1: none)."""
    newest_user = -1
    in_assistant = False  # the last record is an assistant message a tool call may join
    for i, raw in enumerate(items):
        try:
            item = _item_decoder.decode(raw)
        except msgspec.ValidationError as exc:  # a field of the body: not "not an object"
            raise RequestError("invalid_body", f"`input[{i}]`: {exc}") from None
        kind = item.type
        if item.role is not None and kind in (None, "message"):
            content = item.content
            if item.role == "user":
                newest_user = len(parts)
            elif item.role == "assistant" and isinstance(content, list) and content:
                # vLLM keeps an assistant item's first part's text, as a string.
                text = content[0].get("text")
                content = text if isinstance(text, str) else content
            _add_message(add, Message(item.role, content))
            in_assistant = item.role == "assistant"
        elif kind in ("function_call", "custom_tool_call"):
            if not in_assistant:  # a call of its own: an assistant message without content
                add(_MSG + b"assistant" + _FIELD)
            name = f"{item.namespace}__{item.name}" if item.namespace else item.name  # qualified
            arguments = item.arguments if kind == "function_call" else item.input
            add(_GROUP + name.encode() + _FIELD + arguments.encode())
            in_assistant = True
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _add_message(add, Message("tool", item.output, tool_call_id=item.call_id))
            in_assistant = False
        else:  # reasoning, item references, built-in tools' calls: keyed as they came
            add(_MSG + (kind or "item").encode() + _FIELD + bytes(raw))
            in_assistant = False
    return newest_user


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
