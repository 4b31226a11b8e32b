"""The tool-call parsers (engine/tools/parsers.py), pure: no model, no server."""

from __future__ import annotations

import json

import pytest

from preheat.engine.tools.parsers import (
    FORMATS,
    HermesFormat,
    Llama3JsonFormat,
    ParsedCall,
    ParsedMessage,
    collect,
    get_format,
)


def stream(fmt, text: str, step: int) -> ParsedMessage:
    """Feeds `text` in pieces of `step` characters, as tokens arrive."""
    s = fmt.streamer()
    deltas = []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i:i + step])
    return collect(deltas + s.finish())


def test_the_registry_names_each_format_and_refuses_unknown_ones():
    assert set(FORMATS) == {"hermes", "llama3_json"}
    assert isinstance(get_format("hermes"), HermesFormat)
    assert isinstance(get_format("llama3_json"), Llama3JsonFormat)
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'"):
        get_format("mistral")


# --------------------------------------------------------------------------- hermes

HERMES = get_format("hermes")

HERMES_CASES = {
    "one call, no text": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None, [("get_weather", '{"city": "Paris"}')]),
    "text then two calls": (
        'Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
        "Let me check both.", [("a", '{"x": 1}'), ("b", "{}")]),
    "braces and quotes inside strings": (
        '<tool_call>{"name": "q", "arguments": {"s": "a}\\"{b", "n": [1, {"k": [2]}]}}</tool_call>',
        None, [("q", '{"s": "a}\\"{b", "n": [1, {"k": [2]}]}')]),
    "arguments before name": (
        '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None, [("f", '{"x": 1}')]),
    "parameters instead of arguments": (
        '<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>', None, [("f", '{"x": 1}')]),
    "no call": ("The weather is fine.\n", "The weather is fine.\n", []),
    "a half-written marker at the end is text": ("Use <tool_ca", "Use <tool_ca", []),
    "not a call inside the tags is text": (
        "<tool_call>hello</tool_call> done", "<tool_call>hello</tool_call> done", []),
    "text after a call": (
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.', "Done.", [("f", "{}")]),
}


@pytest.mark.parametrize("case", HERMES_CASES, ids=list(HERMES_CASES))
def test_hermes_parses_whole_answers(case):
    text, content, calls = HERMES_CASES[case]
    parsed = HERMES.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for c in parsed.calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("case", HERMES_CASES, ids=list(HERMES_CASES))
@pytest.mark.parametrize("step", [1, 2, 3, 5, 13])
def test_hermes_streamed_in_any_pieces_adds_up_to_the_whole_answer(case, step):
    text = HERMES_CASES[case][0]
    assert stream(HERMES, text, step) == HERMES.parse(text)


def test_hermes_streams_arguments_as_they_arrive_with_the_name_first():
    s = HERMES.streamer()
    first = s.feed("Sure.\n<tool_")
    assert [(d.content, d.index) for d in first] == [("Sure.", None)]
    deltas = s.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", ""), (0, None, '{"ci')]
    deltas = s.feed('ty": "Paris"}}\n</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, None, 'ty": "Paris"}')]
    assert s.finish() == []


def test_hermes_holds_back_text_that_may_be_a_call_opening():
    s = HERMES.streamer()
    assert [d.content for d in s.feed("Hi <tool")] == ["Hi"]  # " <tool" may open a call
    assert [d.content for d in s.feed("kit")] == [" <toolkit"]


def test_a_call_cut_short_by_max_tokens_keeps_what_was_generated():
    parsed = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert parsed.calls == (ParsedCall("f", '{"city": "Pa'),)  # finish_reason says length


def test_the_call_text_is_what_the_parser_reads_back():
    text = HERMES.calls_text([("a", '{"x": 1}'), ("b", "{}")])
    assert text == ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    assert HERMES.parse(text) == ParsedMessage(None, (ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")))


# --------------------------------------------------------------------------- llama 3 JSON

LLAMA = get_format("llama3_json")

LLAMA_CASES = {
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
                 [("get_weather", '{"city": "Paris"}')]),
    "python tag and two calls": (
        '<|python_tag|>{"name": "a", "parameters": {"s": "x;}"}}; {"name": "b", "parameters": {}}', None,
        [("a", '{"s": "x;}"}'), ("b", "{}")]),
    "parameters before name": ('{"parameters": {"x": 1}, "name": "f"}', None, [("f", '{"x": 1}')]),
    "arguments instead of parameters": ('{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),
    "plain text": ("It is sunny in Paris.", "It is sunny in Paris.", []),
    "text first is never a call": ('Answer: {"name": "f", "parameters": {}}',
                                   'Answer: {"name": "f", "parameters": {}}', []),
    "JSON that is not a call is text": ('{"city": "Paris"}', '{"city": "Paris"}', []),
}


@pytest.mark.parametrize("case", LLAMA_CASES, ids=list(LLAMA_CASES))
def test_llama3_json_parses_whole_answers(case):
    text, content, calls = LLAMA_CASES[case]
    parsed = LLAMA.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


@pytest.mark.parametrize("case", LLAMA_CASES, ids=list(LLAMA_CASES))
@pytest.mark.parametrize("step", [1, 2, 7])
def test_llama3_json_streamed_in_any_pieces_adds_up_to_the_whole_answer(case, step):
    text = LLAMA_CASES[case][0]
    assert stream(LLAMA, text, step) == LLAMA.parse(text)


def test_llama3_call_text_round_trips():
    text = LLAMA.calls_text([("a", '{"x": 1}'), ("b", "{}")])
    assert text == '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert [(c.name, c.arguments) for c in LLAMA.parse(text).calls] == [("a", '{"x": 1}'), ("b", "{}")]
