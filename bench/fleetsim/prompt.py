"""What the engine makes of a request body: its prompt tokens and KV block keys.

The body is the one the pod receives (with the router's ``cache_salt``, if any).
A chat renders through the sim's chat template; a completion's prompt string is
used as is.  Tokens are 4-byte chunks of the UTF-8 prompt, so the block keys come
straight from the bytes (``kvcache.text_block_keys``) without tokenizing.  With
LoRA on (``lora_base``), a ``model`` other than the base model names an adapter,
which keys its blocks apart (vLLM's block hashes include the adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ace_extproc.request import CHAT_PATH
from ace_extproc.sim.kvcache import block_hashes, text_block_keys, text_tokens
from ace_extproc.sim.tokenizer import TemplateError, render_chat


class PromptError(ValueError):
    """A body the engine would refuse (vLLM answers 400)."""


class _Body(msgspec.Struct):
    model: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    prompt: Any = None
    add_generation_prompt: bool = True
    cache_salt: str | None = None


_decoder = msgspec.json.Decoder(_Body)


@dataclass(slots=True, frozen=True)
class EnginePrompt:
    tokens: int
    keys: list[int]  # chained keys of the full KV blocks, salt in block 0
    # What the KV events' token ids come from: the UTF-8 text (the sim tokenizer's
    # 4-byte chunks), or the ids a prompt was sent as.
    prompt: bytes | list[int] = b""
    salt: str | None = None  # the cache_salt the engine hashed into block 0
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)


def engine_prompt(
    path: str, body: bytes, block_size: int, lora_base: str | None = None
) -> EnginePrompt:
    """``lora_base``: the base model of an engine run with ``--enable-lora`` (None: LoRA
    off, every ``model`` is the base model's name)."""
    try:
        parsed = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise PromptError(f"bad body: {exc}") from None
    salt = parsed.cache_salt
    model = parsed.model
    adapter = model if lora_base is not None and model and model != lora_base else None
    if path == CHAT_PATH:
        if not parsed.messages:
            raise PromptError("no messages")
        try:
            text = render_chat(
                parsed.messages, parsed.tools, add_generation_prompt=parsed.add_generation_prompt
            )
        except TemplateError as exc:
            raise PromptError(str(exc)) from None
        data = text.encode()
        keys = text_block_keys(data, block_size, salt, adapter)
        return EnginePrompt(text_tokens(data), keys, data, salt, adapter)
    prompt = parsed.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        data = prompt.encode()
        keys = text_block_keys(data, block_size, salt, adapter)
        return EnginePrompt(text_tokens(data), keys, data, salt, adapter)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        try:
            keys = block_hashes(prompt, block_size, salt, adapter)
            return EnginePrompt(len(prompt), keys, prompt, salt, adapter)
        except OverflowError:
            raise PromptError("token ids out of range") from None
    # vLLM would run a list of prompts as separate requests; a workload sends one.
    raise PromptError("prompt must be one non-empty string or list of token ids")
