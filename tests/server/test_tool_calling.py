"""Tool checking, plans and grammars (engine/tools/calling.py): pure functions, then the
guarantee itself — under the grammar, even random logits can only produce valid calls —
with the real SmolLM2 tokenizer and xgrammar (no model)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from preheat.engine.request.sampling_params import StructuredOutput
from preheat.engine.sample.structured import GrammarBackend, apply_grammar_masks
from preheat.engine.tools.calling import (
    ToolPlan,
    canonical_schema,
    plan_tools,
    tool_choice_problem,
    tool_grammar,
    tool_problems,
    tool_structured_output,
)
from preheat.engine.tools.parsers import get_format

VOCAB = 49152
EOS = 2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ORDER = {"type": "function", "function": {
    "name": "lookup_order",
    "parameters": {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^NW-[0-9]{8}$"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 3}},
        "required": ["order_id"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: takes {}
TOOLS = [WEATHER, ORDER, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
           for t in TOOLS}


# --------------------------------------------------------------------------- checking


def fn(name="f", **extra):
    return {"type": "function", "function": {"name": name, **extra}}


BAD_TOOLS = {
    "not a list": ({"type": "function"}, "tools", "list"),
    "custom tool": ([{"type": "custom", "custom": {"name": "x"}}], "tools.0.type", "only function tools"),
    "no function": ([{"type": "function"}], "tools.0.function", "'function' object"),
    "bad name": ([fn("get weather")], "tools.0.function.name", "letters, digits"),
    "duplicate name": ([fn("a"), fn("b"), fn("a")], "tools.2.function.name", "duplicate tool name 'a'"),
    "not a schema": ([fn(parameters={"type": "strin"})], "tools.0.function.parameters", "not a valid JSON schema at /type"),
    "schema of a string": ([fn(parameters={"type": "string"})], "tools.0.function.parameters", 'type "object"'),
    "schema not an object": ([fn(parameters=["x"])], "tools.0.function.parameters", "JSON schema object"),
    "bad nested schema": ([fn(parameters={"type": "object", "properties": {"a": {"minimum": "x"}}})],
                          "tools.0.function.parameters", "/properties/a/minimum"),
}


@pytest.mark.parametrize("case", BAD_TOOLS, ids=list(BAD_TOOLS))
def test_bad_tools_are_named_by_their_parameter(case):
    tools, param, fragment = BAD_TOOLS[case]
    problems = tool_problems(tools)
    assert problems and problems[0][0] == param, problems
    assert fragment in problems[0][1]


def test_good_tools_have_no_problems():
    assert tool_problems(TOOLS) == []
    assert tool_problems([fn("mcp.server:tool-1", description="d", parameters={"properties": {}})]) == []


BAD_CHOICES = {
    "unknown mode": ("sometimes", ["f"], "tool_choice", "must be one of"),
    "required without tools": ("required", [], "tool_choice", "needs tools"),
    "auto without tools": ("auto", [], "tool_choice", "needs tools"),
    "unknown named function": ({"type": "function", "function": {"name": "g"}}, ["f"], "tool_choice", "'g'"),
    "named without a name": ({"type": "function"}, ["f"], "tool_choice", "named choice"),
    "allowed_tools naming an unknown tool": (
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "g"}}]}},
        ["f"], "tool_choice.allowed_tools.tools.0", "'g'"),
    "other type": ({"type": "custom", "name": "f"}, ["f"], "tool_choice", "unsupported"),
}


@pytest.mark.parametrize("case", BAD_CHOICES, ids=list(BAD_CHOICES))
def test_bad_tool_choices_are_refused(case):
    choice, names, param, fragment = BAD_CHOICES[case]
    problem = tool_choice_problem(choice, names)
    assert problem is not None and problem[0] == param and fragment in problem[1], problem


def test_none_needs_no_tools_and_named_choices_take_both_shapes():
    assert tool_choice_problem("none", []) is None
    assert tool_choice_problem({"type": "function", "function": {"name": "f"}}, ["f"]) is None
    assert tool_choice_problem({"type": "function", "name": "f"}, ["f"]) is None  # Responses API shape


# --------------------------------------------------------------------------- plans


def test_plans_follow_openai_defaults_and_choices():
    assert plan_tools(None) is None and plan_tools([]) is None
    auto = plan_tools(TOOLS)
    assert (auto.mode, auto.allowed, auto.parallel) == ("auto", ("get_weather", "lookup_order", "ping"), True)
    assert plan_tools(TOOLS, "none").active is False
    assert plan_tools(TOOLS, "required", False).parallel is False
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "ping"}})
    assert (named.mode, named.allowed) == ("named", ("ping",))
    narrowed = plan_tools(TOOLS, {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "ping"}}]}})
    assert (narrowed.mode, narrowed.allowed) == ("required", ("ping",))
    assert len(narrowed.tools) == 3  # all still in the prompt: the cached prefix is unchanged
    assert narrowed.tools[2]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_no_grammar_without_tools_or_under_none():
    fmt = get_format("hermes")
    assert tool_grammar(None, fmt) is None
    assert tool_grammar(plan_tools(TOOLS, "none"), fmt) is None
    rf = StructuredOutput("json_object")
    assert tool_structured_output(plan_tools(TOOLS, "none"), fmt, rf) is rf


def test_grammar_shapes_per_choice():
    fmt = get_format("hermes")
    kinds = {c: tool_grammar(plan_tools(TOOLS, c), fmt)["format"]["type"]
             for c in ("auto", "required")}
    assert kinds == {"auto": "triggered_tags", "required": "tags_with_separator"}
    named = tool_grammar(plan_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}), fmt)
    assert named["format"]["type"] == "tag" and named["format"]["begin"] == fmt.begin("ping")
    one = tool_grammar(plan_tools(TOOLS, "required", False), fmt)["format"]
    assert one["stop_after_first"] is True and one["at_least_one"] is True
    with_rf = tool_structured_output(plan_tools(TOOLS), fmt, StructuredOutput("regex", "(yes|no)"))
    assert with_rf.kind == "structural_tag"
    assert with_rf.spec["format"]["type"] == "or"
    assert with_rf.spec["format"]["elements"][1] == {"type": "regex", "pattern": "(yes|no)"}
    llama_auto = tool_grammar(plan_tools(TOOLS), get_format("llama3_json"))["format"]
    assert llama_auto["type"] == "or"  # calls only, or text that never opens one


def test_canonical_schema_fixes_key_order_but_keeps_property_order():
    a = {"type": "object", "required": ["b"], "properties": {"b": {"type": "string", "maxLength": 3}, "a": {}}}
    b = {"properties": {"b": {"maxLength": 3, "type": "string"}, "a": {}}, "required": ["b"], "type": "object"}
    assert json.dumps(canonical_schema(a)) == json.dumps(canonical_schema(b))
    assert list(canonical_schema(b)) == ["type", "properties", "required"]
    assert list(canonical_schema(a)["properties"]) == ["b", "a"]
    assert list(canonical_schema(a)["properties"]["b"]) == ["type", "maxLength"]
    plan_a = plan_tools([fn("f", parameters=a)])
    plan_b = plan_tools([fn("f", parameters=b)])
    fmt = get_format("hermes")
    assert json.dumps(tool_grammar(plan_a, fmt)) == json.dumps(tool_grammar(plan_b, fmt))


# --------------------------------------------------------------------------- the guarantee


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB)


def sample(backend, tokenizer, structured, seed: int, max_steps: int = 400, bias: dict | None = None) -> str:
    """Random logits under the grammar's mask until it ends: the worst model there is (the
    test schemas bound every string, so it ends)."""
    gen = torch.Generator().manual_seed(seed)
    matcher = backend.new_matcher(backend.compile(structured))
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, VOCAB, generator=gen) * 3
        for tok, b in (bias or {}).items():
            logits[0, tok] += b
        apply_grammar_masks(logits, [matcher])
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept_token(tok)
        if matcher.is_terminated():
            assert tok == EOS
            return tokenizer.decode(out)
        out.append(tok)
    pytest.fail(f"grammar did not end in {max_steps} steps: {tokenizer.decode(out)!r}")


def assert_valid_calls(calls, allowed):
    for call in calls:
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("seed", range(2))
def test_required_under_random_logits_gives_only_valid_calls(backend, tokenizer, fmt_name, seed):
    fmt = get_format(fmt_name)
    plan = plan_tools(TOOLS, "required", parallel=False)
    text = sample(backend, tokenizer, tool_structured_output(plan, fmt, None), seed)
    parsed = fmt.parse(text)
    assert parsed.content is None and len(parsed.calls) == 1, text
    assert_valid_calls(parsed.calls, plan.allowed)


@pytest.mark.parametrize("seed", range(1))
def test_a_named_choice_under_random_logits_calls_that_function_validly(backend, tokenizer, seed):
    fmt = get_format("hermes")
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "lookup_order"}})
    parsed = fmt.parse(sample(backend, tokenizer, tool_structured_output(plan, fmt, None), seed))
    assert [c.name for c in parsed.calls] == ["lookup_order"]
    assert_valid_calls(parsed.calls, {"lookup_order"})


def test_parallel_required_calls_are_each_valid(backend, tokenizer):
    fmt = get_format("hermes")
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    plan = plan_tools(TOOLS, "required")
    # A push towards the separator makes several calls likely.
    text = sample(backend, tokenizer, tool_structured_output(plan, fmt, None), 7, 1200, {newline: 4.0})
    parsed = fmt.parse(text)
    assert len(parsed.calls) >= 2, text
    assert_valid_calls(parsed.calls, plan.allowed)


@pytest.mark.parametrize("seed", range(1))
def test_auto_constrains_a_call_once_the_trigger_is_written(backend, tokenizer, seed):
    fmt = get_format("hermes")
    plan = plan_tools([ORDER], "auto", parallel=False)
    matcher = backend.new_matcher(backend.compile(tool_structured_output(plan, fmt, None)))
    for tok in tokenizer.encode("Checking.\n<tool_call>", add_special_tokens=False):
        assert matcher.accept_token(tok)  # free text, then the trigger
    # A call to an unknown tool or with bad arguments is now impossible...
    for bad in ['\n{"name": "other"', '\n{"name": "lookup_order", "arguments": {"order_id": "X']:
        probe = backend.new_matcher(backend.compile(tool_structured_output(plan, fmt, None)))
        ids = tokenizer.encode("Checking.\n<tool_call>" + bad, add_special_tokens=False)
        assert not all(probe.accept_token(t) for t in ids), bad
    # ... and whatever random logits write from here is a valid call.
    gen = torch.Generator().manual_seed(seed)
    out = tokenizer.encode("Checking.\n<tool_call>", add_special_tokens=False)
    while not matcher.is_terminated():
        logits = torch.randn(1, VOCAB, generator=gen) * 3
        apply_grammar_masks(logits, [matcher])
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept_token(tok)
        if tok != EOS:
            out.append(tok)
        assert len(out) < 600
    parsed = fmt.parse(tokenizer.decode(out))
    assert parsed.content == "Checking." and len(parsed.calls) == 1
    assert_valid_calls(parsed.calls, {"lookup_order"})


def test_auto_with_a_response_format_is_calls_or_that_format(backend, tokenizer):
    fmt = get_format("hermes")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    structured = tool_structured_output(plan_tools([PING]), fmt, StructuredOutput("json_schema", schema))
    branches = set()
    for seed in range(3):
        text = sample(backend, tokenizer, structured, seed)
        parsed = fmt.parse(text)
        if parsed.calls:
            assert parsed.content is None and {c.name for c in parsed.calls} == {"ping"}
        else:
            jsonschema.validate(json.loads(text), schema)
        branches.add(bool(parsed.calls))
    assert branches == {True, False}, "the seeds should reach both branches"


def test_tool_grammars_are_cached_like_any_other(backend):
    fmt = get_format("hermes")
    structured = tool_structured_output(plan_tools(TOOLS, "required"), fmt, None)
    backend.compile(structured)
    misses = backend.cache_misses
    again = tool_structured_output(plan_tools(json.loads(json.dumps(TOOLS)), "required"), fmt, None)
    backend.compile(again)
    assert backend.cache_misses == misses


def test_a_plan_is_a_value():
    assert plan_tools(TOOLS, "required") == plan_tools(TOOLS, "required")
    assert isinstance(plan_tools(TOOLS), ToolPlan)
