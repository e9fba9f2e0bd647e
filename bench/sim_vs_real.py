"""The simulated engine against a real vLLM: the same requests to both, item by item.

    python -m bench.sim_vs_real [--out bench/results/sim-vs-real.json] [--workdir DIR]

Starts one real vLLM pod (``vllm_pods``: the CPU build and the tiny model, from ``make
engines``) and one ``ace-extproc sim`` configured like it (``engine_pair``), sends both the
same requests and records every item as ``same`` or ``differs``, with both values:

* **shapes**: recursive key sets and JSON types of chat and text completions, their
  streamed chunks (first, content, last, the usage chunk), ``/v1/models``, ``/tokenize``,
  ``/v1/chat/completions/render``, ``/health``, ``/version``;
* **headers**: names (less the transport ones) and content types;
* **metrics**: the series the router and the benchmarks read (``routing/metrics_text.py``,
  ``bench/live.py``, ``bench/overhead.py``), their types and label keys;
  ``vllm:cache_config_info``'s labels; the ``vllm:`` names only one side has; and whether
  the cache counters move by the cached tokens the answers report;
* **errors**: status and envelope of bad requests;
* **cached tokens**: repeats, shared prefixes, ``cache_salt``, block boundaries, a later
  turn, ``/reset_prefix_cache``.

The two tokenizers differ (the sim cuts 4 bytes a token, the tiny model is a BPE), so
the same *text* has different token counts: text items compare each engine's cached
tokens with its own ``prompt_tokens`` (the rule: whole blocks, never the last token).
Prompts given as token ids are the same on both, and those items compare values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ace_extproc.vllm_pods import BLOCK_SIZE, MAX_MODEL_LEN, EnginesMissing
from bench import record
from bench.engine_pair import pair
from bench.parity import expected_cached, exposition, labels_of, shape, shape_diff, value

OUT = Path("bench/results/sim-vs-real.json")
MODEL = "sim-llama"  # the workloads' name; the real pod serves it as an alias of "tiny"
# Every vllm: series something of ours reads: routing/metrics_text.py (the router),
# bench/live.py (cross-checks), bench/overhead.py (request_success_total).
READ_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:cache_config_info",
    "vllm:request_success_total",
    "process_start_time_seconds",
)
# Labels the router needs on cache_config_info (the KV size), and others worth seeing.
CACHE_CONFIG_SHOWN = (
    "block_size",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "engine",
)
TRANSPORT = frozenset({"date", "server", "content-length", "transfer-encoding", "connection"})
# The sim's own debug additions (sim/app.py): set aside before comparing, listed once.
SIM_ONLY_FIELDS = frozenset({"sim_ttft_ms"})
SIM_ONLY_HEADERS = frozenset({"x-sim-pod"})
VOCAB = (10, 7990)  # token ids valid for both vocabularies (the tiny model has 8,000)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any  # parsed JSON, else the text
    events: list[Any] = field(default_factory=list)  # SSE data payloads ("[DONE]" kept)


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, raw: bytes | None = None
) -> Reply:
    kw: dict[str, Any] = {}
    if raw is not None:
        kw = {"data": raw, "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    async with http.request(method, url, **kw) as resp:
        text = await resp.text()
        headers = {k.lower(): v for k, v in resp.headers.items()}
    events: list[Any] = []
    if headers.get("content-type", "").startswith("text/event-stream"):
        for block in text.split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
        return Reply(resp.status, headers, text, events)
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = text
    return Reply(resp.status, headers, parsed)


class Pair:
    """The two engines, and the items recorded so far."""

    def __init__(self, http: aiohttp.ClientSession, sim: str, real: str) -> None:
        self.http, self.urls = http, {"sim": sim, "real": real}
        self.items: list[dict[str, Any]] = []
        self.sim_only: set[str] = set()  # debug fields and headers seen on the sim

    async def both(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> tuple[Reply, Reply]:
        """The same request to the sim, then to the real pod."""
        sim = await _call(self.http, method, self.urls["sim"] + path, body, raw)
        real = await _call(self.http, method, self.urls["real"] + path, body, raw)
        return sim, real

    async def each(
        self, fn: Callable[[str], Awaitable[Any]]
    ) -> tuple[Any, Any]:  # an engine-specific sequence, run on both
        return await fn(self.urls["sim"]), await fn(self.urls["real"])

    def record(
        self, category: str, name: str, same: bool, sim: Any, real: Any, note: str = ""
    ) -> None:
        item = {"category": category, "name": name, "verdict": "same" if same else "differs"}
        item.update(sim=sim, real=real)
        if note:
            item["note"] = note
        self.items.append(item)

    def shapes(self, name: str, sim: Any, real: Any) -> None:
        if isinstance(sim, dict) and SIM_ONLY_FIELDS & set(sim):
            self.sim_only |= SIM_ONLY_FIELDS & set(sim)
            sim = {k: v for k, v in sim.items() if k not in SIM_ONLY_FIELDS}
        diff = shape_diff(shape(sim), shape(real))
        note = "; ".join(diff[:40]) + (f" (+{len(diff) - 40} more)" if len(diff) > 40 else "")
        self.record("shape", name, not diff, shape(sim), shape(real), note)

    def headers(self, name: str, sim: Reply, real: Reply) -> None:
        ct = sim.headers.get("content-type"), real.headers.get("content-type")
        self.record("header", f"content-type: {name}", ct[0] == ct[1], ct[0], ct[1])
        self.sim_only |= SIM_ONLY_HEADERS & set(sim.headers)
        names = [sorted(set(r.headers) - TRANSPORT - SIM_ONLY_HEADERS) for r in (sim, real)]
        self.record("header", f"names: {name}", names[0] == names[1], names[0], names[1])


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _usage(reply: Reply) -> dict[str, Any]:
    body = reply.body if not reply.events else _usage_event(reply.events)
    use = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(use, dict):
        raise RuntimeError(f"no usage: HTTP {reply.status}: {str(reply.body)[:300]}")
    return use


def _usage_event(events: list[Any]) -> dict[str, Any]:
    """The streamed chunk that carries the usage ({} if none does)."""
    for event in reversed(events):
        if isinstance(event, dict) and "usage" in event:
            return event
    return {}


def _cached(reply: Reply) -> int:
    return int(_usage(reply)["prompt_tokens_details"]["cached_tokens"])


def _prompt(reply: Reply) -> int:
    return int(_usage(reply)["prompt_tokens"])


# -- shapes and headers ---------------------------------------------------------------------

HELLO = [{"role": "user", "content": "Hello, how are you?"}]


async def shapes(p: Pair) -> None:
    chat: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": 4}
    text: dict[str, Any] = {"model": MODEL, "prompt": "Hello there, friend", "max_tokens": 4}
    s, r = await p.both("POST", "/v1/chat/completions", chat)
    p.shapes("chat completion", s.body, r.body)
    p.headers("chat completion", s, r)
    p.record(
        "value",
        "answer's model (asked for sim-llama)",
        s.body["model"] == r.body["model"],
        s.body["model"],
        r.body["model"],
    )
    s, r = await p.both("POST", "/v1/completions", text)
    p.shapes("text completion", s.body, r.body)
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for name, path, body in (
        ("chat", "/v1/chat/completions", chat),
        ("text", "/v1/completions", text),
    ):
        s, r = await p.both("POST", path, {**body, **usage})
        p.headers(f"{name} stream", s, r)
        for part, pick in _STREAM_PARTS.items():
            if name == "text" and part == "role chunk":
                continue
            p.shapes(f"{name} stream: {part}", pick(s.events), pick(r.events))
        p.record("value", f"{name} stream: ends with [DONE]", True, s.events[-1], r.events[-1])
        p.items[-1]["verdict"] = "same" if s.events[-1] == r.events[-1] == "[DONE]" else "differs"
        s, r = await p.both("POST", path, {**body, "stream": True})
        has = [any(isinstance(e, dict) and "usage" in e for e in x.events) for x in (s, r)]
        p.record(
            "value",
            f"{name} stream without include_usage: any usage",
            has[0] == has[1],
            has[0],
            has[1],
        )
    for path in ("/v1/models", "/version"):
        s, r = await p.both("GET", path)
        p.shapes(path, s.body, r.body)
        p.headers(path, s, r)
    s, r = await p.both("GET", "/version")
    p.record("value", "/version", s.body == r.body, s.body, r.body)
    s, r = await p.both("GET", "/health")
    p.record(
        "value",
        "/health status and body",
        (s.status, s.body) == (r.status, r.body),
        [s.status, s.body],
        [r.status, r.body],
    )
    p.headers("/health", s, r)
    for name, body in (("prompt", {"model": MODEL, "prompt": "Hello"}), ("messages", chat)):
        s, r = await p.both("POST", "/tokenize", body)
        p.shapes(f"/tokenize ({name})", s.body, r.body)
    for path in ("/v1/chat/completions/render", "/v1/completions/render"):
        body = chat if "chat" in path else text
        s, r = await p.both("POST", path, body)
        p.record(
            "value",
            f"{path} status",
            s.status == r.status,
            s.status,
            r.status,
            "" if s.status == r.status else f"real: {r.body}",
        )
        if s.status == r.status == 200:
            p.shapes(path, s.body, r.body)


def _content_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


_STREAM_PARTS: dict[str, Callable[[list[Any]], Any]] = {
    "role chunk": lambda ev: _content_chunks(ev)[0],
    "content chunk": lambda ev: _content_chunks(ev)[1],
    "last content chunk": lambda ev: _content_chunks(ev)[-1],
    "usage chunk": lambda ev: _usage_event(ev),
}


# -- metrics ----------------------------------------------------------------------------


async def metrics(p: Pair) -> None:
    s, r = await p.both("GET", "/metrics")
    p.headers("/metrics", s, r)
    fams = exposition(s.body), exposition(r.body)
    for name in READ_METRICS:
        got = [
            {"type": f[name].type, "label_keys": sorted(f[name].label_keys)} if name in f else None
            for f in fams
        ]
        p.record("metric", name, got[0] == got[1], got[0], got[1])
    info = [labels_of(f, "vllm:cache_config_info") for f in fams]
    keys = [sorted(i) for i in info]
    missing = sorted(set(keys[1]) - set(keys[0]))
    p.record(
        "metric",
        "vllm:cache_config_info label keys",
        keys[0] == keys[1],
        keys[0],
        keys[1],
        f"only real: {', '.join(missing)}" if missing else "",
    )
    for label in CACHE_CONFIG_SHOWN:
        vals = [i.get(label) for i in info]
        p.record("metric", f"vllm:cache_config_info {label}", vals[0] == vals[1], vals[0], vals[1])
    names = [{n for n in f if n.startswith("vllm:")} for f in fams]
    p.record(
        "metric",
        "vllm: sample names only one side has",
        names[0] == names[1],
        sorted(names[0] - names[1]),
        sorted(names[1] - names[0]),
        f"{len(names[0] & names[1])} in both",
    )


# -- errors -----------------------------------------------------------------------------

_MSGS = [{"role": "user", "content": "hi"}]
CONTEXT = MAX_MODEL_LEN  # both pods' max_model_len
_LONG_TEXT = [{"role": "user", "content": "hello " * 80_000}]  # over the context on both
# (name, method, path, JSON body or raw bytes). Token-id prompts size exactly on both.
ERRORS: list[tuple[str, str, str, Any]] = [
    ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": _MSGS}),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}),
    ("bad JSON", "POST", "/v1/chat/completions", b"{not json"),
    ("body not an object", "POST", "/v1/chat/completions", b"[1, 2]"),
    ("max_tokens over max_model_len", "POST", "/v1/chat/completions",
     {"messages": _MSGS, "max_tokens": CONTEXT + 8_000}),
    ("prompt + max_tokens over max_model_len (8 ids short + 100)", "POST", "/v1/completions",
     {"prompt": [5] * (CONTEXT - 8), "max_tokens": 100}),
    ("prompt of exactly max_model_len", "POST", "/v1/completions",
     {"prompt": [5] * CONTEXT, "max_tokens": 4}),
    ("prompt over max_model_len (8,000 ids over)", "POST", "/v1/completions",
     {"prompt": [5] * (CONTEXT + 8_000)}),
    ("chat prompt over max_model_len", "POST", "/v1/chat/completions", {"messages": _LONG_TEXT}),
    ("negative max_tokens", "POST", "/v1/chat/completions", {"messages": _MSGS, "max_tokens": -1}),
    ("zero max_tokens", "POST", "/v1/chat/completions", {"messages": _MSGS, "max_tokens": 0}),
    ("cache_salt not a string", "POST", "/v1/chat/completions",
     {"messages": _MSGS, "cache_salt": 7}),
    ("empty cache_salt", "POST", "/v1/chat/completions", {"messages": _MSGS, "cache_salt": ""}),
    ("cache_salt with '/'", "POST", "/v1/chat/completions",
     {"messages": _MSGS, "cache_salt": "a/b"}),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     {"messages": _MSGS, "stream_options": {"include_usage": True}}),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}),
    ("empty prompt list", "POST", "/v1/completions", {"prompt": []}),
    ("missing prompt", "POST", "/v1/completions", {}),
    ("model not a string", "POST", "/v1/completions", {"prompt": "x", "model": 5}),
    ("token id out of the tiny model's vocabulary", "POST", "/v1/completions",
     {"prompt": [99_999], "max_tokens": 1}),
    ("/tokenize without prompt or messages", "POST", "/tokenize", {}),
    ("unknown route (POST)", "POST", "/v1/nothing", {}),
    ("unknown route (GET)", "GET", "/nothing", None),
    ("wrong method (GET a POST route)", "GET", "/v1/chat/completions", None),
]  # fmt: skip


def _envelope(reply: Reply) -> dict[str, Any]:
    err = reply.body.get("error") if isinstance(reply.body, dict) else None
    if isinstance(err, dict):
        return {"type": err.get("type"), "param": err.get("param"), "code": err.get("code")}
    return {"body": reply.body if isinstance(reply.body, dict) else str(reply.body)[:80]}


async def errors(p: Pair) -> None:
    for name, method, path, body in ERRORS:
        raw = body if isinstance(body, bytes) else None
        s, r = await p.both(method, path, None if raw else body, raw)
        p.record("error status", name, s.status == r.status, s.status, r.status)
        if s.status >= 400 or r.status >= 400:
            env = _envelope(s), _envelope(r)
            same = shape(s.body) == shape(r.body) and env[0].get("type") == env[1].get("type")
            p.record("error body", name, same and env[0] == env[1], env[0], env[1])


# -- cached tokens ----------------------------------------------------------------------


def _rule(reply: Reply) -> dict[str, int]:
    """An engine's repeat, against the rule: whole blocks, never the last token."""
    n = _prompt(reply)
    return {"prompt_tokens": n, "cached": _cached(reply), "rule": expected_cached(n, BLOCK_SIZE)}


async def _post(url: str, path: str, body: Any, http: aiohttp.ClientSession) -> Reply:
    reply = await _call(http, "POST", url + path, body)
    if reply.status != 200:
        raise RuntimeError(f"{url}{path}: HTTP {reply.status}: {str(reply.body)[:300]}")
    return reply


async def cached_ids(p: Pair, rng: random.Random) -> None:
    """Prompts as token ids: the same tokens on both, so values compare directly."""
    for n in (31, 32, 33, 63, 64, 65, 96, 4000, 4096):
        body = {"model": MODEL, "prompt": _ids(rng, n), "max_tokens": 1}
        first = await p.both("POST", "/v1/completions", body)
        again = await p.both("POST", "/v1/completions", body)
        got = [[_prompt(a), _cached(f), _cached(a)] for f, a in zip(first, again, strict=True)]
        p.record(
            "cached",
            f"ids: {n} tokens twice [prompt, first, repeat]",
            got[0] == got[1],
            got[0],
            got[1],
            f"rule: {expected_cached(n, BLOCK_SIZE)}",
        )
    shared, a_tail, b_tail = _ids(rng, 3000), _ids(rng, 500), _ids(rng, 700)
    await p.both("POST", "/v1/completions", {"prompt": shared + a_tail, "max_tokens": 1})
    s, r = await p.both("POST", "/v1/completions", {"prompt": shared + b_tail, "max_tokens": 1})
    p.record(
        "cached",
        "ids: 3,700 tokens sharing 3,000 with an earlier prompt",
        _cached(s) == _cached(r),
        _cached(s),
        _cached(r),
        f"rule: {expected_cached(3700, BLOCK_SIZE, 3000)}",
    )
    body = {"prompt": _ids(rng, 1000), "max_tokens": 1, "cache_salt": "tenant-a"}
    await p.both("POST", "/v1/completions", body)
    outcomes = []
    for variant in (
        body,
        {**body, "cache_salt": "tenant-b"},
        {k: v for k, v in body.items() if k != "cache_salt"},
    ):
        outcomes.append(await p.both("POST", "/v1/completions", variant))
    got = [[_cached(o[i]) for o in outcomes] for i in (0, 1)]
    p.record(
        "cached",
        "ids: 1,000 tokens salted A, then [A again, salt B, no salt]",
        got[0] == got[1],
        got[0],
        got[1],
    )
    metric_deltas = await _counter_deltas(p, rng)
    p.record(
        "cached",
        "counters move by the reported tokens",
        metric_deltas[0]["consistent"] == metric_deltas[1]["consistent"] is True,
        metric_deltas[0],
        metric_deltas[1],
    )


_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_cached_total",
)


async def _counter_deltas(p: Pair, rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"prompt": _ids(rng, 2000), "max_tokens": 1}

    async def run(url: str) -> dict[str, Any]:
        async def counters() -> dict[str, float]:
            reply = await _call(p.http, "GET", url + "/metrics")
            fams = exposition(reply.body)
            return {n: value(fams, n) or 0.0 for n in _COUNTERS}

        before = await counters()
        replies = [await _post(url, "/v1/completions", body, p.http) for _ in range(2)]
        after = await counters()
        delta = {n.removeprefix("vllm:"): after[n] - before[n] for n in _COUNTERS}
        prompt = sum(_prompt(x) for x in replies)
        cached = sum(_cached(x) for x in replies)
        delta["consistent"] = (
            delta["prefix_cache_queries_total"] == delta["prompt_tokens_total"] == prompt
            and delta["prefix_cache_hits_total"] == delta["prompt_tokens_cached_total"] == cached
        )
        return delta

    return await p.each(run)


def _words(rng: random.Random, n: int) -> str:
    vocab = (
        "return",
        "value",
        "self",
        "import",
        "class",
        "def",
        "None",
        "list",
        "item",
        "data",
        "path",
        "error",
        "result",
        "config",
        "request",
        "token",
        "block",
    )
    return " ".join(rng.choice(vocab) for _ in range(n))


async def _tokens(url: str, http: aiohttp.ClientSession, body: dict[str, Any]) -> list[int]:
    reply = await _post(url, "/tokenize", {"model": MODEL, **body}, http)
    return list(reply.body["tokens"])


async def cached_text(p: Pair, rng: random.Random) -> None:
    """Text prompts: token counts differ, so each engine against its own prompt_tokens."""
    doc = _words(rng, 3600)  # about 4,000 tokens on both tokenizers
    chat: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "first?"}],
        "max_tokens": 1,
    }
    await p.both("POST", "/v1/chat/completions", chat)
    s, r = await p.both("POST", "/v1/chat/completions", chat)
    got = _rule(s), _rule(r)
    p.record(
        "cached",
        "chat: ~4,000 tokens twice (repeat vs own rule)",
        all(g["cached"] == g["rule"] for g in got),
        got[0],
        got[1],
    )
    later = {**chat, "messages": [*chat["messages"][:1], {"role": "user", "content": "second?"}]}

    async def shared(url: str) -> dict[str, int]:
        a = await _tokens(url, p.http, {"messages": chat["messages"]})
        b = await _tokens(url, p.http, {"messages": later["messages"]})
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        reply = await _post(url, "/v1/chat/completions", later, p.http)
        return {
            "prompt_tokens": _prompt(reply),
            "common_prefix": common,
            "cached": _cached(reply),
            "rule": expected_cached(_prompt(reply), BLOCK_SIZE, common),
        }

    got = await p.each(shared)
    p.record(
        "cached",
        "chat: same system text, another question (vs own rule)",
        all(g["cached"] == g["rule"] for g in got),
        got[0],
        got[1],
    )
    salted = [
        await p.both("POST", "/v1/chat/completions", {**chat, "cache_salt": salt})
        for salt in ("s1", "s2")
    ]
    got2 = [[_cached(x[i]) for x in salted] for i in (0, 1)]
    p.record(
        "cached",
        "chat: the repeated prompt with new salts s1, s2",
        got2[0] == got2[1] == [0, 0],
        got2[0],
        got2[1],
    )

    async def boundary(url: str) -> dict[str, int]:
        base = _words(random.Random(7), 200)
        for extra in range(200):  # grow until the prompt is whole blocks by its tokenizer
            prompt = base + " z" * extra
            n = len(await _tokens(url, p.http, {"prompt": prompt}))
            if n % BLOCK_SIZE == 0:
                break
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        await _post(url, "/v1/completions", body, p.http)
        return _rule(await _post(url, "/v1/completions", body, p.http))

    got = await p.each(boundary)
    p.record(
        "cached",
        "text: a prompt of exactly k blocks twice (vs own rule)",
        all(g["cached"] == g["rule"] and g["prompt_tokens"] % BLOCK_SIZE == 0 for g in got),
        got[0],
        got[1],
        "a prompt of k whole blocks reuses k - 1",
    )
    await later_turn(p, rng)


async def later_turn(p: Pair, rng: random.Random) -> None:
    """Turn 2 carries turn 1's answer: are the blocks the answer filled reused?"""
    first = [{"role": "user", "content": _words(rng, 300)}]

    async def turns(url: str) -> dict[str, Any]:
        one = await _post(
            url,
            "/v1/chat/completions",
            {"model": MODEL, "messages": first, "max_tokens": 64},
            p.http,
        )
        answer = one.body["choices"][0]["message"]["content"]
        messages = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "more"},
        ]
        two = await _post(
            url,
            "/v1/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 1},
            p.http,
        )
        t1, out = _prompt(one), int(_usage(one)["completion_tokens"])
        cached = _cached(two)
        return {
            "turn1_prompt": t1,
            "turn1_output": out,
            "turn2_prompt": _prompt(two),
            "turn2_cached": cached,
            "past_turn1_prompt": cached > t1,
        }

    got = await p.each(turns)
    p.record(
        "cached",
        "chat: turn 2 re-sends turn 1's answer (output blocks reused?)",
        got[0]["past_turn1_prompt"] == got[1]["past_turn1_prompt"],
        got[0],
        got[1],
    )
    prompt = _ids(rng, 60)

    async def continuation(url: str) -> dict[str, Any]:
        one = await _post(
            url,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 40, "return_token_ids": True},
            p.http,
        )
        out = one.body["choices"][0].get("token_ids")
        if not out:
            return {"output_token_ids": None}
        two = await _post(
            url, "/v1/completions", {"prompt": prompt + out + [5, 6, 7], "max_tokens": 1}, p.http
        )
        return {"prompt_tokens": _prompt(two), "cached": _cached(two)}

    got = await p.each(continuation)
    p.record(
        "cached",
        "ids: prompt + its own 40 output ids + 3 (return_token_ids)",
        got[0] == got[1],
        got[0],
        got[1],
        "60 + 40 = 100 tokens: 3 full blocks if the output's blocks are cached",
    )


async def reset(p: Pair, rng: random.Random) -> None:
    body = {"prompt": _ids(rng, 500), "max_tokens": 1}
    await p.both("POST", "/v1/completions", body)
    warm = await p.both("POST", "/v1/completions", body)
    s, r = await p.both("POST", "/reset_prefix_cache")
    p.record(
        "reset",
        "POST /reset_prefix_cache",
        (s.status, s.body) == (r.status, r.body),
        [s.status, s.body],
        [r.status, r.body],
    )
    cold = await p.both("POST", "/v1/completions", body)
    got = [[_cached(warm[i]), _cached(cold[i])] for i in (0, 1)]
    p.record(
        "reset", "500 ids: cached before and after the reset", got[0] == got[1], got[0], got[1]
    )
    s, r = await p.both("GET", "/reset_prefix_cache")
    p.record("reset", "GET /reset_prefix_cache status", s.status == r.status, s.status, r.status)


# -- running ------------------------------------------------------------------------------


async def compare(sim: str, real: str) -> list[dict[str, Any]]:
    rng = random.Random(20261204)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        p = Pair(http, sim, real)
        for step in (shapes, metrics, errors):
            await step(p)
        await cached_ids(p, rng)
        await cached_text(p, rng)
        await reset(p, rng)
        await metrics_after(p)
        p.record(
            "sim-only",
            "debug fields and headers (set aside above)",
            not p.sim_only,
            sorted(p.sim_only),
            [],
            "the sim's own additions; clients ignore them",
        )
    return p.items


async def metrics_after(p: Pair) -> None:
    """Label sets that appear only once traffic has run (request_success reasons)."""
    s, r = await p.both("GET", "/metrics")
    fams = exposition(s.body), exposition(r.body)
    name = "vllm:request_success_total"
    got = [sorted({lab.get("finished_reason", "") for lab, _ in f[name].samples}) for f in fams]
    p.record("metric", f"{name} finished_reason values", got[0] == got[1], got[0], got[1])


def summary(items: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, dict[str, int]] = {}
    for item in items:
        counts = by.setdefault(item["category"], {"same": 0, "differs": 0})
        counts[item["verdict"]] += 1
    return {
        "same": sum(c["same"] for c in by.values()),
        "differs": sum(c["differs"] for c in by.values()),
        "by_category": by,
    }


async def run(
    workdir: Path, urls: tuple[str, str] | None = None, command: str = "python -m bench.sim_vs_real"
) -> dict[str, Any]:
    """Start the pair and compare (or compare the running pods at ``urls``)."""
    started = time.time()
    if urls is not None:
        items = await compare(*urls)
        argv: dict[str, Any] = {"sim": urls[0], "real": urls[1]}
    else:
        async with pair(workdir) as (sim, real, started_argv):
            items = await compare(sim, real)
        argv = dict(started_argv)
    return {
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "command": command,
        "argv": argv,
        "notes": [
            "The tokenizers differ (sim: 4 bytes a token; the tiny model: a BPE), so text "
            "items compare each engine's cached tokens with its own prompt_tokens; "
            "token-id items compare values.",
            "Shapes: keys and JSON types, recursively; values are not compared.",
        ],
        "summary": summary(items),
        "items": items,
        "seconds": round(time.time() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=OUT, help="JSON result (default: %(default)s)")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/ace-sim-vs-real"),
        help="pod logs (default: %(default)s)",
    )
    ap.add_argument("--sim", metavar="URL", help="compare this running sim (with --real)")
    ap.add_argument("--real", metavar="URL", help="compare this running vLLM (with --sim)")
    args = ap.parse_args(argv)
    if bool(args.sim) != bool(args.real):
        ap.error("--sim and --real go together")
    try:
        urls = (args.sim, args.real) if args.sim else None
        result = asyncio.run(run(args.workdir, urls, record.command("bench.sim_vs_real", argv)))
    except EnginesMissing as exc:
        print(f"sim_vs_real: {exc}", file=sys.stderr)
        return 2
    record.write(args.out, result)
    for item in result["items"]:
        if item["verdict"] == "differs":
            print(f"differs  {item['category']:<13} {item['name']}")
    s = result["summary"]
    print(f"{s['same']} same, {s['differs']} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
