"""Rendering chats with tools (engine/api/chat_render.py) with the real SmolLM2 tokenizer, whose
template ignores tools (the default format), and with tool-aware templates set on a copy."""

from __future__ import annotations

import copy
import json

import pytest
from tool_templates import LLAMA_LIKE, QWEN_LIKE

from preheat.engine.api.chat_render import (
    ToolRendering,
    render_chat,
    resolve_tool_rendering,
    template_facts,
    tools_section,
)
from preheat.engine.tools.calling import plan_tools
from preheat.engine.tools.parsers import get_format

TOOLS = plan_tools([{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]).tools

HISTORY = [
    {"role": "developer", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'},
]


def with_template(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


def test_template_facts_tell_tool_aware_templates_and_their_format(tokenizer):
    assert template_facts(tokenizer.chat_template) == (False, None)  # SmolLM2
    assert template_facts(QWEN_LIKE) == (True, "hermes")
    assert template_facts(LLAMA_LIKE) == (True, "llama3_json")
    # A tag a plain Jinja environment does not know: fall back to looking for the name.
    assert template_facts("{% generation %}{{ tools }}{% endgeneration %}")[0] is True


def test_the_format_follows_the_template_unless_the_flag_names_one(tokenizer):
    smol = resolve_tool_rendering(tokenizer)
    assert (smol.fmt.name, smol.native) == ("hermes", False)
    assert resolve_tool_rendering(tokenizer, "llama3_json").fmt.name == "llama3_json"
    llama = resolve_tool_rendering(with_template(tokenizer, LLAMA_LIKE))
    assert (llama.fmt.name, llama.native) == ("llama3_json", True)
    qwen = resolve_tool_rendering(with_template(tokenizer, QWEN_LIKE), "hermes")
    assert (qwen.fmt.name, qwen.native) == ("hermes", True)


def test_without_tools_the_prompt_is_what_the_template_alone_renders(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert render_chat(tokenizer, msgs, None, resolve_tool_rendering(tokenizer)) == plain


def test_the_default_format_puts_tools_in_the_system_message_and_history_in_the_call_syntax(tokenizer):
    rendering = resolve_tool_rendering(tokenizer)
    text = render_chat(tokenizer, HISTORY, TOOLS, rendering)
    section = tools_section(rendering.fmt, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a weather bot.\n\n" + section + "<|im_end|>")
    assert json.dumps(TOOLS[0]) in section and "<tool_call>" in section
    calls = rendering.fmt.calls_text([("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in text
    # Both results in one user turn, in order.
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
            '<tool_response>\n{"temp": 25}\n</tool_response><|im_end|>\n<|im_start|>assistant\n') in text


def test_tools_without_a_system_message_get_one(tokenizer):
    text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}], TOOLS, resolve_tool_rendering(tokenizer))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "You are a helpful AI assistant named SmolLM" not in text


def test_a_previous_answer_renders_back_exactly_as_generated_so_the_next_turn_hits_the_cache(tokenizer):
    rendering = resolve_tool_rendering(tokenizer)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = render_chat(tokenizer, ask, TOOLS, rendering)
    generated = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = rendering.fmt.parse(generated)
    answer = {"role": "assistant", "content": parsed.content, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls]}
    follow_up = render_chat(tokenizer, [*ask, answer, {"role": "tool", "tool_call_id": "call_1", "content": "21"}],
                            TOOLS, rendering)
    assert follow_up.startswith(prompt + generated + "<|im_end|>")


@pytest.mark.parametrize("template, marker, key", [(QWEN_LIKE, "<tool_call>", "arguments"),
                                                   (LLAMA_LIKE, "<|python_tag|>", "parameters")])
def test_a_tool_aware_template_renders_tools_and_tool_turns_itself(tokenizer, template, marker, key):
    tok = with_template(tokenizer, template)
    rendering = resolve_tool_rendering(tok)
    assert rendering.native
    text = render_chat(tok, HISTORY, TOOLS, rendering)
    assert json.dumps(TOOLS[0]) in text  # the template's own listing, not our section
    assert "# Tools\n\nYou may call" not in text
    assert marker in text
    assert f'"{key}": {{"city": "Paris"}}' in text  # arguments passed as an object, not a string
    assert '{"temp": 25}' in text and text.count('"city": "Rome"') == 1


def test_arguments_that_are_not_json_still_render(tokenizer):
    broken = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    for rendering in (ToolRendering(get_format("hermes"), False),
                      resolve_tool_rendering(with_template(tokenizer, QWEN_LIKE))):
        tok = tokenizer if not rendering.native else with_template(tokenizer, QWEN_LIKE)
        assert "{not json" in render_chat(tok, broken, TOOLS, rendering)
