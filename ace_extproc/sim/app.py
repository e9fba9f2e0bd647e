"""One simulated vLLM pod: an aiohttp OpenAI-compatible server.

Endpoints (vLLM's shapes unless noted): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/responses`` (streaming and not; stored responses
with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, as vLLM), ``GET /health``,
``GET /v1/models``, ``GET /version``, ``POST /tokenize``,
``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``,
``POST /reset_prefix_cache``, ``GET /metrics``, ``GET /kv_event_sources``; SGLang's
``GET /get_load`` and ``GET /server_info``; and, sim only, ``GET``/``DELETE /debug/requests``.

Every response carries ``x-sim-pod: <pod id>``, a sim-only debug header
(no real engine sends it) so tests can see which pod answered. The object that
carries a completion's ``usage`` (the answer, or the stream's usage chunk) also
carries ``sim_ttft_ms``, sim only: the request's time to first token on the
engine's simulated clock (its first prompt's, for several), so a benchmark run with
the pods' clock sped up can still compare the TTFT each router's placement gave.
Clients ignore an unknown key.

``--record N`` keeps the last N requests received (except the polled
``/health``, ``/metrics``, ``/get_load``, ``/server_info`` and ``/debug/*``)
and ``GET /debug/requests`` returns them oldest first as a JSON list of
``{"ts", "method", "path", "query", "headers", "body"}``: header names
lower-cased (repeats joined with ", "), the raw body as UTF-8 text.
``DELETE /debug/requests`` clears them.  Without ``--record`` both answer 404
and bodies are never kept or logged.

``--enable-lora --max-loras N --lora-modules NAME=PATH ...`` (vLLM's flags) serve
LoRA adapters by those names (the path is not read): N adapter slots, each load
``--lora-load-ms`` long (sim only; :mod:`.lora`), and ``vllm:lora_requests_info``.
As in vLLM, an adapter must be registered (``--lora-modules``) to be served; vLLM's
runtime loading API is not simulated.

``--kv-events-config`` (vLLM's flag and JSON) publishes KV cache events on ZMQ in
vLLM's wire format (:mod:`.kv_events`); ``--kv-events-delay-ms`` holds each batch back.

Performance: the sim is the backend of overhead benchmarks, so the small
non-streaming path stays short (msgspec JSON, no access log, no middleware
unless ``--record`` is on).  aiohttp sets TCP_NODELAY on every connection.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from ..latency import DEFAULT_MODEL, MODELS, get_model
from .engine import CapacityError, Engine, Prompt
from .kv_events import KVEventPublisher, KVEventsConfig
from .kvcache import PrefixCache, text_tokens
from .lora import AdapterSlots
from .metrics import CONTENT_TYPE, Exposition
from .protocol import (
    VERSION,
    ApiError,
    GenParams,
    chat_chunk,
    chat_response,
    check_model,
    completion_chunk,
    completion_response,
    dumps,
    filler_piece,
    filler_text,
    fit_context,
    new_id,
    now,
    parse_body,
    parse_gen_params,
    parse_messages,
    parse_prompts,
    usage,
    usage_chunk,
    validate_cache_salt,
)
from .responses import (
    Events,
    ResponsesParams,
    ResponseStore,
    Stored,
    message_item_id,
    output_message,
    parse_request,
    response_object,
    store_enabled,
)
from .responses import usage as responses_usage
from .tokenizer import TemplateError, encode, render_chat

POD_HEADER = "x-sim-pod"
TTFT_FIELD = "sim_ttft_ms"  # sim only, next to usage: TTFT on the simulated clock
MAX_BODY = 64 * 1024 * 1024  # aiohttp's default is 1 MiB; vLLM takes long prompts
# Polled paths that would push the interesting requests out of --record's window.
_UNRECORDED = frozenset({"/health", "/metrics", "/metrics/", "/get_load", "/server_info"})


@dataclass(frozen=True, slots=True)
class SimConfig:
    pod_id: str = "pod-0"
    model: str = "sim-llama"  # what answers and metrics say
    aliases: tuple[str, ...] = ()  # more names requests may use, as vLLM's --served-model-name
    block_size: int = 16
    num_gpu_blocks: int = 8192
    ttft_model: str = DEFAULT_MODEL
    time_scale: float = 1.0
    tpot_ms: float = 20.0
    max_tokens_default: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    record: int = 0  # keep the last N requests for GET /debug/requests; 0 = off
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: stored Responses-API responses (a later
    # turn's previous_response_id) kept in this pod; off, as vLLM's default.
    responses_store: bool = False
    kv_events: KVEventsConfig | None = None  # vLLM's --kv-events-config; None = off
    kv_events_delay_ms: float = 0.0  # sim only: hold each event batch back this long
    # LoRA, as vLLM's --enable-lora --max-loras N --lora-modules NAME=PATH ...
    enable_lora: bool = False
    max_loras: int = 1  # vLLM's default
    lora_modules: tuple[str, ...] = ()  # the adapters' names
    lora_load_ms: float | None = None  # sim only: model time to load one (its model's)

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")


class SimPod:
    """The state of one pod: its prefix cache, engine and recorded requests."""

    def __init__(self, config: SimConfig, host: str = "127.0.0.1") -> None:
        self.config = config
        self.cache = PrefixCache(config.block_size, config.num_gpu_blocks)
        events = config.kv_events
        self.events = (
            KVEventPublisher(events, host=host, delay_ms=config.kv_events_delay_ms)
            if events is not None and events.enabled
            else None
        )
        load_ms = config.lora_load_ms
        if load_ms is None:
            load_ms = get_model(config.ttft_model).adapter_load_ms
        self.lora = AdapterSlots(config.max_loras, load_ms) if config.enable_lora else None
        if self.lora is not None:  # registered in order at start, as vLLM's server does
            for name in config.lora_modules:
                self.lora.adapter_id(name)
        self.engine = Engine(
            get_model(config.ttft_model),
            self.cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            time_scale=config.time_scale,
            tpot_ms=config.tpot_ms,
            events=self.events,
            lora=self.lora,
        )
        self.records: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(config.record, 1)
        )
        self.started = time.time()
        self.names = (config.model, *config.aliases, *config.lora_modules)
        self.adapters = frozenset(config.lora_modules)
        self.responses = ResponseStore(config.responses_store)

    def adapter(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter a request names as its ``model`` (None: the base model)."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.adapters else None


POD = web.AppKey("sim_pod", SimPod)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type="application/json")


def _error(exc: ApiError) -> web.Response:
    return web.Response(body=exc.body(), status=exc.status, content_type="application/json")


def _api(handler: Handler) -> Handler:
    """Answer :class:`ApiError` with OpenAI's error envelope."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error(exc)

    return wrapped


async def _body(request: web.Request) -> dict[str, Any]:
    return parse_body(await request.read())


def _render(body: dict[str, Any], *, generation_prompt: bool = True) -> str:
    messages, tools = parse_messages(body)
    add = body.get("add_generation_prompt", generation_prompt)
    if not isinstance(add, bool):
        raise ApiError("'add_generation_prompt' must be a boolean", param="add_generation_prompt")
    try:
        return render_chat(messages, tools, add_generation_prompt=add)
    except TemplateError as exc:
        raise ApiError(str(exc), param="messages") from None


# -- generation -------------------------------------------------------------------------


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    body = await _body(request)
    check_model(body, pod.names)
    params = parse_gen_params(body)
    # The engine keys UTF-8 text directly: the same tokens and cache hits as encode()
    # without hashing every token (a 220 KB prompt: ~0.4 ms instead of ~10 ms).
    adapter = pod.adapter(body)
    return await _generate(request, pod, "chat", [_render(body).encode()], params, adapter)


async def _completions(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    body = await _body(request)
    check_model(body, pod.names)
    params = parse_gen_params(body)
    prompts: list[Prompt] = [p.encode() if isinstance(p, str) else p for p in parse_prompts(body)]
    return await _generate(request, pod, "text", prompts, params, pod.adapter(body))


def _num_tokens(prompt: Prompt) -> int:
    return text_tokens(prompt) if isinstance(prompt, bytes) else len(prompt)


async def _generate(
    request: web.Request,
    pod: SimPod,
    kind: str,
    prompts: list[Prompt],
    params: GenParams,
    adapter: str | None = None,
) -> web.StreamResponse:
    engine = pod.engine
    asked = params.max_tokens or pod.config.max_tokens_default
    sizes = [_num_tokens(p) for p in prompts]
    # Each prompt's answer length: cut to the context left, as vLLM does.
    limits = [fit_context(size, asked, pod.config.max_model_len) for size in sizes]
    for size, limit in zip(sizes, limits, strict=True):
        try:
            engine.check(size, limit, params.n)
        except CapacityError as exc:
            raise ApiError(str(exc)) from None
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    created = now()
    model = adapter or pod.config.model  # vLLM answers with the adapter's name
    if params.stream:
        return await _stream(request, pod, kind, prompts, params, limits, rid, created, adapter)

    async def one(prompt: Prompt, limit: int) -> tuple[int, float]:
        async with engine.generate(
            prompt, salt=params.cache_salt, max_tokens=limit, n=params.n, adapter=adapter
        ) as req:
            await engine.decode(req, limit - 1)
        return req.cached_tokens, req.ttft_s

    if len(prompts) == 1:
        done = [await one(prompts[0], limits[0])]
    else:
        done = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, limits, strict=True)))
    cached = [c for c, _ in done]
    use = _usage(pod, kind, sizes, limits, params.n, cached, streamed=False)
    if kind == "chat":
        answer = chat_response(rid, model, created, filler_text(limits[0]), params.n, use)
    else:
        texts = [filler_text(m) for m in limits for _ in range(params.n)]
        answer = completion_response(rid, model, created, texts, use)
    answer[TTFT_FIELD] = _ms(min(ttft for _, ttft in done))
    return _json(answer)


def _usage(
    pod: SimPod,
    kind: str,
    sizes: list[int],
    limits: list[int],
    n: int,
    cached: list[int],
    *,
    streamed: bool,
) -> dict[str, Any]:
    block = pod.config.block_size
    # vLLM counts the prompt's full blocks that were not cache hits as written (chat only).
    created = sum(s // block * block for s in sizes) - sum(cached) if kind == "chat" else None
    return usage(sum(sizes), sum(limits) * n, sum(cached), created, streamed=streamed)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _sse(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


async def _stream(
    request: web.Request,
    pod: SimPod,
    kind: str,
    prompts: list[Prompt],
    params: GenParams,
    limits: list[int],
    rid: str,
    created: int,
    adapter: str | None = None,
) -> web.StreamResponse:
    engine = pod.engine
    model = adapter or pod.config.model
    n = params.n
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    # Headers go out at once, as from vLLM (Starlette's StreamingResponse).
    await response.prepare(request)
    cached = [0] * len(prompts)
    ttfts: list[float] = []

    def chunk(base: int, i: int, max_tokens: int) -> bytes:
        piece = filler_piece(i)
        finish = "length" if i == max_tokens - 1 else None
        if kind == "chat":
            return b"".join(
                _sse(chat_chunk(rid, model, created, [(base + j, {"content": piece}, finish)]))
                for j in range(n)
            )
        return b"".join(
            _sse(completion_chunk(rid, model, created, [(base + j, piece, finish)]))
            for j in range(n)
        )

    async def one(index: int, prompt: Prompt) -> None:
        base = index * n  # choice indexes of this prompt, as vLLM numbers a batch
        max_tokens = limits[index]
        async with engine.generate(
            prompt, salt=params.cache_salt, max_tokens=max_tokens, n=n, adapter=adapter
        ) as req:
            first = chunk(base, 0, max_tokens)
            if kind == "chat":
                opening = {"role": "assistant", "content": ""}
                first = (
                    b"".join(
                        _sse(
                            chat_chunk(rid, model, created, [(base + j, opening, None)], role=True)
                        )
                        for j in range(n)
                    )
                    + first
                )
            await response.write(first)
            for i in range(1, max_tokens):
                await engine.decode(req, 1)
                await response.write(chunk(base, i, max_tokens))
        cached[index] = req.cached_tokens
        ttfts.append(req.ttft_s)

    try:
        if len(prompts) == 1:
            await one(0, prompts[0])
        else:
            async with asyncio.TaskGroup() as group:
                for index, prompt in enumerate(prompts):
                    group.create_task(one(index, prompt))
        if params.include_usage:
            sizes = [_num_tokens(p) for p in prompts]
            use = _usage(pod, kind, sizes, limits, n, cached, streamed=True)
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            last = usage_chunk(rid, obj, model, created, use)
            last[TTFT_FIELD] = _ms(min(ttfts))
            await response.write(_sse(last))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except* ConnectionError:
        pass  # the client went away; engine.generate has aborted its requests
    return response


async def _responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (sim/responses.py): the conversation rendered like a
    chat's, so both hit the same cached blocks; stored, where the store is on, for a
    later turn's ``previous_response_id``."""
    pod = request.app[POD]
    body = await _body(request)
    check_model(body, pod.names)
    salt = validate_cache_salt(body.get("cache_salt"))
    params = parse_request(body, pod.responses)
    try:
        prompt = render_chat(params.messages, params.tools or None).encode()
    except TemplateError as exc:
        raise ApiError(str(exc), param="input") from None
    size = text_tokens(prompt)
    asked = params.max_tokens or pod.config.max_tokens_default
    limit = fit_context(size, asked, pod.config.max_model_len)
    try:
        pod.engine.check(size, limit, 1)
    except CapacityError as exc:
        raise ApiError(str(exc)) from None
    if params.stream:
        return await _responses_stream(request, pod, params, prompt, size, limit, salt)
    async with pod.engine.generate(prompt, salt=salt, max_tokens=limit, n=1) as req:
        await pod.engine.decode(req, limit - 1)
    text = filler_text(limit)
    answer = response_object(
        params,
        pod.config.model,
        now(),
        limit,
        [output_message(message_item_id(), text)],
        "incomplete",  # the sim always stops at max_output_tokens
        _responses_use(pod, size, limit, req.cached_tokens),
    )
    answer[TTFT_FIELD] = _ms(req.ttft_s)
    _store(pod, params, text)
    return _json(answer)


def _responses_use(pod: SimPod, size: int, output: int, cached: int) -> dict[str, Any]:
    block = pod.config.block_size
    return responses_usage(size, output, cached, size // block * block - cached)


def _store(pod: SimPod, params: ResponsesParams, text: str) -> None:
    if params.store and pod.responses.enabled:  # vLLM: store quietly off without the env
        pod.responses.put(params.response_id, Stored(params.messages, text))


async def _responses_stream(
    request: web.Request,
    pod: SimPod,
    params: ResponsesParams,
    prompt: bytes,
    size: int,
    limit: int,
    salt: str | None,
) -> web.StreamResponse:
    """vLLM's event sequence for a text answer: response.created and .in_progress at
    once, the message item and its part opened with the first token, a delta a token,
    the part and item closed, then response.completed with the whole response."""
    model, created = pod.config.model, now()
    events = Events(message_item_id())
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    try:
        await response.write(
            events.opening(response_object(params, model, created, limit, [], "in_progress", None))
        )
        async with pod.engine.generate(prompt, salt=salt, max_tokens=limit, n=1) as req:
            await response.write(events.first(filler_piece(0)))
            for i in range(1, limit):
                await pod.engine.decode(req, 1)
                await response.write(events.delta(filler_piece(i)))
        text = filler_text(limit)
        use = _responses_use(pod, size, limit, req.cached_tokens)
        final = response_object(
            params, model, created, limit, [output_message(events.item, text)], "incomplete", use
        )
        final[TTFT_FIELD] = _ms(req.ttft_s)
        _store(pod, params, text)  # before the last event: a client may continue at once
        await response.write(events.closing(text, final))
        await response.write_eof()
    except ConnectionError:
        pass  # the client went away; engine.generate has aborted the request
    return response


# -- tokenizer endpoints ----------------------------------------------------------------


async def _tokenize(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    body = await _body(request)
    check_model(body, pod.names)
    if "messages" in body:
        tokens = encode(_render(body))
    elif isinstance(body.get("prompt"), str):
        tokens = encode(body["prompt"])
    else:
        raise ApiError("'prompt' (a string) or 'messages' is required", param="prompt")
    return _json(
        {
            "count": len(tokens),
            "max_model_len": pod.config.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
    )


async def _render_chat(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    body = await _body(request)
    check_model(body, pod.names)
    salt = validate_cache_salt(body.get("cache_salt"))
    tokens = encode(_render(body))
    return _json(_prepared(new_id("chatcmpl"), tokens, pod.config.model, salt))


async def _render_completions(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    body = await _body(request)
    check_model(body, pod.names)
    salt = validate_cache_salt(body.get("cache_salt"))
    rid = new_id("cmpl")
    # vLLM answers with one prepared request per prompt, in a list.
    return _json(
        [
            _prepared(f"{rid}-{i}", encode(p) if isinstance(p, str) else p, pod.config.model, salt)
            for i, p in enumerate(parse_prompts(body))
        ]
    )


def _prepared(rid: str, tokens: list[int], model: str, salt: str | None) -> dict[str, Any]:
    """The part of vLLM's prepared ``GenerateRequest`` that routers read."""
    out: dict[str, Any] = {"request_id": rid, "token_ids": tokens, "model": model}
    if salt is not None:
        out["cache_salt"] = salt
    return out


# -- server endpoints -------------------------------------------------------------------


async def _health(request: web.Request) -> web.StreamResponse:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.StreamResponse:
    return _json({"version": VERSION})


async def _models(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    cards = [
        {
            "id": name,
            "object": "model",
            "created": int(pod.started),
            "owned_by": "vllm",
            "root": pod.config.model,
            "parent": None,
            "max_model_len": pod.config.max_model_len,
            "permission": [_permission(int(pod.started))],
        }
        for name in pod.names
        if name not in pod.adapters
    ]
    # vLLM lists each adapter too, its parent the base model.
    cards += [
        {
            "id": name,
            "object": "model",
            "created": int(pod.started),
            "owned_by": "vllm",
            "root": name,
            "parent": pod.config.model,
            "max_model_len": pod.config.max_model_len,
            "permission": [_permission(int(pod.started))],
        }
        for name in pod.config.lora_modules
    ]
    return _json({"object": "list", "data": cards})


def _permission(created: int) -> dict[str, Any]:
    """vLLM's (OpenAI's legacy) model permission card: everything a client may do."""
    return {
        "id": new_id("modelperm"),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def _get_load(request: web.Request) -> web.StreamResponse:
    running, waiting = request.app[POD].engine.gauges()
    return _json({"load": running + waiting})


async def _server_info(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    info: dict[str, Any] = asdict(pod.config)
    running, waiting = pod.engine.gauges()
    info.update(
        version=VERSION,
        num_requests_running=running,
        num_requests_waiting=waiting,
        kv_cache_usage=pod.cache.usage,
        cached_blocks=pod.cache.cached_blocks,
    )
    return _json(info)


async def _reset_prefix_cache(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    pod.cache.reset()
    if pod.events is not None:
        pod.events.flush()  # now, not at the next step (see docs/simulator.md)
    return _json({"success": True})


async def _kv_event_sources(request: web.Request) -> web.StreamResponse:
    """vLLM's shape: the publisher config of each data-parallel rank, ``{}`` when off;
    unlike vLLM the endpoints are the ones to dial (no ``*``)."""
    events = request.app[POD].events
    return _json({"0": events.source()} if events is not None else {})


async def _metrics(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    engine, cache, stats = pod.engine, pod.cache, pod.engine.stats
    out = Exposition({"engine": "0", "model_name": pod.config.model})
    running, waiting = engine.gauges()
    out.gauge(
        "vllm:num_requests_running", running, "Number of requests in model execution batches."
    )
    out.gauge("vllm:num_requests_waiting", waiting, "Number of requests waiting to be processed.")
    deferred = pod.lora.deferred() if pod.lora is not None else 0
    out.labelled_gauge(
        "vllm:num_requests_waiting_by_reason",
        "reason",
        {"capacity": waiting - deferred, "deferred": deferred},
        "Number of requests waiting, by reason (capacity: KV cache or batch; deferred: "
        "a LoRA adapter's slot).",
    )
    out.gauge("vllm:kv_cache_usage_perc", cache.usage, "KV-cache usage. 1 means 100 percent usage.")
    out.counter(
        "vllm:prefix_cache_queries_total",
        cache.queries,
        "Prefix cache queries, in terms of number of queried tokens.",
    )
    out.counter(
        "vllm:prefix_cache_hits_total",
        cache.hits,
        "Prefix cache hits, in terms of number of cached tokens.",
    )
    out.counter(
        "vllm:prompt_tokens_cached_total",
        stats.cached_prompt_tokens,
        "Number of cached prompt tokens (local + external).",
    )
    out.counter(
        "vllm:prompt_tokens_total", stats.prompt_tokens, "Number of prefill tokens processed."
    )
    out.counter(
        "vllm:generation_tokens_total",
        stats.generation_tokens,
        "Number of generation tokens processed.",
    )
    out.labelled_counter(
        "vllm:request_success_total",
        "finished_reason",
        {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0, **stats.finished},
        "Count of successfully processed requests.",
    )
    out.histogram(
        "vllm:time_to_first_token_seconds",
        stats.ttft,
        "Histogram of time to first token in seconds.",
    )
    out.info(
        "vllm:cache_config_info",
        {
            "block_size": str(cache.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            # The KV capacity, as the router reads it: blocks, and (vLLM 0.32) tokens.
            "num_gpu_blocks": str(cache.num_gpu_blocks),
            "kv_cache_size_tokens": str(cache.num_gpu_blocks * cache.block_size),
            # Not vLLM's default (sha256): the sim's block keys are xxh3, and says so.
            "prefix_caching_hash_algo": "xxhash",
        },
        "Information of the LLMEngine CacheConfig",
    )
    if pod.lora is not None:
        out.info_series(
            "vllm:lora_requests_info",
            pod.lora.info_series(),
            "Running stats on lora requests.",
        )
    # vLLM's /metrics carries the process's own metrics too; a router tells a restart by it.
    out.process_gauge(
        "process_start_time_seconds",
        pod.started,
        "Start time of the process since unix epoch in seconds.",
    )
    # A router may name the samples it wants, which vLLM's /metrics/ (prometheus-client's
    # app) honours and its /metrics does not.
    named = request.query.getall("name[]", ()) if request.path == "/metrics/" else ()
    only = frozenset(named) or None
    return web.Response(text=out.render(only), headers={"Content-Type": CONTENT_TYPE})


# -- debugging --------------------------------------------------------------------------


def _record_middleware(pod: SimPod) -> Any:
    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _UNRECORDED and not request.path.startswith("/debug/"):
            raw = await request.read()  # aiohttp keeps it for the handler
            headers: dict[str, str] = {}
            for name, value in request.headers.items():
                key = name.lower()
                headers[key] = f"{headers[key]}, {value}" if key in headers else value
            pod.records.append(
                {
                    "ts": time.time(),
                    "method": request.method,
                    "path": request.path,
                    "query": request.query_string,
                    "headers": headers,
                    "body": raw.decode("utf-8", "replace"),
                }
            )
        return await handler(request)

    return record


async def _debug_requests(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    if pod.config.record <= 0:
        raise ApiError(
            "request recording is off; start the sim with --record N",
            status=404,
            type="NotFoundError",
        )
    if request.method == "DELETE":
        cleared = len(pod.records)
        pod.records.clear()
        return _json({"cleared": cleared})
    return _json(list(pod.records))


# -- wiring -----------------------------------------------------------------------------


def build_app(config: SimConfig, host: str = "127.0.0.1") -> web.Application:
    """The pod's app; ``host`` (its HTTP address) is what KV event endpoints report
    in place of a wildcard."""
    pod = SimPod(config, host)
    middlewares = [_record_middleware(pod)] if config.record > 0 else []
    app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
    app[POD] = pod
    if pod.events is not None:
        app.cleanup_ctx.append(_publishing(pod.events))

    async def pod_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[POD_HEADER] = config.pod_id

    app.on_response_prepare.append(pod_header)
    routes = [
        web.post("/v1/chat/completions", _api(_chat_completions)),
        web.post("/v1/completions", _api(_completions)),
        web.post("/v1/responses", _api(_responses)),
        web.post("/v1/chat/completions/render", _api(_render_chat)),
        web.post("/v1/completions/render", _api(_render_completions)),
        web.post("/tokenize", _api(_tokenize)),
        web.get("/health", _health),
        web.get("/version", _version),
        web.get("/v1/models", _models),
        web.get("/metrics", _metrics),
        web.get("/metrics/", _metrics),  # vLLM's mount of prometheus-client's app
        web.get("/get_load", _get_load),
        web.get("/server_info", _server_info),
        web.post("/reset_prefix_cache", _reset_prefix_cache),
        web.get("/kv_event_sources", _kv_event_sources),
        web.get("/debug/requests", _api(_debug_requests)),
        web.delete("/debug/requests", _api(_debug_requests)),
    ]
    app.add_routes(routes)
    return app


def _publishing(
    events: KVEventPublisher,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The publisher's sockets live as long as the app."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        await events.start()
        try:
            yield
        finally:
            await events.stop()

    return ctx


class SimServer:
    """Run a pod in the current event loop: ``async with SimServer(cfg) as s: s.url``.

    ``port=0`` binds a free port; :attr:`port` is the one bound.
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.port = port
        self.ssl_context = ssl_context  # serve https, as vLLM with --ssl-certfile
        self.app = build_app(self.config, host)
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)

    @property
    def pod(self) -> SimPod:
        return self.app[POD]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl_context else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# -- command line -----------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig()
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=8001, help="port to bind (default: %(default)s)")
    add(
        "--pod-id",
        default=d.pod_id,
        help="name sent in the x-sim-pod header (default: %(default)s)",
    )
    add(
        "--model",
        nargs="+",
        default=[d.model],
        metavar="NAME",
        help="served model names, as vLLM's --served-model-name: answers and metrics say "
        "the first, requests may use any (default: %(default)s)",
    )
    add(
        "--block-size",
        type=_positive_int,
        default=d.block_size,
        help="tokens per KV block (default: %(default)s)",
    )
    add(
        "--num-gpu-blocks",
        type=_positive_int,
        default=d.num_gpu_blocks,
        help="KV blocks on the pod (default: %(default)s)",
    )
    add(
        "--ttft-model",
        choices=sorted(MODELS),
        default=d.ttft_model,
        help="latency model (default: %(default)s)",
    )
    add(
        "--time-scale",
        type=_non_negative_float,
        default=d.time_scale,
        help="multiply every simulated duration; 0 = no sleeping (default: %(default)s)",
    )
    add(
        "--tpot-ms",
        type=_non_negative_float,
        default=d.tpot_ms,
        help="decode time per output token (default: %(default)s)",
    )
    add(
        "--max-tokens-default",
        type=_positive_int,
        default=d.max_tokens_default,
        help="output tokens when a request sets none (default: %(default)s)",
    )
    add(
        "--max-num-seqs",
        type=_positive_int,
        default=d.max_num_seqs,
        help="most running requests, as vLLM's flag (default: %(default)s)",
    )
    add(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=d.max_num_batched_tokens,
        help="uncached tokens per prefill batch (default: %(default)s)",
    )
    add(
        "--max-model-len",
        type=_positive_int,
        default=d.max_model_len,
        help="context length (default: %(default)s)",
    )
    add("--ssl-certfile", help="serve https with this certificate chain (PEM), as vLLM's flag")
    add("--ssl-keyfile", help="the certificate's private key (PEM), as vLLM's flag")
    add(
        "--record",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="keep the last N requests for GET /debug/requests (default: off)",
    )
    add(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="publish KV cache events on ZMQ, as vLLM's flag: e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}\'; '
        "GET /kv_event_sources gives the endpoint (default: off)",
    )
    add(
        "--kv-events-delay-ms",
        type=_non_negative_float,
        default=d.kv_events_delay_ms,
        metavar="MS",
        help="sim only: publish each KV event batch this long after its step "
        "(default: %(default)s)",
    )
    add("--enable-lora", action="store_true", help="serve LoRA adapters, as vLLM's flag")
    add(
        "--max-loras",
        type=_positive_int,
        default=d.max_loras,
        help="adapter slots on the GPU, as vLLM's flag (default: %(default)s)",
    )
    add(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters served by name, as vLLM's flag (the sim reads no PATH)",
    )
    add(
        "--lora-load-ms",
        type=_non_negative_float,
        default=d.lora_load_ms,
        metavar="MS",
        help="sim only: model time to load an adapter into a slot (default: the TTFT "
        "model's, 100 ms on the GPU models, 1 on vllm-cpu-tiny)",
    )


def _lora_module(text: str) -> str:
    """vLLM's ``NAME=PATH`` form; the sim keeps the name (it loads no weights)."""
    name, eq, path = text.partition("=")
    if not eq or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules: expected NAME=PATH, got {text!r}")
    return name.strip()


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--kv-events-config: {exc}") from None


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        pod_id=args.pod_id,
        model=args.model[0],
        aliases=tuple(args.model[1:]),
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        ttft_model=args.ttft_model,
        time_scale=args.time_scale,
        tpot_ms=args.tpot_ms,
        max_tokens_default=args.max_tokens_default,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        record=args.record,
        responses_store=store_enabled(),
        kv_events=args.kv_events_config,
        kv_events_delay_ms=args.kv_events_delay_ms,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        lora_modules=tuple(args.lora_modules),
        lora_load_ms=args.lora_load_ms,
    )


async def serve(
    config: SimConfig, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> None:
    """Serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SimServer(config, host, port, ssl_context) as server:
        print(f"sim {config.pod_id} listening on {server.url}", flush=True)
        if server.pod.events is not None:
            print(f"sim {config.pod_id} KV events on {server.pod.events.endpoint}", flush=True)
        await stop.wait()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def server_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The TLS context ``--ssl-certfile``/``--ssl-keyfile`` ask for (None: plain http)."""
    if not certfile:
        if keyfile:
            raise ValueError("--ssl-keyfile without --ssl-certfile")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        tls = server_context(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError, ValueError) as exc:
        print(f"sim {config.pod_id}: cannot serve https: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(config, args.host, args.port, tls))
    except OSError as exc:
        print(
            f"sim {config.pod_id}: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        pass
    return 0
