"""Requests a hostile or careless client might send, generated from a seed so a
failure repeats: bodies mutated from valid chat, completions and native-API requests
(bytes flipped, cut, nested deep, keys escaped or repeated, cache fields forged,
types wrong, text not UTF-8), with paths, methods, content types, keys, overrides
and tenant headers drawn alike. Used in process (tests/test_fuzz.py) and through
Envoy (tests/test_soak.py)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

KEYS = {"key-acme": "acme", "key-globex": "globex"}
PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/execute",
    "/v1/%63hat/completions",
    "//v1//chat/./completions",
    "/v1%2Fchat%2Fcompletions",
    "/v1/chat/completions?stream=true",
    "/v1/chat/completions/",
    "/v1/models",
    "/v1/embeddings",
    "/metrics",
    "/v1/chat/completions/../completions",
)
METHODS = ("POST",) * 12 + ("GET", "PUT", "DELETE")
CONTENT_TYPES = ("application/json",) * 10 + (
    "application/json; charset=utf-8",
    "text/plain",
    "application/x-www-form-urlencoded",
    "",
)
AUTHORIZATION = (
    "Bearer key-acme",
    "Bearer key-globex",
    "Bearer key-acme",
    "Bearer stolen",
    "Basic a2V5LWFjbWU=",
    "Bearer ",
    "bearer key-globex",
    None,
)
OVERRIDES = (
    None,
    None,
    None,
    "prefix_kv_cache=off",
    "prefix_kv_cache=shadow",
    "prefix_kv_cache=prod",
    "prefix_kv_cache=turbo",
    "garbage",
    "=,=",
    "other=1, prefix_kv_cache=off",
)
TENANT_HEADERS = (None, None, "acme", "globex", "../evil", "a" * 200)
MODELS = ("sim-llama", "sim-llama", "other-model", "", None, 7)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def request(self) -> Request:
        r = self.rng
        path = r.choice(PATHS)
        method = r.choice(METHODS)
        headers: dict[str, str] = {}
        content_type = r.choice(CONTENT_TYPES)
        if content_type:
            headers["content-type"] = content_type
        for name, choices in (
            ("authorization", AUTHORIZATION),
            ("x-ace-skill-override", OVERRIDES),
            ("x-tenant-id", TENANT_HEADERS),
        ):
            value = r.choice(choices)
            if value is not None:
                headers[name] = value
        if r.random() < 0.2:
            headers["x-session-id"] = f"s-{r.randrange(50)}"
        if r.random() < 0.05:
            headers["x-ace-upstream"] = r.choice(("ace_pod.sim.pod-0", "127.0.0.1:1", "x" * 300))
        body = b"" if method == "GET" else self.body(path)
        return Request(method, path, headers, body)

    def body(self, path: str) -> bytes:
        r = self.rng
        doc: object
        if "execute" in path:
            doc = {"input": {"messages": self._messages()}, "target": {"model": r.choice(MODELS)}}
        elif "chat" in path or r.random() < 0.5:
            doc = {"model": r.choice(MODELS), "messages": self._messages(), "max_tokens": 2}
        else:
            doc = {"model": r.choice(MODELS), "prompt": self._prompt(), "max_tokens": 2}
        if isinstance(doc, dict) and r.random() < 0.3:
            doc["cache_salt"] = r.choice(("mine", "", None, 5, "a/b", "x" * 300))
        if isinstance(doc, dict) and r.random() < 0.2:
            doc["cache_prefix_id"] = r.choice(("forged", None, {"a": 1}))
        if isinstance(doc, dict) and r.random() < 0.1:
            doc["stream"] = r.choice((True, False, "yes"))
        # Escaped (\\ud800 stays an escape) or raw UTF-8 (a lone surrogate as its bytes).
        raw = json.dumps(doc, ensure_ascii=r.random() < 0.5).encode("utf-8", "surrogatepass")
        return self._mutate(raw)

    def _messages(self) -> object:
        r = self.rng
        roll = r.random()
        if roll < 0.05:
            return r.choice(([], [[1]], "hi", None, [{"content": "no role"}], [{"role": 5}]))
        n = r.randrange(1, 6)
        out = []
        for i in range(n):
            content: object = self._text()
            if r.random() < 0.1:
                content = [{"type": "text", "text": self._text()}]
            if r.random() < 0.03:
                content = [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                ]
            if r.random() < 0.02:
                content = r.choice((5, None, {"x": 1}))
            out.append({"role": ("system", "user", "assistant")[i % 3], "content": content})
        return out

    def _prompt(self) -> object:
        r = self.rng
        return r.choice(
            (
                self._text(),
                [self._text(), self._text()],
                [r.randrange(50000) for _ in range(r.randrange(1, 300))],
                [[1, 2, 3], [4, 5]],
                [],
                "",
                [2**40],
                None,
            )
        )

    def _text(self) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.6:
            return f"topic {r.randrange(40)} " * r.randrange(1, 80)
        if roll < 0.8:
            return "".join(chr(r.randrange(0x20, 0x3000)) for _ in range(r.randrange(1, 200)))
        if roll < 0.9:
            return "\ud800 lone surrogate" if r.random() < 0.5 else "\x00nul\x1ecanon\x1fbreak"
        return "x" * r.randrange(10_000, 200_000)

    def _mutate(self, raw: bytes) -> bytes:
        r = self.rng
        roll = r.random()
        if roll < 0.55:
            return raw
        data = bytearray(raw)
        if roll < 0.65:  # bytes flipped
            for _ in range(r.randrange(1, 6)):
                if data:
                    data[r.randrange(len(data))] = r.randrange(256)
            return bytes(data)
        if roll < 0.72:  # cut short
            return bytes(data[: r.randrange(len(data) + 1)])
        if roll < 0.77:  # nested deep
            depth = r.choice((100, 1000, 10_000))
            return b'{"model": "sim-llama", "x": ' + b"[" * depth + b"]" * depth + b"}"
        if roll < 0.82:  # a key escaped, or a cache field given twice, once escaped
            if r.random() < 0.5:
                return raw.replace(b'"model"', b'"mod\\u0065l"', 1)
            return raw[:-1] + b', "cache\\u005fsalt": "forged", "cache_salt": "again"}'

        if roll < 0.86:  # not UTF-8
            return raw[:-2] + b"\xff\xfe" + raw[-2:]
        if roll < 0.9:  # not JSON at all
            return r.choice(
                (b"", b"   ", b"null", b"[]", b"model=sim-llama", bytes(r.randbytes(64)))
            )
        if roll < 0.94:  # numbers out of any range
            return raw[:-1] + b', "temperature": 1e400, "n": -99999999999999999999}'
        return raw[:-1] + b", " + b'"k": "v", ' * r.randrange(1, 2000) + b'"end": 1}'
