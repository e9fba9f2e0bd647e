"""The OpenAI Responses API (``POST /v1/responses``) as vLLM 0.32 serves it: the request
turned into chat messages (its ``construct_input_messages``), the store a later turn's
``previous_response_id`` is resolved from, and the answer's bodies and stream events.

vLLM keeps stored responses in its serving process, and only with
``VLLM_ENABLE_RESPONSES_API_STORE=1``; without it ``store`` is silently taken as false,
so every ``previous_response_id`` is a 404. A continuation is the stored turn's
messages (its system message dropped: instructions do not carry over), its output as
an assistant message, then the new input, after the new turn's own instructions. The
sim does the same per pod, so a turn that reaches another pod gets vLLM's 404.

Unlike vLLM's, the sim's store is bounded (``STORE_LIMIT``, oldest forgotten first):
vLLM never forgets, which a long benchmark run would pay for in memory.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .protocol import ApiError, dumps

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
STORE_LIMIT = 65_536


def store_enabled(env: dict[str, str] | None = None) -> bool:
    """vLLM's reading of ``VLLM_ENABLE_RESPONSES_API_STORE``: an integer, nonzero on."""
    value = (os.environ if env is None else env).get(STORE_ENV, "0")
    try:
        return bool(int(value))
    except ValueError:
        return False


@dataclass(slots=True)
class Stored:
    """What a later turn needs of a stored response: its conversation and its answer."""

    messages: list[dict[str, Any]]
    output: str


@dataclass(slots=True)
class ResponseStore:
    enabled: bool = False
    entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: Stored) -> None:
        self.entries[response_id] = stored
        if len(self.entries) > STORE_LIMIT:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        """The stored response, or vLLM's 404 for an id this process does not hold."""
        stored = self.entries.get(response_id)
        if stored is None:
            raise ApiError(
                f"Response with id '{response_id}' not found.",
                status=404,
                type="invalid_request_error",
                param="response_id",
            )
        return stored


@dataclass(frozen=True, slots=True)
class ResponsesParams:
    """What the sim uses of a Responses request; the rest is echoed or ignored."""

    messages: list[dict[str, Any]]  # the conversation, as chat messages
    tools: list[dict[str, Any]]  # function tools in chat's shape, for the template
    stream: bool
    store: bool  # asked for; stored only where the store is enabled
    max_tokens: int | None
    response_id: str
    body: dict[str, Any]  # the request, for what the answer echoes


def parse_request(body: dict[str, Any], store: ResponseStore) -> ResponsesParams:
    """The request's conversation (a stored one's first, for a continuation), or a 400
    (a 404 for a previous response this pod does not hold)."""
    given = body.get("input")
    if not isinstance(given, str | list):
        raise ApiError("'input' is required: a string or a list of items", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError("'instructions' must be a string", param="instructions")
    for key in ("stream", "store", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ApiError(f"'{key}' must be a boolean", param=key)
    if body.get("background"):
        raise ApiError("'background' is not supported by the simulated engine", param="background")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise ApiError("'max_output_tokens' must be a positive integer", param="max_output_tokens")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ApiError("'previous_response_id' must be a string", param="previous_response_id")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:  # what this process stored, or the 404
        earlier = store.get(previous)
        messages += [m for m in earlier.messages if m.get("role") != "system"]
        if earlier.output:
            messages.append({"role": "assistant", "content": earlier.output})
    messages += [{"role": "user", "content": given}] if isinstance(given, str) else _items(given)
    request_id = body.get("request_id")
    return ResponsesParams(
        messages,
        _function_tools(body.get("tools")),
        bool(body.get("stream")),
        body.get("store") is not False,
        max_tokens,
        request_id if isinstance(request_id, str) and request_id else _uuid("resp"),
        body,
    )


def _items(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages, as vLLM makes them: a function call joins the
    assistant message before it, a call's output is a tool message."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(f"input[{i}] must be an object", param="input")
        kind = item.get("type")
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
            )
        elif kind == "reasoning":
            continue  # vLLM puts it beside the assistant's content; the template skips it
        elif "role" in item and kind in (None, "message"):
            messages.append(_message(item, i))
        else:
            raise ApiError(f"Unsupported input item type: {kind}", param="input")
    return messages


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role, content = item["role"], item.get("content")
    if role == "assistant" and isinstance(content, list) and content:
        first = content[0]
        text = first.get("text") if isinstance(first, dict) else None
        return {"role": "assistant", "content": text}  # vLLM keeps the first part's text
    if isinstance(content, list):
        content = [_part(part, index) for part in content]
    return {"role": role, "content": content}


def _part(part: Any, index: int) -> Any:
    """A Responses content part as the chat template's: text, or an image by its URL."""
    if not isinstance(part, dict):
        return part  # the template names the offending part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url")}}
    raise ApiError(f"input[{index}]: content part type {kind!r} is not supported", param="input")


def _function_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools in chat's shape (vLLM shows the model those alone)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError("'tools' must be a list", param="tools")
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function":
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": fn})
    return out


# -- answers -------------------------------------------------------------------------


def usage(prompt: int, output: int, cached: int, written: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage``: one turn (no built-in tools)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": written,
            "input_tokens_per_turn": [prompt],
            "cached_tokens_per_turn": [cached],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [output],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": prompt + output,
    }


def output_text(text: str, *, done: bool = True) -> dict[str, Any]:
    logprobs: list[Any] | None = None if done else []
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_message(item_id: str, text: str | None) -> dict[str, Any]:
    """The assistant message item: in progress (``text`` None) or completed."""
    return {
        "id": item_id,
        "content": [] if not text else [output_text(text)],
        "role": "assistant",
        "status": "in_progress" if text is None else "completed",
        "type": "message",
        "phase": None,
    }


def response_object(
    params: ResponsesParams,
    model: str,
    created: int,
    max_tokens: int,
    output: list[dict[str, Any]],
    status: str,
    use: dict[str, Any] | None,
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse`` as it dumps it (every field, in its order)."""
    body = params.body
    tools = body.get("tools") or []
    tool_choice = body.get("tool_choice", "auto")
    if not tools and tool_choice in ("auto", "none"):
        tool_choice = "none"  # vLLM's: no tools, nothing to choose
    return {
        "id": params.response_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": _number(body.get("temperature"), 1.0),
        "tool_choice": tool_choice,
        "tools": tools,
        "top_p": _number(body.get("top_p"), 1.0),
        "background": False,
        "max_output_tokens": max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": None,
        "truncation": body.get("truncation", "disabled"),
        "usage": use,
        "user": body.get("user"),
        "presence_penalty": _number(body.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(body.get("frequency_penalty"), 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _number(value: Any, default: float) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    )


class Events:
    """A streamed answer's SSE events, numbered in order, for one message item."""

    def __init__(self, item: str) -> None:
        self.item = item
        self.seq = 0
        self._part = {"content_index": 0, "item_id": item, "output_index": 0}

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        """One event as vLLM writes it: ``event: <type>`` then the data, whose fields the
        OpenAI types (and so pydantic's dump) hold in alphabetical order."""
        fields = {**payload, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        data = dumps(dict(sorted(fields.items())))
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def opening(self, response: dict[str, Any]) -> bytes:
        """``response.created`` and ``response.in_progress``, before any token."""
        return self.event("response.created", {"response": response}) + self.event(
            "response.in_progress", {"response": response}
        )

    def first(self, piece: str) -> bytes:
        """The message item and its text part opened, with the first token's delta."""
        item = output_message(self.item, None)
        return (
            self.event("response.output_item.added", {"item": item, "output_index": 0})
            + self.event(
                "response.content_part.added", {**self._part, "part": output_text("", done=False)}
            )
            + self.delta(piece)
        )

    def delta(self, piece: str) -> bytes:
        return self.event(
            "response.output_text.delta", {**self._part, "delta": piece, "logprobs": []}
        )

    def closing(self, text: str, response: dict[str, Any]) -> bytes:
        """The text, part and item done, then ``response.completed`` (the whole answer)."""
        part = self._part
        return (
            self.event("response.output_text.done", {**part, "logprobs": [], "text": text})
            + self.event("response.content_part.done", {**part, "part": output_text(text)})
            + self.event(
                "response.output_item.done",
                {"item": output_message(self.item, text), "output_index": 0},
            )
            + self.event("response.completed", {"response": response})
        )


def message_item_id() -> str:
    return _uuid("msg")


def _uuid(prefix: str) -> str:
    """vLLM's ids here: ``resp_…``, ``msg_…`` (an underscore, where chat's use a dash)."""
    return f"{prefix}_{os.urandom(8).hex()}"  # 16 hex digits, as vLLM's random_uuid
