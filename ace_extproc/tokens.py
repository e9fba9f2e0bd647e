"""The prompt as the engine sees it: the model's own chat template and tokenizer, so
that precise routing (``routing/precise.py``) keys blocks token-exact, as the engine's
KV events do.

A deployment mounts the model's files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``) and names the directory in its destination's ``tokenizer``.
The template renders as vLLM renders it (Jinja2 in a sandbox, ``trim_blocks`` and
``lstrip_blocks``, the generation prompt added); the text is tokenized by Hugging
Face's ``tokenizers`` (Rust) without adding special tokens, as vLLM does for chat.

Tokenizing is the one new cost on the request path, and a conversation's later turns
repeat the earlier ones. The rendered text is cut at the tokenizer's special tokens,
which the tokenizer itself never merges across, so each piece tokenizes alone to the
same ids as in the whole; pieces are cached by their text. A new turn then tokenizes
only its new messages (``bench.tokenize_cost`` measures both). A long piece is cut
further, into segments of about ``SEGMENT_CHARS`` ending in a letter or digit before a
line break, where byte-level BPE tokenizers never merge either (checked on each
tokenizer when it loads; one that fails keeps whole pieces): a document sent with a
new question in the same message then tokenizes only its last segment. Cold text of
``defer_bytes`` or more in one request (a new document) is tokenized on a worker
thread, off the event loop, and the one request that found it cold is routed
approximately.

Block keys (``block_keys``) chain 64-bit hashes of each block's token ids from a seed
that holds the request's ``cache_salt`` (and LoRA): the router's own names for the
engine's blocks, computed the same way from the token ids an event carries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import msgspec
import xxhash

from ace_extproc import native
from ace_extproc.logs import RateLimit

log = logging.getLogger("ace_extproc.tokens")

_xxh3 = xxhash.xxh3_64_intdigest
_FAILED_KEPT = 256  # pieces remembered as failing, per model
# A long piece is cut into segments of about this many characters, each cached alone:
# a document sent again with a new question in the same message then finds all but
# its last segment cached.
SEGMENT_CHARS = 4096


class TokenizerError(ValueError):
    """A model directory whose tokenizer or template cannot be loaded."""


# ------------------------------------------------------------------ block keys


def chain_seed(salt: str | None, lora: str | None = None) -> int:
    """Block 0's parent key: the salt (and LoRA) namespace the chain, as they enter
    the engine's block 0 hash. An unsalted chain has a seed of its own, which no
    request ace-extproc salted ever uses."""
    return _xxh3(f"ace-precise\x00{salt or ''}\x00{lora or ''}".encode())


def block_keys(
    ids: Sequence[int], block_size: int, parent: int, limit: int | None = None
) -> list[int]:
    """Chained keys of the full blocks of ``ids`` (at most ``limit``), block 0 chained
    from ``parent`` (a ``chain_seed``, or the key of the block before ``ids``)."""
    full = len(ids) // block_size
    if limit is not None:
        full = min(full, limit)
    if full <= 0:
        return []
    # The prompt's block chain (``native.chain``), over the ids as 32-bit words.
    return native.chain(array("I", ids[: full * block_size]).tobytes(), 4 * block_size, parent)


# ------------------------------------------------------------------ a request's tokens


class RequestTokens(Protocol):
    """What turns a request body into the engine's prompt token ids."""

    name: str

    def token_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as the engine computes them; None where this cannot
        say (a body or template it does not render): the request is routed
        approximately."""
        ...


class _Chat(msgspec.Struct):
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class _Completion(msgspec.Struct):
    prompt: Any = None


_chat = msgspec.json.Decoder(_Chat)
_completion = msgspec.json.Decoder(_Completion)


@dataclass(frozen=True, slots=True)
class _Files:
    tokenizer: Any  # tokenizers.Tokenizer
    template: str
    bos: str
    eos: str


class ModelTokens:
    """A model's tokenizer and chat template, loaded from its directory."""

    def __init__(
        self,
        directory: str | Path,
        *,
        cache_tokens: int = 4_000_000,
        defer_bytes: int = 16_384,
    ) -> None:
        """``defer_bytes``: a piece this long not in the cache is tokenized on a worker
        thread (the tokenizer's batch call lets go of the GIL) when the caller runs on
        an event loop, and the request that found it cold is not keyed: a long document
        costs the loop nothing, and the next request with it finds its ids."""
        self.name = str(directory)
        files = _load(Path(directory))
        self._tokenizer = files.tokenizer
        self._bos, self._eos = files.bos, files.eos
        env = _environment()
        self._template = env.from_string(files.template)
        # Whether the template loops over a message's content parts (vLLM's "openai"
        # content format), or reads content as a string, parts joined by newlines.
        self._content_parts = _loops_over_content(env, files.template)
        specials = [
            t.content for t in files.tokenizer.get_added_tokens_decoder().values() if t.special
        ]
        self._special_ids = {t: files.tokenizer.token_to_id(t) for t in specials}
        # Longest first, so a special token that begins another is not cut short.
        alternatives = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})") if alternatives else None
        self._segments_of_long = _cuts_are_stable(files.tokenizer)
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self._cache_tokens = cache_tokens
        self.pieces_tokenized = 0  # pieces the tokenizer ran on (the cache missed)
        self.pieces_reused = 0
        self.deferred = 0  # requests not keyed: a long piece was being tokenized aside
        self._defer_bytes = defer_bytes
        self._pending: set[str] = set()
        self._last_cold: tuple[str, ...] = ()  # the pieces the last deferred call lacked
        self._waiters: dict[str, list[Callable[[], None]]] = {}
        # Pieces the tokenizer raised on aside: not tried again (bounded), so a request
        # with one is routed approximately instead of waiting on a piece never done.
        self._failed: OrderedDict[str, None] = OrderedDict()
        self.pieces_failed = 0
        self._warnings = RateLimit(1, 60.0)  # a broken tokenizer must not flood the log
        self._worker: ThreadPoolExecutor | None = None

    # -- the request path ----------------------------------------------------------
    def token_ids(self, path: str, body: bytes) -> list[int] | None:
        try:
            return self._token_ids(path, body)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the tokenizer's own failure (a panic is no Exception)
            self._failure("a request", exc)
            return None

    def _token_ids(self, path: str, body: bytes) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                return self.chat_ids(_chat.decode(body))
            prompt = _completion.decode(body).prompt
        except (msgspec.DecodeError, RecursionError):
            return None
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            # A completion's text gets the tokenizer's own special tokens, as in vLLM.
            return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None  # several prompts: several requests to the engine

    def chat_ids(self, chat: _Chat) -> list[int] | None:
        if chat.continue_final_message or chat.chat_template_kwargs:
            return None  # rendered otherwise than here; rare
        messages = _as_vllm_renders(chat.messages, self._content_parts)
        if messages is None:
            return None
        try:
            text = self.render(messages, chat.tools, chat.add_generation_prompt)
        except Exception as exc:  # a template raises what it likes (raise_exception)
            log.debug("chat template: %s", exc)
            return None
        return self.encode_deferring(text)

    def encode_deferring(self, text: str) -> list[int] | None:
        """``encode``, or None while its cold segments, ``defer_bytes`` or more, are
        tokenized aside (only on an event loop; elsewhere, as ``encode``)."""
        segments = self._segments(text)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._encode_segments(segments)
        pieces = self._pieces
        cold = [seg for special, seg in segments if not special and seg and seg not in pieces]
        if sum(map(len, cold)) < self._defer_bytes:
            return self._encode_segments(segments)
        if any(seg in self._failed for seg in cold):
            return None  # not keyed: the approximate index routes it
        for seg in cold:
            if seg not in self._pending:
                self._pending.add(seg)
                self._aside(loop, seg)
        self.deferred += 1
        self._last_cold = tuple(cold)
        return None

    def when_tokenized(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop once the pieces the last deferred request
        lacked are tokenized: its ids are then at hand (precise routing speculates its
        pick then, so the next request for that document finds it)."""
        pieces = [p for p in self._last_cold if p in self._pending]
        if not pieces:
            callback()
            return
        left = len(pieces)

        def one_done() -> None:
            nonlocal left
            left -= 1
            if not left:
                callback()

        for piece in pieces:
            self._waiters.setdefault(piece, []).append(one_done)

    def _aside(self, loop: asyncio.AbstractEventLoop, piece: str) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        tokenizer = self._tokenizer

        def work() -> None:
            try:
                ids = list(tokenizer.encode_batch([piece], add_special_tokens=False)[0].ids)
            except BaseException as exc:  # a panic in the Rust library is no Exception
                loop.call_soon_threadsafe(self._lost, piece, exc)
                return
            loop.call_soon_threadsafe(self._keep, piece, ids)

        self._worker.submit(work)

    def _lost(self, piece: str, exc: BaseException) -> None:
        self._pending.discard(piece)
        self._waiters.pop(piece, None)  # their picks stay approximate, unspeculated
        self._failed[piece] = None
        if len(self._failed) > _FAILED_KEPT:
            self._failed.popitem(last=False)
        self._failure(f"a {len(piece)}-character piece tokenized aside", exc)

    def _failure(self, what: str, exc: BaseException) -> None:
        self.pieces_failed += 1
        if self._warnings.allow("raised"):
            log.warning(
                "tokenizer raised %s on %s (%d so far); requests it fails on route approximately",
                type(exc).__name__,
                what,
                self.pieces_failed,
            )

    def _keep(self, piece: str, ids: list[int]) -> None:
        self._pending.discard(piece)
        self.pieces_tokenized += 1
        self._store(piece, ids)
        for waiter in self._waiters.pop(piece, ()):
            waiter()

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        text: str = self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos,
            eos_token=self._eos,
        )
        return text

    def encode(self, text: str) -> list[int]:
        """``text``'s ids without added special tokens, segment by cached segment."""
        return self._encode_segments(self._segments(text))

    def _encode_segments(self, segments: list[tuple[bool, str]]) -> list[int]:
        ids: list[int] = []
        special = self._special_ids
        for is_special, segment in segments:
            if is_special:
                ids.append(special[segment])
            elif segment:
                ids += self._encode_piece(segment)
        return ids

    def _segments(self, text: str) -> list[tuple[bool, str]]:
        """``text`` cut at special tokens (flagged), its long pieces cut into segments."""
        pieces = self._split.split(text) if self._split is not None else [text]
        out: list[tuple[bool, str]] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append((True, piece))
            elif self._segments_of_long and len(piece) > SEGMENT_CHARS:
                out += [(False, segment) for segment in cut(piece)]
            else:
                out.append((False, piece))
        return out

    def _encode_piece(self, piece: str) -> list[int]:
        pieces = self._pieces
        ids = pieces.get(piece)
        if ids is not None:
            pieces.move_to_end(piece)
            self.pieces_reused += 1
            return ids
        ids = list(self._tokenizer.encode(piece, add_special_tokens=False).ids)
        self.pieces_tokenized += 1
        self._store(piece, ids)
        return ids

    def _store(self, piece: str, ids: list[int]) -> None:
        pieces = self._pieces
        if piece in pieces:
            return
        pieces[piece] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > self._cache_tokens and pieces:
            _, old = pieces.popitem(last=False)
            self._cached_tokens -= len(old)


def cut(text: str, size: int = SEGMENT_CHARS) -> list[str]:
    """``text`` in segments of at least ``size`` characters (the last may be shorter),
    each cut where a line break follows a letter or digit: the first such place past
    ``size`` from the segment's start, so two texts that begin alike are cut alike up to
    where they differ."""
    out = []
    start, n = 0, len(text)
    while n - start > size:
        i = text.find("\n", start + size)
        while i != -1 and not text[i - 1].isalnum():
            i = text.find("\n", i + 1)
        if i == -1:
            break
        out.append(text[start:i])
        start = i
    out.append(text[start:])
    return out


# Text with what a cut could split: words, numbers, punctuation and blank lines before
# a line break, indentation, contractions, non-ASCII letters.
_PROBE = (
    "Passage 12: the cache's 3 tiers.\nIt ends with 2048\n\n  Next line, indented\n"
    "word\n- item one\nnaïve café déjà vu\nx = f(y) + 10\nThe end\n\n\nA last line"
) * 3


def _cuts_are_stable(tokenizer: Any) -> bool:
    """Whether this tokenizer gives cut text the ids of the whole (byte-level BPE does;
    one that prepends a marker to every text it is given does not)."""
    try:
        whole = tokenizer.encode(_PROBE, add_special_tokens=False).ids
        parts = [tokenizer.encode(s, add_special_tokens=False).ids for s in cut(_PROBE, 8)]
    except Exception:
        return False
    return len(parts) > 10 and [i for p in parts for i in p] == list(whole)


def _as_vllm_renders(
    messages: list[dict[str, Any]], content_parts: bool
) -> list[dict[str, Any]] | None:
    """The messages as vLLM hands them to the template: content as a string (text parts
    joined by newlines) unless the template loops over parts, then as text parts; tool
    call arguments as objects. None where a message has other parts (images: not keyed
    from text)."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return None
            texts = [str(p.get("text", "")) for p in content]
        else:
            return None
        shown: Any = (
            [{"type": "text", "text": t} for t in texts] if content_parts else "\n".join(texts)
        )
        message = {**message, "content": shown}
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                del message["tool_calls"]
            else:
                message["tool_calls"] = [_with_object_arguments(c) for c in calls]
        out.append(message)
    return out


def _with_object_arguments(call: Any) -> Any:
    """A tool call as vLLM renders it: the OpenAI types' key order (id, function,
    type; arguments, name), arguments parsed to an object (``{}`` where not one)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    function = _ordered({**function, "arguments": arguments}, ("arguments", "name"))
    return _ordered({**call, "function": function}, ("id", "function", "type"))


def _ordered(doc: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    first = {key: doc[key] for key in order if key in doc}
    return {**first, **{k: v for k, v in doc.items() if k not in first}}


def _loops_over_content(env: Any, template: str) -> bool:
    """Whether some ``{% for x in message['content'] %}`` (or ``in content``) loop
    exists: vLLM then gives the template content parts, not strings."""
    from jinja2 import nodes

    try:
        tree = env.parse(template)
    except Exception:
        return False
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        if isinstance(target, nodes.Name) and target.name == "content":
            return True
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if (
            isinstance(target, nodes.Getitem)
            and isinstance(target.arg, nodes.Const)
            and target.arg.value == "content"
        ):
            return True
    return False


def _load(directory: Path) -> _Files:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise TokenizerError(f"the tokenizers package is missing: {exc}") from None
    path = directory / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise TokenizerError(f"{path}: {exc}") from None
    config: dict[str, Any] = {}
    config_path = directory / "tokenizer_config.json"
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{config_path}: {exc}") from None
    template_path = directory / "chat_template.jinja"
    template: Any
    if template_path.exists():
        template = template_path.read_text()
    else:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or ""
    if not isinstance(template, str) or not template:
        raise TokenizerError(f"{directory}: no chat template (chat_template.jinja)")
    return _Files(
        tokenizer,
        template,
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
    )


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...}, older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _environment() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load(name: str) -> RequestTokens:
    """A destination's ``tokenizer``: a model directory, or ``sim`` (the simulated
    engine's own). Raises ``TokenizerError``."""
    if name == "sim":
        from ace_extproc.sim.tokens import SimTokens

        return SimTokens()
    return ModelTokens(name)
