"""The simulated engine's prompt tokens, for the router's precise routing (a
destination's ``tokenizer: sim``): its chat template and its 4-byte tokenizer, as the
sim renders a request itself (``tokenizer.py``)."""

from __future__ import annotations

from typing import Any

import msgspec

from ace_extproc.sim.tokenizer import TemplateError, encode, render_chat


class _Body(msgspec.Struct):
    messages: Any = None
    tools: Any = None
    prompt: Any = None


_decoder = msgspec.json.Decoder(_Body)


class SimTokens:
    name = "sim"

    def token_ids(self, path: str, body: bytes) -> list[int] | None:
        try:
            doc = _decoder.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return None
        if path.endswith("/chat/completions"):
            try:
                return encode(render_chat(doc.messages, doc.tools))
            except (TemplateError, TypeError, ValueError):
                return None
        prompt = doc.prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None
