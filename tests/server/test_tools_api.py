"""Tool calling through the real `openai` SDK against the real server with the embedded
SmolLM2-135M (whose chat template ignores tools: the default Hermes format), each point
both non-streamed and streamed.

A 135M model is a poor agent, which is the point: under "required" and a named choice the
grammar alone makes its calls valid. Under "auto" it decides itself; two worked examples in
the history and a logit bias against `<tool_response>` (which it otherwise imitates instead
of `<tool_call>`) make it open a call, and from there the grammar holds it to the schema.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_process import MODEL

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ORDER_PARAMS = {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^NW-[0-9]{8}$"}}, "required": ["order_id"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "lookup_order", "description": "Status of an order",
                                      "parameters": ORDER_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "lookup_order": ORDER_PARAMS}
ASK = [{"role": "user", "content": "Where is my order NW-20481377?"}]


def example(i: int, city: str, temp: int) -> list[dict]:
    """One worked turn: question, call (content null), result, answer."""
    call_id = f"call_example{i}"
    args = json.dumps({"city": city, "unit": "celsius"})
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temp_c": temp})},
        {"role": "assistant", "content": f"It is {temp} degrees in {city}."},
    ]


# One worked example: the server under test has a 512-token context.
FEW_SHOT = [*example(0, "Paris", 21), {"role": "user", "content": "What is the weather in Berlin?"}]


def create(client, stream: bool, **kw):
    """One chat completion; a stream is folded into the same shape, keeping its chunks."""
    args = dict(model=MODEL, max_tokens=120, temperature=0, tools=TOOLS) | kw
    if not stream:
        r = client.chat.completions.create(**args)
        (choice,) = r.choices
        calls = [(c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason, None
    chunks = list(client.chat.completions.create(**args, stream=True))
    return (*fold(chunks), chunks)


def fold(chunks) -> tuple[str | None, list[tuple], str | None]:
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first chunk of a call names it
                assert tc.id and tc.id.startswith("call_") and tc.type == "function", tc
                assert tc.function.name, tc
                calls[tc.index] = [tc.id, tc.type, tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None, tc
            calls[tc.index][3] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert list(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order
    return content or None, [tuple(c) for c in calls.values()], finish


def assert_valid(calls, allowed=tuple(SCHEMAS)):
    assert calls
    for call_id, kind, name, arguments in calls:
        assert call_id.startswith("call_") and kind == "function" and name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# --------------------------------------------------------------------------- guaranteed calls


def test_required_returns_only_valid_calls_whole_and_streamed_alike(client):
    whole = create(client, False, messages=ASK, tool_choice="required")
    streamed = create(client, True, messages=ASK, tool_choice="required")
    for content, calls, finish, _ in (whole, streamed):
        assert content is None and finish == "tool_calls"
        assert_valid(calls)
    assert [c[2:] for c in whole[1]] == [c[2:] for c in streamed[1]]  # greedy: the same calls
    pieces = [tc.function.arguments for ch in streamed[3] if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2 * len(streamed[1])  # arguments arrive as generated, not in one piece


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_parallel_tool_calls_false_means_exactly_one_call(client, stream):
    content, calls, finish, _ = create(client, stream, messages=ASK, tool_choice="required",
                                       parallel_tool_calls=False)
    assert len(calls) == 1 and finish == "tool_calls"
    assert_valid(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_is_the_one_called(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish, _ = create(client, stream, messages=ASK, tool_choice=choice)
    assert [c[2] for c in calls] == ["get_weather"] and content is None and finish == "tool_calls"
    assert_valid(calls, ("get_weather",))


def test_n_choices_each_get_valid_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, n=2, temperature=1.0, seed=3,
                                       max_tokens=120)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid([(c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls])


# --------------------------------------------------------------------------- auto and none


@pytest.fixture
def no_tool_response(http) -> dict[str, int]:
    """A bias against the token after `<tool_` in `<tool_response>` (see the module doc)."""
    ids = http.post("/tokenize", json={"prompt": "<tool_response>", "add_special_tokens": False}).json()["tokens"]
    return {str(ids[3]): -100}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_reads_the_call_the_model_chose_to_make(client, stream, no_tool_response):
    content, calls, finish, _ = create(client, stream, messages=FEW_SHOT, tool_choice="auto",
                                       logit_bias=no_tool_response, max_tokens=60)
    assert finish == "tool_calls" and content is None
    assert [c[2] for c in calls] == ["get_weather"]
    assert_valid(calls)
    assert json.loads(calls[0][3])["city"] == "Berlin"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_none_never_produces_calls(client, stream, no_tool_response):
    """The same request that makes a call under auto: under none it is only ever text."""
    content, calls, finish, _ = create(client, stream, messages=FEW_SHOT, tool_choice="none",
                                       logit_bias=no_tool_response, max_tokens=60)
    assert calls == [] and finish == "stop" and content


def test_auto_with_a_response_format_answers_with_calls_or_that_format(client):
    """Either branch is valid (tests/server/test_tool_calling.py samples both)."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France? Answer in JSON."}],
        tools=TOOLS, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = r.choices[0].message
    if message.tool_calls:
        assert_valid([(c.id, c.type, c.function.name, c.function.arguments) for c in message.tool_calls])
    else:
        jsonschema.validate(json.loads(message.content), schema)


# --------------------------------------------------------------------------- history


def test_history_with_calls_and_results_is_rendered(client, http):
    body = {"messages": FEW_SHOT, "tools": TOOLS}
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    prompt = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    assert "<|im_start|>assistant\nIt is 21 degrees in Paris.<|im_end|>" in prompt
    assert '"name": "lookup_order"' in prompt  # the tools listing
    # The chat request is charged exactly that prompt.
    chat = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS, max_tokens=1)
    assert chat.usage.prompt_tokens == r.json()["count"]


# --------------------------------------------------------------------------- bad tools

BAD = {
    "not a JSON schema": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
                          "tools.0.function.parameters"),
    "duplicate names": ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    "unknown named choice": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                             "tool_choice"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice"),
    "not a function tool": ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
    "tool result without its call id": ({"messages": [{"role": "tool", "content": "1"}]}, "messages.0.tool_call_id"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_tools_are_a_400_naming_the_parameter(client, case, stream):
    extra, param = BAD[case]
    args = {"model": MODEL, "messages": ASK, "max_tokens": 1, "stream": stream, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        r = client.chat.completions.create(**args)
        list(r) if stream else None
    assert e.value.status_code == 400
    assert e.value.param == param, e.value.body
    assert e.value.type == "invalid_request_error"
