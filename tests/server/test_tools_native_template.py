"""A model whose chat template takes tools (the shape of Llama 3.1's) served for real: the
template renders the tools and tool turns itself, the call format follows it (llama3_json,
found in the template's text), and the grammar still guarantees valid calls from a
random-weight model, through the real `openai` SDK, whole and streamed."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
import torch
from server_process import start_server
from tool_templates import LLAMA_LIKE

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[a-z]{1,12}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "Forecast for Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """A random-weight Llama (2 layers) with the SmolLM2 tokenizer and a tool-aware template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-tools")
    torch.manual_seed(7)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=1, tie_word_embeddings=False,
    )).save_pretrained(path)
    tok = copy.copy(tokenizer)  # the session's tokenizer keeps its own template
    tok.chat_template = LLAMA_LIKE
    tok.save_pretrained(path)
    srv = start_server(tmp_path_factory.mktemp("native"), "--model", str(path), "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def calls_of(client, stream: bool, **kw) -> tuple[list[tuple[str, str]], str]:
    args = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0) | kw
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], choice.finish_reason
    calls: dict[int, list[str]] = {}
    finish = ""
    for ch in client.chat.completions.create(**args, stream=True):
        for tc in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    return [tuple(c) for c in calls.values()], finish


def test_the_template_renders_tools_and_history_itself(server):
    import httpx

    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "forecast", "arguments": '{"city": "oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "rain"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60)
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
    assert "Respond with" in prompt and "# Tools" not in prompt  # the template's words, not ours
    assert '<|python_tag|>{"name": "forecast", "parameters": {"city": "oslo", "days": 2}}' in prompt
    assert "ipython<|end_header_id|>\n\nrain" in prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_calls_in_the_templates_format_are_valid(client, stream):
    calls, finish = calls_of(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]
    schema = PARAMS if name == "forecast" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_from_a_random_model_is_valid(client, stream):
    calls, finish = calls_of(client, stream, tool_choice={"type": "function", "function": {"name": "forecast"}})
    assert finish == "tool_calls" and [c[0] for c in calls] == ["forecast"]
    jsonschema.validate(json.loads(calls[0][1]), PARAMS)
