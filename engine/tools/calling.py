"""Tool calling, the request side: check the tools, decide what the model may do, and build
the grammar that makes it do only that.

    problems = tool_problems(tools)                        # [] or [(param, message), ...]
    plan = plan_tools(tools, tool_choice, parallel)        # None when no tools are offered
    structured = tool_structured_output(plan, fmt, rf)     # the constraint the engine applies

`tool_choice` "required" and a named function are guaranteed: the structural tag (xgrammar)
admits only complete calls of the allowed tools whose arguments follow each tool's
`parameters`, so even a tiny model cannot produce a call that does not validate. "auto" leaves
free text free and constrains a call from the moment the model writes the format's trigger
(`<tool_call>` for Hermes); "none" adds no constraint and the answer is never parsed for calls.

Pure functions over plain dicts (the OpenAI shapes), shared by the API (openai_protocol.py,
engine/api/chat_tools.py) and the warmup templates, so a warmed grammar is byte-for-byte the one a
request compiles. No torch, no xgrammar here: the grammar is JSON, compiled by structured.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from preheat.engine.request.sampling_params import StructuredOutput
from preheat.engine.tools.parsers import ParsedCall, ToolFormat

# OpenAI allows letters, digits, '_' and '-'; '.' and ':' are common in MCP tool names.
# Nothing else, so a name is always safe inside the JSON string of a call.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
TOOL_CHOICE_MODES = ("none", "auto", "required")
# Whitespace between JSON tokens inside arguments: enough for `{"a": 1, "b": 2}`, not enough
# for a small model to pad with spaces until max_tokens.
MAX_WHITESPACE = 1

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What the model may do with the offered tools.

    `tools` are all offered tools (rendered into the prompt, so allowed_tools can narrow the
    choice without changing the cached prefix); `allowed` the names it may call."""

    tools: tuple[dict[str, Any], ...]
    mode: Mode
    allowed: tuple[str, ...]
    parallel: bool

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.allowed)


# --------------------------------------------------------------------------- checking


def tool_problems(tools: Any, path: str = "tools") -> list[tuple[str, str]]:
    """Everything wrong with a `tools` list, as (param, message), first problem first."""
    if not isinstance(tools, list):
        return [(path, "expected a list of tools")]
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        p = f"{path}.{i}"
        if not isinstance(tool, dict):
            problems.append((p, "expected a tool object"))
            continue
        if tool.get("type") != "function":
            problems.append((f"{p}.type", f"only function tools are supported, got {tool.get('type')!r}"))
            continue
        fn = tool.get("function")
        if not isinstance(fn, dict):
            problems.append((f"{p}.function", "a function tool needs a 'function' object"))
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            problems.append((f"{p}.function.name", "must be 1 to 64 letters, digits, '_', '-', '.' or ':'"))
        elif name in seen:
            problems.append((f"{p}.function.name", f"duplicate tool name {name!r} (also tools.{seen[name]})"))
        else:
            seen[name] = i
        if fn.get("description") is not None and not isinstance(fn.get("description"), str):
            problems.append((f"{p}.function.description", "must be a string"))
        if fn.get("parameters") is not None:
            why = parameters_problem(fn["parameters"])
            if why:
                problems.append((f"{p}.function.parameters", why))
    return problems


def parameters_problem(schema: Any) -> str | None:
    """Why `parameters` is not a JSON schema of an object (checked against the JSON Schema
    2020-12 meta-schema, as response_format schemas are), or None."""
    if not isinstance(schema, dict):
        return "must be a JSON schema object"
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"not a valid JSON schema{f' at /{where}' if where else ''}: {e.message}"
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        return f"must describe a JSON object (type \"object\"), got type {json.dumps(kind)}"
    return None


def tool_choice_problem(tool_choice: Any, names: list[str], path: str = "tool_choice") -> tuple[str, str] | None:
    """Why `tool_choice` is not usable with tools named `names`, or None."""
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            return path, f"must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function, got {tool_choice!r}"
        if tool_choice != "none" and not names:
            return path, f"{tool_choice!r} needs tools; this request offers none"
        return None
    if not isinstance(tool_choice, dict):
        return path, "must be a string or an object"
    if tool_choice.get("type") == "function":
        name = _choice_name(tool_choice)
        if name is None:
            return path, 'a named choice is {"type": "function", "function": {"name": ...}}'
        if name not in names:
            return path, f"names function {name!r}, which is not among the tools"
        return None
    if tool_choice.get("type") == "allowed_tools":
        allowed = tool_choice.get("allowed_tools")
        if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
            return path, 'allowed_tools needs {"mode": "auto" | "required", "tools": [...]}'
        refs = allowed.get("tools")
        if not isinstance(refs, list) or not refs:
            return f"{path}.allowed_tools.tools", "must list at least one tool"
        for j, ref in enumerate(refs):
            name = _choice_name(ref) if isinstance(ref, dict) else None
            if name is None:
                return f"{path}.allowed_tools.tools.{j}", 'expected {"type": "function", "function": {"name": ...}}'
            if name not in names:
                return f"{path}.allowed_tools.tools.{j}", f"names function {name!r}, which is not among the tools"
        return None
    return path, f"unsupported tool_choice type {tool_choice.get('type')!r}"


def _choice_name(ref: dict) -> str | None:
    """The function a choice names: Chat Completions' `{"function": {"name"}}` or the
    Responses API's flat `{"name"}`."""
    fn = ref.get("function")
    name = fn.get("name") if isinstance(fn, dict) else ref.get("name")
    return name if isinstance(name, str) else None


# --------------------------------------------------------------------------- the plan


def plan_tools(tools: list[dict] | None, tool_choice: Any = None, parallel: bool | None = None) -> ToolPlan | None:
    """The plan for checked tools (see tool_problems / tool_choice_problem); None without tools.
    OpenAI's default choice is "auto" when tools are given."""
    if not tools:
        return None
    offered = tuple(_normalized(t) for t in tools)
    names = tuple(t["function"]["name"] for t in offered)
    choice = "auto" if tool_choice is None else tool_choice
    parallel = True if parallel is None else bool(parallel)
    if isinstance(choice, str):
        return ToolPlan(offered, choice, () if choice == "none" else names, parallel)  # type: ignore[arg-type]
    if choice.get("type") == "function":
        return ToolPlan(offered, "named", (_choice_name(choice),), False)  # type: ignore[arg-type]
    allowed = choice["allowed_tools"]
    wanted = {_choice_name(r) for r in allowed["tools"]}
    return ToolPlan(offered, allowed["mode"], tuple(n for n in names if n in wanted), parallel)


def _normalized(tool: dict) -> dict[str, Any]:
    """The tool as templates and prompts see it: type, name, description, parameters (in
    canonical key order, see canonical_schema)."""
    fn = tool["function"]
    out: dict[str, Any] = {"name": fn["name"]}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["parameters"] = canonical_schema(fn.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "function", "function": out}


# --------------------------------------------------------------------------- the grammar


def arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema the grammar enforces: `parameters`, made to describe an object when it does
    not say (a schema without "type" admits any JSON value, but arguments are an object), in
    canonical key order (see canonical_schema)."""
    schema = parameters if "type" in parameters else {"type": "object", **parameters}
    return canonical_schema(schema)


_SCHEMA_MAPS = ("$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


# Keys a reader expects first (as JSON Schema is usually written); the rest follow sorted.
_KEY_ORDER = ("type", "title", "description", "enum", "const", "properties", "items", "required",
              "additionalProperties")


def _key_rank(key: str) -> tuple[int, str]:
    return (_KEY_ORDER.index(key), "") if key in _KEY_ORDER else (len(_KEY_ORDER), key)


def canonical_schema(schema: Any) -> Any:
    """The schema with its keys in one fixed order, except the order of `properties`, which
    is the order the grammar makes the model write them in. Two clients that serialise one
    tool with keys in another order (or a warmup template written by hand) then get the same
    prompt (a prefix-cache hit) and the same grammar text (the compile cache's key)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key in sorted(schema, key=_key_rank):
        value = schema[key]
        if key == "properties" and isinstance(value, dict):
            value = {name: canonical_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: canonical_schema(value[name]) for name in sorted(value)}
        elif key in _SUBSCHEMA and isinstance(value, dict):
            value = canonical_schema(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [canonical_schema(sub) for sub in value]
        out[key] = value
    return out


def tool_grammar(plan: ToolPlan | None, fmt: ToolFormat, content: dict[str, Any] | None = None) -> dict | None:
    """The xgrammar structural tag (JSON) for a plan, or None when nothing is constrained.

    - named: exactly one call of that function;
    - required: one or more calls of the allowed tools (exactly one when not parallel),
      nothing else;
    - auto: free text, in which the format's trigger opens a call that must then be complete
      and valid (Hermes: anywhere; Llama 3 JSON: the answer is either text or only calls).
      With a `content` format (response_format / regex), the answer is either calls or that.
    """
    if plan is None or not plan.active:
        return None
    by_name = {t["function"]["name"]: t["function"] for t in plan.tools}
    tags = [
        {
            "type": "tag",
            "begin": fmt.begin(name),
            "content": {
                "type": "json_schema",
                "json_schema": arguments_schema(by_name[name]["parameters"]),
                "max_whitespace_cnt": MAX_WHITESPACE,
            },
            "end": fmt.end,
        }
        for name in plan.allowed
    ]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
             "at_least_one": True, "stop_after_first": not plan.parallel}
    if plan.mode == "named":
        grammar: dict[str, Any] = tags[0]
    elif plan.mode == "required":
        grammar = calls
    elif content is not None:
        grammar = {"type": "or", "elements": [calls, content]}
    elif fmt.calls_anywhere:
        grammar = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                   "stop_after_first": not plan.parallel}
    else:
        grammar = {"type": "or", "elements": [calls, {"type": "any_text", "excludes": [fmt.trigger]}]}
    return {"type": "structural_tag", "format": grammar}


def content_format(structured: StructuredOutput | None) -> dict[str, Any] | None:
    """A response_format / regex constraint as a structural-tag format (for auto + both)."""
    if structured is None:
        return None
    if structured.kind == "regex":
        return {"type": "regex", "pattern": structured.spec}
    if structured.kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = json.loads(structured.spec) if isinstance(structured.spec, str) else structured.spec
        # Sorted as structured.py sorts a response_format schema alone, so offering tools
        # does not change the order the answer's properties come in.
        schema = json.loads(json.dumps(spec, sort_keys=True))
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def tool_structured_output(plan: ToolPlan | None, fmt: ToolFormat,
                           structured: StructuredOutput | None) -> StructuredOutput | None:
    """The one constraint the engine applies: the tool grammar when tools may be called (a
    response_format joins it under "auto" and is moot under "required" / named), else the
    request's own response_format / regex."""
    grammar = tool_grammar(plan, fmt, content_format(structured) if plan and plan.mode == "auto" else None)
    if grammar is None:
        return structured
    return StructuredOutput("structural_tag", grammar)


# --------------------------------------------------------------------------- responses


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dict(call: ParsedCall, call_id: str | None = None) -> dict[str, Any]:
    """One entry of `message.tool_calls`, as OpenAI sends it."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
