"""Chat messages (and tools) to prompt text: the one way the server and the warmup render a
chat, so what warmup caches is exactly what requests match.

Two ways to put tools and tool turns into the prompt:

- **the model's chat template**, when it takes `tools` (Qwen 2.5, Llama 3.1, Hermes, ...):
  `apply_chat_template(messages, tools=...)`, with assistant `tool_calls` (arguments as
  objects, as Hugging Face templates expect) and `role: "tool"` messages passed through;
- **the default format** otherwise (e.g. the embedded SmolLM2, whose template ignores tools):
  a system section listing the tools as JSON inside `<tools></tools>` and saying how to call
  (the format's `instructions`), prepended to the first system message or as a new one;
  earlier calls written back into the assistant turn exactly as the format generates them
  (so the next turn's prompt repeats the generated text and hits the prefix cache); tool
  results as a user turn of `<tool_response>...</tool_response>` blocks.

Which output format (parser + grammar) is used: `--tool-call-parser`, or with `auto` the one
the template's own text shows (`<tool_call>` → hermes, `<|python_tag|>` / `"parameters"` →
llama3_json), else hermes. docs: README.md "Tool calling".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from preheat.engine.engine_client import ServedEngine, Tokenizer
from preheat.engine.tools.parsers import DEFAULT_FORMAT, ToolFormat, get_format

TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n{instructions}"
)


@dataclass(frozen=True)
class ToolRendering:
    fmt: ToolFormat
    native: bool  # the chat template renders tools itself


@lru_cache(maxsize=32)
def template_facts(template: str) -> tuple[bool, str | None]:
    """(whether the template reads a `tools` variable, the format its text shows or None)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
        supports = "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except Exception:  # a template tag our plain environment lacks ({% generation %}, ...)
        supports = re.search(r"\btools\b", template) is not None
    if "<tool_call>" in template:
        guess: str | None = "hermes"
    elif "<|python_tag|>" in template or '"parameters"' in template:
        guess = "llama3_json"
    else:
        guess = None
    return supports, guess


def resolve_tool_rendering(tokenizer: Tokenizer, configured: str = "auto") -> ToolRendering:
    """How this tokenizer's chat gets tools, and which format the model answers in."""
    try:
        template = tokenizer.get_chat_template(tools=[{}])
    except Exception:  # no chat template: apply_chat_template will say so
        template = ""
    native, guess = template_facts(template) if template else (False, None)
    name = configured if configured != "auto" else (guess if native and guess else DEFAULT_FORMAT)
    return ToolRendering(get_format(name), native)


def engine_tool_rendering(engine: ServedEngine) -> ToolRendering:
    """resolve_tool_rendering for a loaded engine and its --tool-call-parser."""
    configured = getattr(getattr(engine, "config", None), "tool_call_parser", "auto")
    return resolve_tool_rendering(engine.tokenizer, configured)


def tools_section(fmt: ToolFormat, tools: Sequence[dict]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_SECTION.format(tools=listing, instructions=fmt.instructions)


def _arguments_text(call: dict) -> str:
    args = call.get("function", {}).get("arguments")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _arguments_value(text: str) -> Any:
    """Templates expect arguments as an object; a string that is not JSON is passed as is."""
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return text


def _native(messages: Sequence[dict]) -> list[dict]:
    names: dict[str, str] = {}
    conv: list[dict] = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        out: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            out["tool_calls"] = []
            for c in m["tool_calls"]:
                fn = c.get("function", {})
                if c.get("id"):
                    names[c["id"]] = fn.get("name", "")
                out["tool_calls"].append({"id": c.get("id"), "type": "function", "function": {
                    "name": fn.get("name", ""), "arguments": _arguments_value(_arguments_text(c))}})
        if role == "tool":
            out["tool_call_id"] = m.get("tool_call_id")
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            if name:
                out["name"] = name
        conv.append(out)
    return conv


def _default(messages: Sequence[dict], tools: Sequence[dict] | None, fmt: ToolFormat) -> list[dict]:
    conv: list[dict] = []
    responses = False  # the last turn is a user turn made of tool results
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if responses:
                conv[-1]["content"] += "\n" + block
            else:
                conv.append({"role": "user", "content": block})
            responses = True
            continue
        responses = False
        if role == "assistant" and m.get("tool_calls"):
            calls = fmt.calls_text([(c.get("function", {}).get("name", ""), _arguments_text(c))
                                    for c in m["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        conv.append({"role": role, "content": content})
    if tools:
        section = tools_section(fmt, tools)
        if conv and conv[0]["role"] == "system":
            head = conv[0]["content"]
            conv[0] = {"role": "system", "content": f"{head}\n\n{section}" if head else section}
        else:
            conv.insert(0, {"role": "system", "content": section})
    return conv


def render_chat(tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None,
                rendering: ToolRendering, add_generation_prompt: bool = True) -> str:
    """The prompt text. `messages` are OpenAI-shaped dicts (role, content, tool_calls,
    tool_call_id); `tools` the offered tools (OpenAI shape) or None."""
    if rendering.native:
        return tokenizer.apply_chat_template(_native(messages), tools=list(tools) if tools else None,
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer.apply_chat_template(_default(messages, tools, rendering.fmt),
                                         add_generation_prompt=add_generation_prompt, tokenize=False)


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    rendering: ToolRendering | None = None, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat: rendered, then encoded without special tokens (the template
    already wrote them)."""
    rendering = rendering or resolve_tool_rendering(tokenizer)
    text = render_chat(tokenizer, messages, tools, rendering, add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
