"""The simulated engine's tokenizer and chat template.

Tokenizer: the UTF-8 bytes of the text are cut into 4-byte chunks (the last one
may be shorter) and each chunk becomes the token id
``xxh3_64(chunk) % VOCAB_SIZE``.  Four bytes a token is close to what BPE
tokenizers give on English text, so token counts, block counts and TTFTs come
out realistic; and since a chunk's id depends on nothing but its bytes, two
texts that share a prefix share the tokens of every whole chunk in it, which is
what prefix caching needs.  Special tokens such as ``<|eot_id|>`` are plain
text here (several tokens each); nothing depends on them being single ids.
Ids cannot be turned back into text (there is no ``/detokenize``).

Chat template: in the spirit of Llama 3's.  Each message renders as
``<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`` after one
``<|begin_of_text|>``, tools go into a system block at the start, and the
prompt ends with the assistant header (the generation prompt).  Rendering is a
pure function of the conversation, and an assistant turn renders as the
generation prompt followed by its content, so turn N+1's prompt starts with
turn N's prompt text: multi-turn chats hit the prefix cache like on vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xxhash

VOCAB_SIZE = 128_000  # Llama 3's vocabulary is 128,256 ids; any fixed size works.
BYTES_PER_TOKEN = 4

BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
GENERATION_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n"

_TOOLS_PREAMBLE = (
    "Environment: ipython\n"
    "You have access to the following functions. To call one, reply with a JSON object "
    '{"name": function name, "parameters": {argument name: value}}.\n\n'
)

_hash = xxhash.xxh3_64_intdigest


class TemplateError(ValueError):
    """The conversation cannot be rendered (a malformed message or part)."""


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per 4-byte chunk of its UTF-8 encoding."""
    return encode_utf8(text.encode("utf-8"))


def encode_utf8(data: bytes) -> list[int]:
    """:func:`encode` of text already in UTF-8."""
    return [
        _hash(data[i : i + BYTES_PER_TOKEN]) % VOCAB_SIZE
        for i in range(0, len(data), BYTES_PER_TOKEN)
    ]


def count(text: str) -> int:
    """``len(encode(text))`` without hashing anything."""
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    return -(-size // BYTES_PER_TOKEN)


def render_chat(
    messages: Sequence[Any],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render an OpenAI ``messages`` list (and ``tools``) to the prompt text.

    Raises :class:`TemplateError` naming the offending field when a message is
    not something the OpenAI API accepts.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TemplateError("'messages' must be a list of message objects")
    parts = [BOS]
    start = 0
    if tools:
        if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
            raise TemplateError("'tools' must be a list of tool objects")
        system = _TOOLS_PREAMBLE + "\n\n".join(
            json.dumps(tool, indent=4, ensure_ascii=False) for tool in tools
        )
        # An opening system message joins the tools block, as Llama 3.1's template does.
        if messages and _is_message(messages[0]) and messages[0].get("role") == "system":
            system += "\n\n" + _content(messages[0], 0)
            start = 1
        parts.append(_block("system", system))
    for index in range(start, len(messages)):
        message = messages[index]
        if not _is_message(message):
            raise TemplateError(f"messages[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError(f"messages[{index}].role must be a non-empty string")
        text = _content(message, index)
        if role == "assistant" and message.get("tool_calls"):
            calls = _tool_calls(message["tool_calls"], index)
            text = f"{text}\n{calls}" if text else calls
        # Llama 3.1 calls the tool-result role "ipython".
        parts.append(_block("ipython" if role == "tool" else role, text))
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def _is_message(value: Any) -> bool:
    return isinstance(value, dict)


def _block(role: str, text: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}{EOT}"


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError(f"messages[{index}].content must be a string or a list of parts")
    # Parts are joined with newlines, like vLLM's "string" content format.
    return "\n".join(_part(part, index, i) for i, part in enumerate(content))


def _part(part: Any, index: int, i: int) -> str:
    where = f"messages[{index}].content[{i}]"
    if not isinstance(part, dict):
        raise TemplateError(f"{where} must be an object")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise TemplateError(f"{where}.text must be a string")
        return text
    if kind in ("image_url", "video_url", "audio_url"):
        # A placeholder carrying the URL, so different media give different tokens
        # (vLLM mixes multimodal hashes into the block keys to the same end).
        ref = part.get(kind)
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise TemplateError(f"{where}.{kind}.url must be a string")
        return f"<|{kind.removesuffix('_url')}|>{url}<|/{kind.removesuffix('_url')}|>"
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise TemplateError(f"{where}.input_audio.data must be a string")
        digest = xxhash.xxh3_64_hexdigest(audio["data"])
        return f"<|audio|>{digest}<|/audio|>"
    raise TemplateError(f"{where}.type {kind!r} is not supported")


def _tool_calls(calls: Any, index: int) -> str:
    if not isinstance(calls, list):
        raise TemplateError(f"messages[{index}].tool_calls must be a list")
    rendered = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str):
            raise TemplateError(f"messages[{index}].tool_calls[{i}].function.name is required")
        arguments = function.get("arguments", "{}")
        # OpenAI sends arguments as a JSON string: keep it verbatim so the render
        # is byte-stable; accept an object too.
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        rendered.append(
            f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {arguments}}}'
        )
    return "\n".join(rendered)
