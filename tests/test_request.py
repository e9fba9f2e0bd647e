import msgspec
import pytest

from ace_extproc import request as req


def chat(messages, **extra):
    return msgspec.json.encode({"model": "m", "messages": messages, **extra})


def test_chat_canonical_prefix_grows_with_the_conversation():
    turn1 = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    a = req.parse(req.CHAT_PATH, chat(turn1))
    b = req.parse(req.CHAT_PATH, chat(turn2))
    assert b.prompt.startswith(a.prompt)
    # The cacheable prefix stops before the newest user turn.
    assert a.prompt[: a.cacheable_end].endswith(b"You are terse.")
    assert b.prompt[: b.cacheable_end] == a.prompt + b"\x1eassistant\x1fHello"
    assert a.model == "m" and not a.has_router_fields and not a.stream


def test_multipart_tools_tool_calls_and_results_are_all_in_the_prompt():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in "},
                {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    p = req.parse(req.CHAT_PATH, chat(messages, tools=tools))
    for piece in (b"get_weather", b"What is in ", b"cat.png", b'{"city":"Oslo"}', b"c1", b"sunny"):
        assert piece in p.prompt
    assert p.prompt.startswith(b"\x1dtools")
    # Different tool definitions give a different prompt from the very start.
    other = req.parse(req.CHAT_PATH, chat(messages, tools=[{"type": "function"}]))
    assert other.prompt[:30] != p.prompt[:30]


def test_roles_and_content_are_not_confusable():
    a = req.parse(req.CHAT_PATH, chat([{"role": "user", "content": "ab"}]))
    b = req.parse(
        req.CHAT_PATH, chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    )
    c = req.parse(req.CHAT_PATH, chat([{"role": "system", "content": "ab"}]))
    assert len({a.prompt, b.prompt, c.prompt}) == 3


def test_router_fields_are_detected_even_when_null():
    assert req.parse(
        req.CHAT_PATH, chat([{"role": "user", "content": "x"}], cache_salt=None)
    ).has_router_fields
    assert req.parse(
        req.CHAT_PATH, chat([{"role": "user", "content": "x"}], cache_prefix_id="y")
    ).has_router_fields


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", b"hello"),
        (["a", "b"], b"a\x1eb"),
        ([1, 2], b"\x01\x00\x00\x00\x02\x00\x00\x00"),
        ([[1], [2]], b"\x01\x00\x00\x00\x1e\x02\x00\x00\x00"),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    p = req.parse(req.COMPLETIONS_PATH, msgspec.json.encode({"model": "m", "prompt": prompt}))
    assert p.prompt == expected
    assert p.cacheable_end is None  # decided by whole blocks


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        (req.CHAT_PATH, b"{not json", "bad_json"),
        (req.CHAT_PATH, b"[1, 2]", "not_object"),
        (req.CHAT_PATH, b'"text"', "not_object"),
        (req.CHAT_PATH, b"", "empty_body"),
        (req.CHAT_PATH, b"   ", "empty_body"),
        (req.CHAT_PATH, b'{"model": "m"}', "empty_prompt"),
        (req.CHAT_PATH, b'{"model": "m", "messages": []}', "empty_prompt"),
        (req.CHAT_PATH, b'{"messages": "hi"}', "invalid_body"),
        (req.CHAT_PATH, b'{"messages": [{"role": "user", "content": 5}]}', "invalid_body"),
        (req.CHAT_PATH, b'{"messages": [{"content": "no role"}]}', "invalid_body"),
        (
            req.CHAT_PATH,
            b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}',
            "invalid_body",
        ),
        (req.CHAT_PATH, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not_utf8"),
        (req.COMPLETIONS_PATH, b'{"model": "m"}', "empty_prompt"),
        (req.COMPLETIONS_PATH, b'{"prompt": ""}', "empty_prompt"),
        (req.COMPLETIONS_PATH, b'{"prompt": [1, "a"]}', "invalid_body"),
        (req.COMPLETIONS_PATH, b'{"prompt": [99999999999]}', "invalid_body"),
        (req.COMPLETIONS_PATH, b'{"prompt": {"a": 1}}', "invalid_body"),
    ],
)
def test_bad_bodies_name_a_reason(path, body, reason):
    with pytest.raises(req.RequestError) as err:
        req.parse(path, body)
    assert err.value.reason == reason
    assert str(err.value)


def test_nesting_past_the_decoders_stack_is_bad_json() -> None:
    # msgspec raises RecursionError there: a bypass, not an internal error.
    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"messages":[{"role":"user"}]}'
    for path in (req.CHAT_PATH, req.COMPLETIONS_PATH):
        with pytest.raises(req.RequestError) as err:
            req.parse_pure(path, deep)
        assert err.value.reason == "bad_json"


# ------------------------------------------------------------------ the Responses API


def responses(**fields):
    return msgspec.json.encode({"model": "m", **fields})


def test_a_responses_request_keys_like_the_same_chat():
    """instructions are the system message, a string input one user message: the
    prompt, its cacheable prefix and so its prefix key are chat's."""
    r = req.parse(req.RESPONSES_PATH, responses(instructions="Be terse.", input="Hi"))
    c = req.parse(
        req.CHAT_PATH,
        chat([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]),
    )
    assert (r.prompt, r.cacheable_end, r.model) == (c.prompt, c.cacheable_end, c.model)
    assert r.stored and r.previous_response_id is None and not c.stored


def test_responses_items_key_as_vllm_makes_chat_messages_of_them():
    """Parts read as text; an assistant item keeps its first part's text; a function
    call joins the assistant message before it; its output is a tool message."""
    call = '{"city":"Oslo"}'
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": call},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "thanks"},
    ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": "Checking",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "thanks"},
    ]
    r = req.parse(req.RESPONSES_PATH, responses(input=items))
    c = req.parse(req.CHAT_PATH, chat(messages))
    assert (r.prompt, r.cacheable_end) == (c.prompt, c.cacheable_end)
    # A call of its own (no assistant message before it) is an assistant message too.
    alone = req.parse(req.RESPONSES_PATH, responses(input=items[2:]))
    assert alone.prompt == req.parse(req.CHAT_PATH, chat(messages[1:])).prompt.replace(
        b"Checking", b"", 1
    )


def test_responses_items_chat_has_no_word_for_are_keyed_by_their_bytes():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"text": "think"}]}
    user = {"role": "user", "content": "x"}
    a = req.parse(req.RESPONSES_PATH, responses(input=[reasoning, user]))
    b = req.parse(req.RESPONSES_PATH, responses(input=[user]))
    assert b"think" in a.prompt and a.prompt.endswith(b.prompt)
    # Flat Responses tools key differently from chat's nested ones: both in the prompt.
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    with_tools = req.parse(req.RESPONSES_PATH, responses(input="x", tools=tools))
    assert with_tools.prompt.startswith(b"\x1dtools\x1f") and b'"name":"f"' in with_tools.prompt


def test_a_continuation_carries_its_previous_response_and_may_have_no_new_input():
    r = req.parse(
        req.RESPONSES_PATH,
        responses(input="", previous_response_id="resp_1", store=None, stream=None, model=None),
    )
    assert r.previous_response_id == "resp_1" and r.stored and not r.stream and r.model == ""
    off = req.parse(req.RESPONSES_PATH, responses(input="x", store=False, stream=True))
    assert not off.stored and off.stream and not off.stream_options


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (responses(), "empty_prompt"),  # no input at all
        (responses(input=""), "empty_prompt"),
        (responses(input=[]), "empty_prompt"),
        (responses(input=[1]), "invalid_body"),  # an item that is not an object
        (responses(input=[{"role": "user", "content": 5}]), "invalid_body"),
        (responses(input=5), "invalid_body"),
        (responses(input="x", previous_response_id=7), "invalid_body"),
        (b"[1]", "not_object"),
        (b"{", "bad_json"),
    ],
)
def test_bad_responses_bodies_name_a_reason(body, reason):
    with pytest.raises(req.RequestError) as err:
        req.parse(req.RESPONSES_PATH, body)
    assert err.value.reason == reason


def test_the_responses_path_is_routable():
    assert req.RESPONSES_PATH in req.ROUTABLE_PATHS
    assert req.canonical_path("/v1//responses?x=1") == req.RESPONSES_PATH
