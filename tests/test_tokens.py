"""The prompt as the engine sees it (ace_extproc/tokens.py): a model directory's
template and tokenizer, pieces cached across turns, and token-exact block keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ace_extproc.tokens import (
    SEGMENT_CHARS,
    ModelTokens,
    TokenizerError,
    _cuts_are_stable,
    block_keys,
    chain_seed,
    cut,
    load,
)
from tests.model_files import write_model_files

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_files(tmp_path_factory.mktemp("model"))


def chat(*contents: str, **extra: object) -> bytes:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_pieces_tokenize_to_the_same_ids_as_the_whole_text(model_dir: Path) -> None:
    tokens = ModelTokens(model_dir)
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [
        tokens.render([{"role": "user", "content": "def f(x):\n    return x  # <|end|> inside"}]),
        tokens.render(
            [
                {"role": "system", "content": "  leading spaces"},
                {"role": "user", "content": "ünïcödé 🚀"},
            ]
        ),
        "<|begin|><|begin|>no text between<|end|>",
        "plain text with no special token at all",
    ]
    for text in texts:
        assert tokens.encode(text) == whole.encode(text, add_special_tokens=False).ids, text


def test_a_later_turn_tokenizes_only_its_new_messages(model_dir: Path) -> None:
    tokens = ModelTokens(model_dir)
    turn1 = ["You are terse.", "first question " * 200]
    tokens.token_ids(CHAT, chat(*turn1))
    tokenized = tokens.pieces_tokenized
    tokens.token_ids(CHAT, chat(*turn1, "an answer", "second question"))
    # The system and first user messages came from the cache; the answer and the new
    # question (and the generation prompt's trailing newline) were tokenized.
    assert tokens.pieces_tokenized - tokenized <= 3
    assert tokens.pieces_reused >= 2


def test_the_piece_cache_is_bounded_by_tokens(model_dir: Path) -> None:
    tokens = ModelTokens(model_dir, cache_tokens=500)
    for i in range(20):
        tokens.token_ids(CHAT, chat(f"document {i} " * 100))
    assert tokens._cached_tokens <= 500 + 400  # the last piece may exceed it alone


def test_a_turn_extends_the_previous_turns_tokens(model_dir: Path) -> None:
    """What prefix caching needs: turn 2's ids start with turn 1's, up to the
    generation prompt the answer now fills."""
    tokens = ModelTokens(model_dir)
    one = tokens.token_ids(CHAT, chat("sys", "question"))
    two = tokens.token_ids(CHAT, chat("sys", "question", "answer", "next"))
    assert one is not None and two is not None
    assert two[: len(one)] == one


def test_completions_and_unrenderable_bodies(model_dir: Path) -> None:
    tokens = ModelTokens(model_dir)
    text = tokens.token_ids("/v1/completions", b'{"prompt": "hello there"}')
    assert text and text == tokens.token_ids("/v1/completions", b'{"prompt": ["hello there"]}')
    assert tokens.token_ids("/v1/completions", b'{"prompt": [5, 6, 7]}') == [5, 6, 7]
    assert tokens.token_ids("/v1/completions", b'{"prompt": ["a", "b"]}') is None
    assert tokens.token_ids(CHAT, b"not json") is None
    assert tokens.token_ids(CHAT, chat("x", continue_final_message=True)) is None
    assert (
        tokens.token_ids(CHAT, b'{"messages": [{"role": "user", "content": "x"}], "tools": 5}')
        is None
    )


def test_a_template_that_raises_is_not_rendered(tmp_path: Path, model_dir: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((model_dir / name).read_bytes())
    (bad / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    assert ModelTokens(bad).token_ids(CHAT, chat("x")) is None


def test_a_directory_that_cannot_load_says_why(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load(str(tmp_path / "missing"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load(str(tmp_path / "broken"))
    (tmp_path / "untemplated").mkdir()
    (tmp_path / "untemplated" / "tokenizer.json").write_bytes(
        (model_dir / "tokenizer.json").read_bytes()
    )
    with pytest.raises(TokenizerError, match="chat template"):
        load(str(tmp_path / "untemplated"))


def test_the_template_may_live_in_tokenizer_config(tmp_path: Path, model_dir: Path) -> None:
    d = tmp_path / "inline"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    template = (model_dir / "chat_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|begin|>"},
                "chat_template": [{"name": "default", "template": template}],
            }
        )
    )
    assert ModelTokens(d).token_ids(CHAT, chat("x")) == ModelTokens(model_dir).token_ids(
        CHAT, chat("x")
    )


def test_block_keys_chain_from_the_salt() -> None:
    ids = list(range(100))
    keys = block_keys(ids, 16, chain_seed("tenant-a"))
    assert len(keys) == 6  # the partial seventh block has no key
    assert block_keys(ids, 16, chain_seed("tenant-a"), limit=2) == keys[:2]
    # Later blocks chain from the earlier: the keys of ids[32:] from keys[1] are the tail.
    assert block_keys(ids[32:], 16, keys[1]) == keys[2:]
    other = block_keys(ids, 16, chain_seed("tenant-b"))
    assert not set(keys) & set(other)  # another salt shares no block
    assert not set(keys) & set(block_keys(ids, 16, chain_seed(None)))
    assert block_keys(ids[:15], 16, chain_seed("x")) == []


def test_sim_tokens_match_the_sims_own_rendering() -> None:
    from ace_extproc.sim.tokenizer import encode, render_chat

    messages = [{"role": "user", "content": "hello " * 30}]
    body = json.dumps({"messages": messages}).encode()
    assert load("sim").token_ids(CHAT, body) == encode(render_chat(messages))


def test_messages_are_rendered_as_vllm_hands_them_to_the_template(model_dir: Path) -> None:
    """Checked against the engine itself in tests/engines/test_precise.py; here, what
    that showed: text parts joined by newlines (this template reads content as a
    string), tool call arguments as objects in the OpenAI types' key order."""
    tokens = ModelTokens(model_dir)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    as_parts = tokens.token_ids(
        CHAT, json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
    )
    assert as_parts == tokens.token_ids(CHAT, chat_user("one\ntwo"))
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert (
        tokens.token_ids(
            CHAT, json.dumps({"messages": [{"role": "user", "content": image}]}).encode()
        )
        is None
    )
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}, "id": "c"}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    text = tokens._tokenizer.decode(tokens.token_ids(CHAT, json.dumps(body).encode()))
    assert (
        '[{"id": "c", "function": {"arguments": {"a": 1}, "name": "f"}, "type": "function"}]'
        in text
    )


def chat_user(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


def test_a_long_new_document_is_tokenized_aside_on_an_event_loop(model_dir: Path) -> None:
    """On the loop the request path runs on, a long piece the cache lacks goes to a
    worker thread: that request is not keyed (None), the next one with it is, to the
    same ids as inline; short pieces are tokenized inline as before."""
    import asyncio

    tokens = ModelTokens(model_dir, defer_bytes=1000)
    long_body = chat("sys", "a long document. " * 400)

    async def go() -> tuple[list[int] | None, list[int] | None, list[int] | None]:
        first = tokens.token_ids(CHAT, long_body)
        short = tokens.token_ids(CHAT, chat("sys", "short"))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not tokens._pending:
                break
        return first, short, tokens.token_ids(CHAT, long_body)

    first, short, again = asyncio.run(go())
    assert first is None and tokens.deferred == 1
    assert short is not None
    assert again == ModelTokens(model_dir).token_ids(CHAT, long_body)  # off a loop: inline


class _Raising:
    """A loaded tokenizer that raises (as a panic in its Rust library would) on what it
    tokenizes aside, and inline too where told; counts its calls aside."""

    def __init__(self, real: Tokenizer, inline: bool) -> None:
        self.real, self.inline, self.calls = real, inline, 0

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[object]:
        self.calls += 1
        raise RuntimeError("the tokenizer failed")

    def encode(self, text: str, add_special_tokens: bool) -> object:
        if self.inline:
            raise RuntimeError("the tokenizer failed")
        return self.real.encode(text, add_special_tokens=add_special_tokens)


def test_a_piece_the_tokenizer_raises_on_aside_is_not_waited_for(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A long piece whose tokenization raises on the worker is given up: its requests
    route approximately at once (before, they were deferred for ever behind a piece
    never done), it is not tried again, and short requests are keyed as before."""
    import asyncio

    tokens = ModelTokens(model_dir, defer_bytes=1000)
    raising = _Raising(tokens._tokenizer, inline=False)
    tokens._tokenizer = raising  # type: ignore[assignment]
    long_body = chat("sys", "a document the tokenizer cannot take. " * 100)
    called: list[bool] = []

    async def go() -> tuple[list[int] | None, list[int] | None, list[int] | None]:
        first = tokens.token_ids(CHAT, long_body)
        tokens.when_tokenized(lambda: called.append(True))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if not tokens._pending:
                break
        tried.append(raising.calls)
        again = tokens.token_ids(CHAT, long_body)
        await asyncio.sleep(0.05)
        return first, again, tokens.token_ids(CHAT, chat("sys", "short"))

    tried: list[int] = []
    first, again, short = asyncio.run(go())
    assert first is None and again is None
    assert not tokens._pending and tokens.deferred == 1  # the second was not deferred
    # Each cold segment was tried once aside, and not again.
    assert raising.calls == tried[0] == tokens.pieces_failed >= 1
    assert not called  # no ids ever came: nothing to speculate
    assert short is not None
    assert "tokenizer raised RuntimeError" in caplog.text


def test_a_tokenizer_that_raises_inline_costs_that_request_its_keys_only(
    model_dir: Path,
) -> None:
    tokens = ModelTokens(model_dir)
    real = tokens._tokenizer
    tokens._tokenizer = _Raising(real, inline=True)  # type: ignore[assignment]
    assert tokens.token_ids(CHAT, chat("sys", "short")) is None
    assert tokens.pieces_failed == 1
    tokens._tokenizer = real
    assert tokens.token_ids(CHAT, chat("sys", "short"))


def _notes(n: int, tag: str = "") -> str:
    return "\n".join(f"line {i}{tag}: check the ledger {i} times" for i in range(n))


def test_a_long_piece_is_cut_alike_wherever_two_texts_begin_alike() -> None:
    head = _notes(400)
    a, b = cut(head + "\nQuestion one"), cut(head + "\nAnother question, longer")
    assert len(a) > 3 and all(len(s) >= SEGMENT_CHARS for s in a[:-1])
    assert a[:-1] == b[:-1]  # only the segment holding the difference differs
    assert "".join(a) == head + "\nQuestion one"
    assert all(s.startswith("\n") and s[-1].isalnum() for s in a[1:-1])
    assert cut("x" * 10_000) == ["x" * 10_000]  # no line break: nowhere to cut


def test_a_document_asked_again_tokenizes_only_its_last_segment(model_dir: Path) -> None:
    tokens = ModelTokens(model_dir)
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokens._segments_of_long
    doc = _notes(600)
    first = tokens.token_ids(CHAT, chat("sys", doc + "\nQuestion: line 7?"))
    done = tokens.pieces_tokenized
    second = tokens.token_ids(CHAT, chat("sys", doc + "\nQuestion: and line 9?"))
    assert tokens.pieces_tokenized - done <= 2  # the last segment (and the template's tail)
    for ids, question in ((first, "line 7?"), (second, "and line 9?")):
        text = tokens.render(
            [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": doc + "\nQuestion: " + question},
            ]
        )
        assert ids == whole.encode(text, add_special_tokens=False).ids


def test_a_new_long_document_goes_aside_whole_though_each_segment_is_short(
    model_dir: Path,
) -> None:
    import asyncio

    tokens = ModelTokens(model_dir, defer_bytes=16_384)
    body = chat("sys", _notes(1000) + "\nQuestion?")

    async def go() -> tuple[list[int] | None, list[int] | None]:
        first = tokens.token_ids(CHAT, body)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if not tokens._pending:
                break
        return first, tokens.token_ids(CHAT, body)

    first, later = asyncio.run(go())
    assert first is None and tokens.deferred == 1  # not tokenized on the loop
    assert later is not None


def test_a_tokenizer_that_marks_every_text_keeps_whole_pieces() -> None:
    class Prepending:  # as a SentencePiece tokenizer prepends its space marker
        def encode(self, text: str, add_special_tokens: bool) -> object:
            return type("E", (), {"ids": [0] + [ord(c) for c in text]})()

    assert not _cuts_are_stable(Prepending())
