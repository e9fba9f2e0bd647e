"""The native API, ``POST /v1/execute``: an envelope in, a chat completion for the
engine, the engine's answer back in an envelope with the router's trace.

In::

    {"input": {"messages": [...], ...chat parameters},
     "target": {"model": "..."},
     "skill_overrides": {"prefix_kv_cache": {"mode": "prod" | "shadow" | "off"}}}

Out (the engine's status kept)::

    {"output": <the completion>, "trace": [{"skill": "prefix_kv_cache", ...}]}
    {"output": null, "error": <the engine's error>, "status": 4xx/5xx, "trace": [...]}

An invalid envelope gets a 400 whose error names the field (``param``). Streaming
is refused: an envelope around a token stream is not a JSON document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ace_extproc.config import Mode

PATH = "/v1/execute"
SKILL = "prefix_kv_cache"

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class EnvelopeError(ValueError):
    """An envelope that cannot become a chat completion; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param

    def body(self) -> bytes:
        return error_body(str(self), 400, "invalid_request_error", self.param)


def error_body(message: str, code: int, kind: str, param: str | None = None) -> bytes:
    """An OpenAI-style error document."""
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def to_chat(body: bytes) -> tuple[bytes, Mode | None]:
    """The chat completion body for the engine, and the mode the envelope asks for."""
    try:
        envelope = _decode(body)
    except msgspec.DecodeError as exc:
        raise EnvelopeError("body", f"not valid JSON ({exc})") from None
    except RecursionError:  # nested deeper than the decoder's stack allows
        raise EnvelopeError("body", "JSON nested too deeply") from None
    if not isinstance(envelope, dict):
        raise EnvelopeError("body", "expected a JSON object")
    chat = _field(envelope, "input", dict)
    messages = chat.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EnvelopeError("input.messages", "expected a non-empty list of messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise EnvelopeError("input.messages", "each message must be an object with a role")
    if chat.get("stream"):
        raise EnvelopeError("input.stream", "streaming is not available through /v1/execute")
    model = _field(_field(envelope, "target", dict), "model", str, where="target.")
    if not model:
        raise EnvelopeError("target.model", "expected a model name")
    mode = None
    overrides = envelope.get("skill_overrides")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise EnvelopeError("skill_overrides", "expected an object")
        skill = overrides.get(SKILL)
        if skill is not None:
            if not isinstance(skill, dict):
                raise EnvelopeError(f"skill_overrides.{SKILL}", "expected an object")
            if "mode" in skill:
                try:
                    mode = Mode(skill["mode"])
                except ValueError:
                    raise EnvelopeError(
                        f"skill_overrides.{SKILL}.mode",
                        f"expected one of {', '.join(m.value for m in Mode)}",
                    ) from None
    return _encode({**chat, "model": model}), mode


def _field(obj: dict[str, Any], name: str, kind: type, where: str = "") -> Any:
    value = obj.get(name)
    if not isinstance(value, kind):
        expected = "an object" if kind is dict else "a string"
        raise EnvelopeError(where + name, f"expected {expected}")
    return value


def trace(
    mode: str, action: str, prefix_key: str, saved_tokens: int, speedup: float
) -> dict[str, Any]:
    return {
        "skill": SKILL,
        "mode": mode,
        "action": action,
        "prefix_key": prefix_key,
        "saved_prefill_tokens": saved_tokens,
        "estimated_ttft_speedup": round(speedup, 2),
    }


def wrap(status: int, body: bytes, entry: dict[str, Any]) -> bytes:
    """The engine's answer (or Envoy's own error reply) as the envelope."""
    try:
        answer: Any = _decode(body) if body else None
    except (msgspec.DecodeError, RecursionError):
        answer = body.decode("utf-8", "replace")  # e.g. Envoy's plain-text 503
    if status < 400:
        return _encode({"output": answer, "trace": [entry]})
    if isinstance(answer, dict) and "error" in answer:
        answer = answer["error"]
    return _encode({"output": None, "error": answer, "status": status, "trace": [entry]})
