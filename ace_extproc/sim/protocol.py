"""OpenAI request validation, response bodies and errors, as vLLM produces them.

Response bodies carry every field vLLM 0.32 sends, the null ones included, so their
size (what a gateway reads and forwards) is a real engine's.

Validation is by hand on the decoded JSON: it is cheaper than building typed
models and lets each message say which field is wrong.  Unknown fields are
accepted and ignored (vLLM's request models allow extra keys).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .tokenizer import VOCAB_SIZE

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()

# The vLLM release the sim was last checked against, a real pod beside it
# (python -m bench.sim_vs_real; docs/simulator.md).
VERSION = "0.32.0+sim"
SYSTEM_FINGERPRINT = f"vllm-{VERSION}"
MAX_N = 128  # a guard against absurd fan-out; vLLM has no fixed limit
MAX_SALT_CHARS = 128  # vLLM 0.33 (older releases: 1024)
_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


def dumps(value: Any) -> bytes:
    return _encoder.encode(value)


class ApiError(Exception):
    """An error answered with OpenAI's envelope, as vLLM's ``ErrorResponse``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param

    def body(self) -> bytes:
        return dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400."""
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], served: Collection[str]) -> None:
    """404 for a model this pod does not serve (``served``: its names); ``model`` may be
    omitted, as in vLLM."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    if model not in served:
        raise ApiError(
            f"The model `{model}` does not exist.", status=404, type="NotFoundError", param="model"
        )


def validate_cache_salt(value: Any) -> str | None:
    """vLLM 0.33's rules: a string of 1..128 characters without ``@ / \\`` or NUL."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError("'cache_salt' must be a string", param="cache_salt")
    if not 1 <= len(value) <= MAX_SALT_CHARS:
        raise ApiError(
            f"'cache_salt' must be 1 to {MAX_SALT_CHARS} characters long", param="cache_salt"
        )
    if any(ch in value for ch in _SALT_FORBIDDEN):
        raise ApiError(
            "'cache_salt' must not contain '@', '/', '\\' or NUL characters", param="cache_salt"
        )
    return value


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(f"'{key}' must be an integer", param=key)
    if value < minimum:
        raise ApiError(f"'{key}' must be at least {minimum}, got {value}", param=key)
    return value


def _opt_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(f"'{key}' must be a boolean", param=key)
    return value


@dataclass(frozen=True, slots=True)
class GenParams:
    """What the sim uses from a generation request; the rest is ignored."""

    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the server's default
    n: int
    cache_salt: str | None


def parse_gen_params(body: dict[str, Any]) -> GenParams:
    stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise ApiError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        include_usage = bool(_opt_bool(options, "include_usage"))
    # Chat prefers max_completion_tokens; both are accepted on either endpoint.
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = _opt_int(body, "n", 1) or 1
    if n > MAX_N:
        raise ApiError(f"'n' must be at most {MAX_N} on the simulated engine", param="n")
    return GenParams(
        stream, include_usage, max_tokens, n, validate_cache_salt(body.get("cache_salt"))
    )


def parse_messages(body: dict[str, Any]) -> tuple[list[Any], list[Any] | None]:
    """``messages`` and ``tools`` of a chat request (their insides are checked by the template)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError("'messages' is required and must be a list", param="messages")
    if not messages:
        raise ApiError("'messages' must not be empty", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError("'tools' must be a list", param="tools")
    return messages, tools


def _token_ids(value: list[Any], param: str) -> list[int]:
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ApiError(f"'{param}' token ids must be integers", param=param)
        if not 0 <= t < VOCAB_SIZE:
            raise ApiError(f"Token id {t} is out of vocabulary", param=param)
    return value


def parse_prompts(body: dict[str, Any], key: str = "prompt") -> list[str | list[int]]:
    """A completions ``prompt``: a string, a list of strings, token ids, or lists of ids."""
    prompt = body.get(key)
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(isinstance(p, list) for p in prompt):
            prompts = [_token_ids(p, key) for p in prompt]
        else:
            prompts = [_token_ids(prompt, key)]
    else:
        raise ApiError(
            f"'{key}' is required: a string, a list of strings or a list of token ids", param=key
        )
    if any(len(p) == 0 for p in prompts):
        raise ApiError(f"'{key}' must not be empty", param=key)
    return prompts


def fit_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The output tokens a prompt gets, as vLLM 0.32 decides them: a ``max_tokens``
    (asked for, or the default) over the context length, or a prompt over it, is a 400;
    otherwise the answer is cut to the room left (a 200 ending in ``length``), and a
    prompt that leaves no room at all is a 400 about ``max_tokens``."""
    if max_tokens > max_model_len:
        raise ApiError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )
    if prompt_tokens > max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    room = min(max_tokens, max_model_len - prompt_tokens)
    if room < 1:
        raise ApiError(f"max_tokens must be at least 1, got {room}.", param="max_tokens")
    return room


# -- output -------------------------------------------------------------------------------

# Three-letter words: with the leading space each output token is 4 bytes, one
# token of the sim's tokenizer, so the reply re-tokenizes to about max_tokens.
_WORDS = (
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was",
    "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old",
    "see", "two", "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use",
)  # fmt: skip


def filler_piece(i: int) -> str:
    """The text of output token ``i`` (deterministic)."""
    word = _WORDS[i % len(_WORDS)]
    return word if i == 0 else " " + word


def filler_text(tokens: int) -> str:
    return "".join(filler_piece(i) for i in range(tokens))


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(16).hex()}"


def now() -> int:
    return int(time.time())


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    created_tokens: int | None = None,
    *,
    streamed: bool = False,
) -> dict[str, Any]:
    """vLLM 0.32's usage object. ``created_tokens`` (``created_cache_tokens``: the prompt's
    full blocks less the cached ones) is filled on chat only, null on completions; a
    stream's usage chunk leaves out the null fields (and completions' created count)."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }
    if streamed:
        if created_tokens is not None:
            details["created_cache_tokens"] = created_tokens
        return out
    details["created_cache_tokens"] = created_tokens
    details["multimodal_tokens"] = None
    out["completion_tokens_details"] = None
    return out


def chat_response(
    rid: str, model: str, created: int, text: str, n: int, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            for i in range(n)
        ],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": use,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    deltas: Sequence[tuple[int, dict[str, Any], str | None]],
    *,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: ``deltas`` are (choice index, delta, finish_reason); ``role``:
    the opening chunk (vLLM's carries the prompt fields and no ``token_ids``)."""
    choices: list[dict[str, Any]] = []
    for i, delta, finish in deltas:
        choice: dict[str, Any] = {
            "index": i,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = None
        if not role:
            choice["token_ids"] = None
        choices.append(choice)
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if role:
        out["prompt_token_ids"] = None
        out["prompt_text"] = None
    return out


def completion_response(
    rid: str, model: str, created: int, texts: Sequence[str], use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for i, text in enumerate(texts)
        ],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": use,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    rid: str, model: str, created: int, pieces: Sequence[tuple[int, str, str | None]]
) -> dict[str, Any]:
    """One streamed chunk: ``pieces`` are (choice index, text, finish_reason)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
            for i, text, finish in pieces
        ],
    }


def usage_chunk(
    rid: str, obj: str, model: str, created: int, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
