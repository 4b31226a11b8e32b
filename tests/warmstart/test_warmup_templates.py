"""Warmup templates: what a valid file means, and how an invalid one is reported."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from preheat.engine.warm.warmup_templates import (
    ChatMessage,
    PinnedPrefix,
    StructuredSpec,
    TemplateError,
    build_plan,
    filler_token_ids,
    load_templates,
    parse_templates,
    template_requests,
)

SHIPPED = Path(__file__).resolve().parents[2] / "warmup_templates"


def parse(text: str, source: str = "t.yaml"):
    return parse_templates(textwrap.dedent(text), source)


def problems(text: str, source: str = "t.yaml") -> list[str]:
    with pytest.raises(TemplateError) as e:
        parse(text, source)
    return e.value.problems


# --------------------------------------------------------------------------- shipped templates


def test_the_shipped_templates_load_and_cover_the_three_business_shapes():
    templates = {t.name: t for t in load_templates(SHIPPED)}
    chat = templates["customer-service"]
    assert chat.system and len(chat.system.split()) > 300  # a long system prompt, pinned
    assert chat.pin_system and len(chat.conversations) >= 3
    assert any(len(c) > 1 for c in chat.conversations)  # multi-turn
    extraction = templates["invoice-extraction"]
    assert [s.kind for s in extraction.structured] == ["json_schema"]
    assert any(s.kind == "regex" for t in templates.values() for s in t.structured)
    rag = templates["rag-travel-policy"]
    assert rag.prefix and len(rag.prefix.split()) > 300 and len(rag.prompts) >= 3
    agent = templates["support-agent"]
    assert agent.tools and len(json.loads(agent.tools)) >= 3
    assert [json.loads(c) for c in agent.tool_choices] == ["auto", "required"]


def test_the_shipped_plan_pins_the_shared_prefixes_and_runs_every_batch_size():
    plan = build_plan(load_templates(SHIPPED), batch_sizes=[1, 2, 4, 8, 16, 32], max_concurrency=32)
    kinds = {(p.template, p.kind) for p in plan.pins}
    assert ("customer-service", "chat") in kinds and ("rag-travel-policy", "text") in kinds
    assert plan.waves[0].batch_sizes == (1, 2, 4, 8, 16, 32)  # one staggered wave steps through all
    assert all(w.concurrency <= 32 for w in plan.waves)
    assert {r.structured.kind for w in plan.waves for r in w.requests if r.structured} == {"json_schema", "regex"}


# --------------------------------------------------------------------------- parsing


def test_a_file_holds_a_templates_list_or_single_templates_in_several_documents():
    ts = parse(
        """
        templates:
          - name: a
            prompts: ["x"]
          - name: b
            prompts: ["y"]
        ---
        name: c
        prompts: ["z"]
        ---
        """
    )
    assert [t.name for t in ts] == ["a", "b", "c"]
    assert ts[2].source == "t.yaml (document 2)"


def test_defaults_are_greedy_short_and_batch_size_one():
    (t,) = parse("name: a\nprompts: [hi]\n")
    assert (t.max_tokens, t.temperature, t.concurrency) == (None, 0.0, (1,))  # None: --warmup-steps
    (r,) = template_requests(t, default_max_tokens=6)
    assert (r.max_tokens, r.presence_penalty, r.frequency_penalty, r.repetition_penalty) == (6, 0.0, 0.0, 1.0)


def test_penalties_are_validated_and_reach_every_request():
    (t,) = parse("name: a\nprompts: [hi]\npresence_penalty: 0.5\nfrequency_penalty: -1\nrepetition_penalty: 1.2\n")
    (r,) = template_requests(t)
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty) == (0.5, -1.0, 1.2)
    with pytest.raises(TemplateError, match="presence_penalty: expected a number between -2 and 2"):
        parse("name: a\nprompts: [hi]\npresence_penalty: 3\n")


def test_json_schema_may_be_yaml_or_json_text_and_is_stored_canonically():
    (a,) = parse("name: a\nprompts: [p]\nstructured:\n  - json_schema: {type: object, required: [x]}\n")
    (b,) = parse('name: a\nprompts: [p]\nstructured:\n  - json_schema: \'{"required": ["x"], "type": "object"}\'\n')
    assert a.structured == b.structured
    assert json.loads(a.structured[0].spec) == {"type": "object", "required": ["x"]}


def test_concurrency_ladder_is_sorted_and_deduplicated():
    (t,) = parse("name: a\nprompts: [p]\nconcurrency: [8, 1, 4, 4]\n")
    assert t.concurrency == (1, 4, 8)


# --------------------------------------------------------------------------- errors


def test_error_names_file_template_index_and_field():
    ps = problems(
        """
        templates:
          - name: support
            pin: ["a", 3]
        """,
        source="customer_service.yaml",
    )
    assert ps == ["customer_service.yaml: templates[0].pin[1]: expected a string, got a number (3)"]


@pytest.mark.parametrize(
    "body, expected",
    [
        ("name: a\nprompts: [p]\nmax_token: 3\n", "max_token: unknown field (did you mean 'max_tokens'?)"),
        ("prompts: [p]\n", "missing required field 'name'"),
        ("name: a b\nprompts: [p]\n", "name: use letters"),
        ("name: a\nprompts: [p]\nmax_tokens: 0\n", "max_tokens: must be between 1 and 65536, got 0"),
        ("name: a\nprompts: [p]\nmax_tokens: yes\n", "max_tokens: expected an integer, got a boolean"),
        ("name: a\nprompts: [p]\ntemperature: hot\n", "temperature: expected a number between 0 and 2"),
        ("name: a\nprompts: [p]\nconcurrency: [1, 0]\n", "concurrency[1]: must be between 1 and 4096, got 0"),
        ("name: a\nprompts: [p]\nconcurrency: []\n", "concurrency: must list at least one batch size"),
        ("name: a\nprompts: p\n", "prompts: expected a list, got a string"),
        ("name: a\nprompt_lengths: [-5]\n", "prompt_lengths[0]: must be between 1"),
        ("name: a\npin_system: maybe\npin: [x]\n", "pin_system: expected true or false, got a string"),
        ("name: a\n", "warms nothing"),
        ("name: a\npin: ['']\n", "pin[0]: must not be empty"),
        ("name: a\nprompts: [p]\nstructured: [{regex: '(unclosed'}]\n", "structured[0].regex: not a valid regular"),
        ("name: a\nprompts: [p]\nstructured: [{json_schema: {type: 12}}]\n", "structured[0].json_schema: not a valid JSON schema"),
        ("name: a\nprompts: [p]\nstructured: [{json_schema: '{nope'}]\n", "structured[0].json_schema: not valid JSON"),
        ("name: a\nprompts: [p]\nstructured: [{regex: a, json_object: true}]\n", "structured[0]: expected exactly one of"),
        ("name: a\nprompts: [p]\nstructured: [{json_object: false}]\n", "structured[0].json_object: expected true"),
        ("name: a\nprompt_lengths: [5]\nstructured: [{json_object: true}]\n", "structured: needs conversations or prompts"),
        ("name: a\nconversations: [[{role: user}]]\n", "conversations[0][0]: a message needs 'role' and 'content'"),
        ("name: a\nconversations: [[{role: bot, content: hi}]]\n", "conversations[0][0].role: 'bot' is not one of"),
        ("name: a\nconversations: [[]]\n", "conversations[0]: a conversation needs at least one message"),
        (
            "name: a\nconversations: [[{role: user, content: hi}, {role: assistant, content: yo}]]\n",
            "conversations[0][1]: the last message must be from the user",
        ),
        (
            "name: a\nsystem: s\nconversations: [[{role: system, content: s2}, {role: user, content: hi}]]\n",
            "conversations[0][0].role: unexpected system message (the template already sets 'system')",
        ),
        ("- a\n- b\n", "expected a mapping with 'templates' or a single template, got a list"),
        ("templates: {name: a}\n", "templates: expected a list, got a mapping"),
    ],
)
def test_each_invalid_field_is_reported_with_its_path(body, expected):
    ps = problems(body)
    assert any(expected in p for p in ps), ps
    assert all(p.startswith("t.yaml: ") for p in ps)


def test_every_problem_is_reported_at_once_not_only_the_first():
    ps = problems(
        """
        templates:
          - name: a
            max_tokens: -1
            prompts: [3]
          - name: b
            concurrency: [x]
        """
    )
    assert len(ps) == 3 and {p.split(": ")[1] for p in ps} == {
        "templates[0].max_tokens",
        "templates[0].prompts[0]",
        "templates[1].concurrency[0]",
    }


def test_invalid_yaml_reports_line_and_column():
    (p,) = problems("name: a\nprompts: [unclosed\n")
    assert p.startswith("t.yaml: line ") and "invalid YAML" in p


def test_yaml_tags_that_would_run_code_are_refused():
    ps = problems("name: !!python/object/apply:os.system ['true']\nprompts: [p]\n")
    assert "invalid YAML" in ps[0]


def test_errors_in_a_later_document_name_that_document():
    ps = problems("name: a\nprompts: [p]\n---\nname: b\nprompts: [3]\n")
    assert ps == ["t.yaml (document 2): prompts[0]: expected a string, got a number (3)"]


# --------------------------------------------------------------------------- directories


def write(d: Path, name: str, text: str) -> None:
    (d / name).write_text(textwrap.dedent(text))


def test_directory_loading_reads_yaml_files_in_order_and_skips_the_rest(tmp_path):
    write(tmp_path, "b.yml", "name: b\nprompts: [p]\n")
    write(tmp_path, "a.yaml", "name: a\nprompts: [p]\n")
    write(tmp_path, "README.md", "not a template")
    write(tmp_path, ".hidden.yaml", "garbage: [")
    assert [t.name for t in load_templates(tmp_path)] == ["a", "b"]


def test_a_mounted_configmap_layout_is_read_once(tmp_path):
    # kubelet mounts a ConfigMap as ..<timestamp>/files, ..data -> ..<timestamp>, file -> ..data/file
    real = tmp_path / "..2025_01_01_00_00_00.000000001"
    real.mkdir()
    write(real, "chat.yaml", "name: chat\nprompts: [p]\n")
    os.symlink(real.name, tmp_path / "..data")
    os.symlink("..data/chat.yaml", tmp_path / "chat.yaml")
    assert [t.name for t in load_templates(tmp_path)] == ["chat"]


def test_directory_errors_are_collected_across_files_and_duplicates_are_refused(tmp_path):
    write(tmp_path, "a.yaml", "name: same\nprompts: [p]\n")
    write(tmp_path, "b.yaml", "name: same\nprompts: [p]\n")
    write(tmp_path, "c.yaml", "name: c\nprompts: [1]\n")
    with pytest.raises(TemplateError) as e:
        load_templates(tmp_path)
    assert e.value.problems == [
        "c.yaml: prompts[0]: expected a string, got a number (1)",
        "b.yaml: name: template 'same' is also defined in a.yaml",
    ]
    assert str(e.value).startswith("2 problem(s)")


def test_a_missing_directory_is_an_error_not_an_empty_warmup(tmp_path):
    with pytest.raises(TemplateError, match="not a directory"):
        load_templates(tmp_path / "nope")


# --------------------------------------------------------------------------- expansion


def test_a_conversation_expands_into_one_request_per_user_turn_with_the_system_prompt():
    (t,) = parse(
        """
        name: chat
        system: Be brief.
        conversations:
          - - {role: user, content: q1}
            - {role: assistant, content: a1}
            - {role: user, content: q2}
        """
    )
    reqs = template_requests(t)
    sys, q1, a1, q2 = (ChatMessage("system", "Be brief."), ChatMessage("user", "q1"),
                       ChatMessage("assistant", "a1"), ChatMessage("user", "q2"))  # fmt: skip
    assert [r.messages for r in reqs] == [(sys, q1), (sys, q1, a1, q2)]
    assert all(r.kind == "chat" and r.max_tokens == 4 and r.temperature == 0.0 for r in reqs)


def test_structured_specs_cross_the_inputs_so_every_grammar_runs_on_every_input():
    (t,) = parse(
        """
        name: x
        prefix: "DOC. "
        prompts: [a, b]
        structured: [{regex: "[0-9]+"}, {json_object: true}]
        prompt_lengths: [64]
        """
    )
    reqs = template_requests(t)
    pairs = [(r.prompt, r.structured.kind if r.structured else None) for r in reqs]
    assert pairs == [("DOC. a", "regex"), ("DOC. b", "regex"), ("DOC. a", "json_object"),
                     ("DOC. b", "json_object"), (None, None)]  # fmt: skip
    assert reqs[-1].kind == "synthetic" and reqs[-1].prompt_tokens == 64


def test_pins_are_the_system_prompt_the_prefix_and_the_pin_list_deduplicated_across_templates():
    ts = parse(
        """
        templates:
          - {name: a, system: S, prefix: P, pin: [X], prompts: [q]}
          - {name: b, system: S, pin_prefix: false, prefix: Q, prompts: [q]}
          - {name: c, system: T, pin_system: false, conversations: [[{role: user, content: hi}]]}
        """
    )
    assert build_plan(ts).pins == (
        PinnedPrefix("a", "chat", "S"),
        PinnedPrefix("a", "text", "P"),
        PinnedPrefix("a", "text", "X"),
    )


def test_a_template_that_only_pins_runs_no_requests():
    plan = build_plan(parse("name: a\npin: [some document]\n"))
    assert plan.waves == () and len(plan.pins) == 1


def _ladder_templates():
    return parse(
        """
        templates:
          - {name: a, prompts: [a1, a2, a3], concurrency: [1, 4]}
          - {name: b, prompts: [b1, b2], concurrency: [2]}
        """
    )


def test_one_staggered_wave_reaches_every_concurrency_level_with_the_fewest_requests():
    plan = build_plan(_ladder_templates(), batch_sizes=[8], default_max_tokens=3)
    (wave,) = plan.waves  # 8 requests, not 1 + 2 + 4 + 8
    assert (wave.concurrency, len(wave.requests), wave.batch_sizes) == (8, 8, (1, 2, 4, 8))
    steps = [r.max_tokens for r in wave.requests]
    assert steps == [6, 5, 4, 4, 3, 3, 3, 3]
    # Running count after each decode step: request j runs steps[j] steps.
    running = [sum(1 for n in steps if n > s) for s in range(max(steps))]
    assert set(running) == {8, 4, 2, 1}


def test_the_ladder_cycles_through_distinct_requests_before_repeating():
    plan = build_plan(_ladder_templates())
    prompts = [r.prompt for w in plan.waves for r in w.requests]
    assert prompts[:5] == ["a1", "a2", "a3", "b1", "b2"]


def test_requests_the_ladder_does_not_reach_run_in_extra_waves_at_the_top_level():
    ts = parse("name: a\nprompts: [p1, p2, p3, p4, p5, p6, p7, p8]\nconcurrency: [1, 2]\n")
    plan = build_plan(ts)
    assert [w.concurrency for w in plan.waves] == [2, 2, 2, 2]
    assert sorted(r.prompt for w in plan.waves for r in w.requests) == [f"p{i}" for i in range(1, 9)]


def test_levels_above_the_engine_limit_are_dropped_and_noted():
    plan = build_plan(_ladder_templates(), batch_sizes=[64], max_concurrency=4)
    assert [w.batch_sizes for w in plan.waves] == [(1, 2, 4), (1,)]  # 4 + the fifth request
    assert any("[64]" in n for n in plan.notes)


def test_synthetic_lengths_are_clamped_to_the_prompt_budget():
    plan = build_plan(parse("name: a\nprompt_lengths: [100, 5000]\nconcurrency: [2]\n"), max_prompt_tokens=1000)
    assert sorted(r.prompt_tokens for w in plan.waves for r in w.requests) == [100, 1000]
    assert plan.notes == ("a: prompt length 5000 clamped to 1000",)


def test_the_plan_is_deterministic():
    assert build_plan(load_templates(SHIPPED), [1, 3]) == build_plan(load_templates(SHIPPED), [1, 3])


# --------------------------------------------------------------------------- synthetic prompts


def fake_tokenize(text: str) -> list[int]:
    return [sum(map(ord, w)) % 1000 for w in text.split()]


def test_filler_prompts_have_the_exact_length_and_different_salts_diverge_at_once():
    a = filler_token_ids(fake_tokenize, 500, salt=1)
    b = filler_token_ids(fake_tokenize, 500, salt=2)
    assert len(a) == len(b) == 500
    assert a[:2] != b[:2]
    assert filler_token_ids(fake_tokenize, 3) == fake_tokenize("Sample 0. Preheat")


def test_structured_spec_is_hashable_so_equal_grammars_compile_once():
    assert len({StructuredSpec("regex", "a"), StructuredSpec("regex", "a")}) == 1


# --------------------------------------------------------------------------- tools

TOOLS_YAML = """
name: agent
system: Be brief.
tools:
  - type: function
    function:
      name: lookup
      parameters: {type: object, properties: {id: {type: string}}, required: [id]}
  - {type: function, function: {name: ping}}
tool_choice: [auto, required, {type: function, function: {name: ping}}, auto]
parallel_tool_calls: false
conversations:
  - - {role: user, content: q1}
"""


def test_tools_and_each_tool_choice_are_kept_in_order_without_duplicates():
    (t,) = parse(TOOLS_YAML)
    assert [tool["function"]["name"] for tool in json.loads(t.tools)] == ["lookup", "ping"]
    assert [json.loads(c) for c in t.tool_choices] == [
        "auto", "required", {"type": "function", "function": {"name": "ping"}}]
    assert t.parallel_tool_calls is False
    (one,) = parse("name: a\nconversations: [[{role: user, content: q}]]\n"
                   "tools: [{type: function, function: {name: f}}]\n")
    assert one.tool_choices == ('"auto"',)  # OpenAI's default when tools are offered


def test_tool_choices_cross_the_conversations_and_the_tools_join_the_pinned_system_prompt():
    (t,) = parse(TOOLS_YAML)
    reqs = template_requests(t)
    assert [(r.messages[-1].content, json.loads(r.tool_choice)) for r in reqs] == [
        ("q1", "auto"), ("q1", "required"), ("q1", {"type": "function", "function": {"name": "ping"}})]
    assert all(r.tools == t.tools and r.parallel_tool_calls is False for r in reqs)
    assert build_plan([t]).pins == (PinnedPrefix("agent", "chat", "Be brief.", t.tools),)
    (bare,) = parse(TOOLS_YAML.replace("system: Be brief.\n", ""))
    assert build_plan([bare]).pins == (PinnedPrefix("agent", "chat", None, bare.tools),)  # the tool section alone


@pytest.mark.parametrize(
    "change, expected",
    [
        (("name: ping}", "name: lookup}"), "t.yaml: tools[1].function.name: duplicate tool name 'lookup'"),
        (("{type: string}", "{type: strin}"),
         "t.yaml: tools[0].function.parameters: not a valid JSON schema at /properties/id/type"),
        (("- {type: function, function: {name: ping}}", "- {type: custom, custom: {name: ping}}"),
         "t.yaml: tools[1].type: only function tools are supported"),
        (("{name: ping}}, auto]", "{name: pong}}, auto]"), "t.yaml: tool_choice[2]: names function 'pong'"),
        (("tool_choice: [auto,", "tool_choice: [sometimes,"), "t.yaml: tool_choice[0]: must be one of"),
        (("parallel_tool_calls: false", "parallel_tool_calls: 2"), "t.yaml: parallel_tool_calls: expected true or false"),
        (("conversations:\n  - - {role: user, content: q1}", "prompts: [q1]"),
         "t.yaml: tools: needs conversations"),
    ],
)
def test_bad_tools_in_a_template_are_named_by_their_path(change, expected):
    old, new = change
    assert old in TOOLS_YAML
    found = problems(TOOLS_YAML.replace(old, new))
    assert any(p.startswith(expected) for p in found), found


def test_tool_choice_without_tools_is_an_error():
    found = problems("name: a\nconversations: [[{role: user, content: q}]]\ntool_choice: required\n")
    assert found == ["t.yaml: tool_choice: needs tools"]
