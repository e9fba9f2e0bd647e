"""The sim's tokenizer and chat template."""

from __future__ import annotations

import pytest

from ace_extproc.sim.tokenizer import (
    GENERATION_PROMPT,
    VOCAB_SIZE,
    TemplateError,
    count,
    encode,
    render_chat,
)


@pytest.mark.parametrize(
    "text", ["", "a", "abcd", "abcde", "héllo wörld", "日本語のテキスト", "x" * 1001]
)
def test_one_token_per_four_utf8_bytes(text: str) -> None:
    tokens = encode(text)
    assert len(tokens) == -(-len(text.encode("utf-8")) // 4)
    assert count(text) == len(tokens)
    assert all(0 <= t < VOCAB_SIZE for t in tokens)
    assert encode(text) == tokens  # deterministic


def test_ids_depend_on_the_chunk_only() -> None:
    assert encode("abcdabcd") == [encode("abcd")[0]] * 2
    assert encode("abcd") != encode("abce")
    # A shared prefix of whole chunks gives shared tokens; the partial chunk differs.
    a, b = encode("0123456789"), encode("0123456789xyz")
    assert a[:2] == b[:2] and a[2] != b[2]


def test_single_message_render() -> None:
    text = render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith(
        "Hi<|eot_id|>"
    )


def test_later_turns_extend_earlier_prompts() -> None:
    turn1 = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": "Saved attention state."}]
    turn2.append({"role": "user", "content": "And prefix caching?"})
    first, second = render_chat(turn1), render_chat(turn2)
    assert second.startswith(first)
    assert second[len(first) :].startswith("Saved attention state.<|eot_id|>")
    tokens1, tokens2 = encode(first), encode(second)
    whole = len(first.encode()) // 4
    assert tokens2[:whole] == tokens1[:whole]


def test_tools_go_first_with_the_system_message() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        tools,
    )
    system_end = text.index("<|eot_id|>")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.index("get_weather") < system_end
    assert text.index("Be brief.") < system_end
    assert text.count("<|start_header_id|>system") == 1
    # The same tools and prefix render the same text.
    assert text == render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        tools,
    )


def test_tool_calls_and_results() -> None:
    text = render_chat(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        ]
    )
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n-3 C<|eot_id|>" in text
    assert text.endswith(GENERATION_PROMPT)


def test_multipart_content() -> None:
    text = render_chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "https://x.test/cat.png"}},
                    {"type": "text", "text": "what is it?"},
                ],
            }
        ]
    )
    assert "Look:\n<|image|>https://x.test/cat.png<|/image|>\nwhat is it?<|eot_id|>" in text
    other = render_chat(
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "https://x.test/dog.png"}}],
            }
        ]
    )
    assert "dog.png" in other


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [42],
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "hologram"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {}}]}],
    ],
)
def test_malformed_conversations_raise(messages: object) -> None:
    with pytest.raises(TemplateError):
        render_chat(messages)  # type: ignore[arg-type]
