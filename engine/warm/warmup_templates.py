"""Warmup templates: the YAML schema, loading a directory of them, and the warmup plan.

A template describes a business workload (a customer-service chat, a JSON extraction, RAG over
a shared document) so that everything its first real request would pay for — prefill of the
long shared prefix, grammar compilation, every decode batch size — is paid before `/ready`.
The schema is documented in docs/warmup-templates.md; this module is its single source of truth.

Loading is strict: a typo in a ConfigMap must fail loudly at start with the file and the field
(`customer_service.yaml: templates[0].pin[1]: expected a string`), never warm the wrong thing.
`build_plan` is a pure function from templates to the requests the engine runs.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

ROLES = ("system", "user", "assistant")
STRUCTURED_KINDS = ("regex", "json_schema", "json_object")
TEMPLATE_SUFFIXES = (".yaml", ".yml")
# Decode steps per warmup request when neither the template nor --warmup-steps says: every
# decode step after the first runs the same code at the same batch size, so a few suffice.
DEFAULT_MAX_TOKENS = 4
DEFAULT_CONCURRENCY = (1,)
# Guards against a template that would keep the pod out of ready for minutes.
MAX_CONCURRENCY = 4096
MAX_PROMPT_LENGTH = 1_048_576
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class TemplateError(ValueError):
    """One or more templates are invalid; `problems` holds one `file: field: message` each."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = f"{len(self.problems)} problem(s) in warmup templates:\n" if len(self.problems) > 1 else ""
        super().__init__(head + "\n".join(self.problems))


# --------------------------------------------------------------------------- parsed templates


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class StructuredSpec:
    """A structured-output constraint. `spec` is the regex, or the JSON schema as canonical JSON
    text (sorted keys, so equal schemas share one compiled grammar), or "" for json_object."""

    kind: str
    spec: str


@dataclass(frozen=True)
class WarmupTemplate:
    name: str
    source: str  # "file.yaml" or "file.yaml (document 2)", for logs
    description: str = ""
    system: str | None = None  # prepended as the system message of every conversation
    pin_system: bool = True  # pin the rendered system message as a hot prefix
    prefix: str | None = None  # prepended to every raw prompt (e.g. a shared document)
    pin_prefix: bool = True
    pin: tuple[str, ...] = ()  # further raw-text prefixes to pin
    conversations: tuple[tuple[ChatMessage, ...], ...] = ()
    prompts: tuple[str, ...] = ()
    structured: tuple[StructuredSpec, ...] = ()
    prompt_lengths: tuple[int, ...] = ()
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    max_tokens: int | None = None  # None: the engine's --warmup-steps
    temperature: float = 0.0
    tools: str | None = None  # the OpenAI `tools` list as JSON text (hashable, order kept)
    tool_choices: tuple[str, ...] = ()  # each `tool_choice` to warm, as JSON text
    parallel_tool_calls: bool = True
    # Penalties (as the API's fields): a request with any of them runs the penalty sampler.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PinnedPrefix:
    """A prefix to keep hot. kind "chat": render `[{"role": "system", "content": text}]` with the
    chat template (no generation prompt) and tokenize; kind "text": tokenize `text` as is.
    The engine pins the page-aligned part of the resulting tokens. With `tools` (JSON text) a
    chat pin is what every conversation offering those tools starts with (the tool section is
    part of the system prompt), and `text` may be None (no system message of its own)."""

    template: str
    kind: Literal["chat", "text"]
    text: str | None
    tools: str | None = None


@dataclass(frozen=True)
class WarmupRequest:
    """One request to run. Exactly one of `messages`, `prompt`, `prompt_tokens` is set;
    `prompt_tokens` asks for a synthetic prompt of that many tokens (see `filler_token_ids`)."""

    template: str
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    prompt_tokens: int | None = None
    structured: StructuredSpec | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    tools: str | None = None  # chat only: the tools offered, JSON text
    tool_choice: str | None = None  # JSON text of the request's tool_choice
    parallel_tool_calls: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def kind(self) -> str:
        if self.messages is not None:
            return "chat"
        return "prompt" if self.prompt is not None else "synthetic"


@dataclass(frozen=True)
class Wave:
    """Requests submitted together, so the running batch reaches `concurrency`."""

    concurrency: int
    requests: tuple[WarmupRequest, ...]
    levels: tuple[int, ...] = ()  # the batch sizes it steps down through (staggered), if more than one
    # The wave that reaches the concurrency levels not reached yet: it runs whole (its batch
    # sizes are what it warms). Any other wave skips what would warm nothing new.
    ladder: bool = False

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.levels or (self.concurrency,)


@dataclass(frozen=True)
class WarmupPlan:
    pins: tuple[PinnedPrefix, ...]
    waves: tuple[Wave, ...]
    notes: tuple[str, ...] = ()  # what was clamped or dropped, for the log

    @property
    def num_requests(self) -> int:
        return sum(len(w.requests) for w in self.waves)


# --------------------------------------------------------------------------- validation

_TOP_KEYS = ("templates",)
_TEMPLATE_KEYS = (
    "name", "description", "system", "pin_system", "prefix", "pin_prefix", "pin",
    "conversations", "prompts", "structured", "prompt_lengths", "concurrency",
    "max_tokens", "temperature", "tools", "tool_choice", "parallel_tool_calls",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
_MESSAGE_KEYS = ("role", "content")


class _Checker:
    """Collects problems as `source: path: message` instead of stopping at the first, so a
    user fixing a ConfigMap sees everything wrong in one go."""

    def __init__(self, source: str):
        self.source = source
        self.problems: list[str] = []

    def err(self, path: str, message: str) -> None:
        self.problems.append(f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}")

    def keys(self, obj: dict, allowed: Sequence[str], path: str) -> None:
        for key in obj:
            if key not in allowed:
                near = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f" (did you mean '{near[0]}'?)" if near else f" (allowed: {', '.join(allowed)})"
                self.err(_join(path, str(key)), f"unknown field{hint}")

    def string(self, value: Any, path: str, *, allow_empty: bool = False) -> str | None:
        if not isinstance(value, str):
            self.err(path, f"expected a string, got {_kind(value)}")
            return None
        if not allow_empty and not value.strip():
            self.err(path, "must not be empty")
            return None
        return value

    def boolean(self, value: Any, path: str) -> bool | None:
        if not isinstance(value, bool):
            self.err(path, f"expected true or false, got {_kind(value)}")
            return None
        return value

    def integer(self, value: Any, path: str, lo: int, hi: int) -> int | None:
        # bool is an int in Python; `max_tokens: yes` is a mistake, not 1.
        if not isinstance(value, int) or isinstance(value, bool):
            self.err(path, f"expected an integer, got {_kind(value)}")
            return None
        if not lo <= value <= hi:
            self.err(path, f"must be between {lo} and {hi}, got {value}")
            return None
        return value

    def number(self, value: Any, path: str, lo: float, hi: float) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            self.err(path, f"expected a number between {lo:g} and {hi:g}, got {_kind(value)}")
            return None
        return float(value)

    def seq(self, value: Any, path: str) -> list | None:
        if not isinstance(value, list):
            self.err(path, f"expected a list, got {_kind(value)}")
            return None
        return value

    def mapping(self, value: Any, path: str) -> dict | None:
        if not isinstance(value, dict):
            self.err(path, f"expected a mapping, got {_kind(value)}")
            return None
        return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _parse_message(c: _Checker, raw: Any, path: str) -> ChatMessage | None:
    m = c.mapping(raw, path)
    if m is None:
        return None
    c.keys(m, _MESSAGE_KEYS, path)
    if "role" not in m or "content" not in m:
        c.err(path, "a message needs 'role' and 'content'")
        return None
    role = c.string(m["role"], _join(path, "role"))
    if role is not None and role not in ROLES:
        c.err(_join(path, "role"), f"'{role}' is not one of {', '.join(ROLES)}")
        role = None
    content = c.string(m["content"], _join(path, "content"), allow_empty=True)
    if role is None or content is None:
        return None
    return ChatMessage(role, content)


def _parse_conversation(c: _Checker, raw: Any, path: str, has_system: bool) -> tuple[ChatMessage, ...] | None:
    items = c.seq(raw, path)
    if items is None:
        return None
    if not items:
        c.err(path, "a conversation needs at least one message")
        return None
    before = len(c.problems)
    msgs = [_parse_message(c, m, f"{path}[{i}]") for i, m in enumerate(items)]
    if len(c.problems) > before:
        return None
    convo = tuple(m for m in msgs if m is not None)
    for i, m in enumerate(convo):
        if m.role == "system" and (i > 0 or has_system):
            why = "the template already sets 'system'" if has_system else "only the first message may be"
            c.err(f"{path}[{i}].role", f"unexpected system message ({why})")
            return None
    if convo[-1].role != "user":
        c.err(f"{path}[{len(convo) - 1}]", "the last message must be from the user (it is what gets answered)")
        return None
    return convo


def _parse_structured(c: _Checker, raw: Any, path: str) -> StructuredSpec | None:
    m = c.mapping(raw, path)
    if m is None:
        return None
    c.keys(m, STRUCTURED_KINDS, path)
    kinds = [k for k in STRUCTURED_KINDS if k in m]
    if len(kinds) != 1:
        c.err(path, f"expected exactly one of {', '.join(STRUCTURED_KINDS)}")
        return None
    kind = kinds[0]
    value, vpath = m[kind], _join(path, kind)
    if kind == "regex":
        pattern = c.string(value, vpath)
        if pattern is None:
            return None
        try:
            re.compile(pattern)
        except re.error as e:
            c.err(vpath, f"not a valid regular expression: {e}")
            return None
        return StructuredSpec("regex", pattern)
    if kind == "json_object":
        if value is not True:
            c.err(vpath, "expected true")
            return None
        return StructuredSpec("json_object", "")
    # json_schema: a mapping in YAML, or JSON text.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            c.err(vpath, f"not valid JSON: {e}")
            return None
    if not isinstance(value, dict):
        c.err(vpath, f"expected a JSON schema (a mapping), got {_kind(value)}")
        return None
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        c.err(vpath, f"not a valid JSON schema{f' at /{where}' if where else ''}: {e.message}")
        return None
    return StructuredSpec("json_schema", json.dumps(value, sort_keys=True, separators=(",", ":")))


def _api_path(path: str, param: str) -> str:
    """A tool checker's `tools.1.function.name` as this file writes paths: `tools[1].function.name`."""
    rel = re.sub(r"\.(\d+)", r"[\1]", param)
    return f"{path}.{rel}" if path else rel


def _parse_tools(c: _Checker, t: dict, path: str) -> tuple[str | None, tuple[str, ...], bool]:
    """`tools`, `tool_choice` (one value or a list of them) and `parallel_tool_calls`, checked
    by the same code as the API's (engine/tools/calling.py), so a template is refused for
    exactly what a request would be."""
    from preheat.engine.tools.calling import tool_choice_problem, tool_problems

    parallel = True
    if "parallel_tool_calls" in t:
        parallel = c.boolean(t["parallel_tool_calls"], _join(path, "parallel_tool_calls"))
        parallel = True if parallel is None else parallel
    if "tools" not in t:
        for key in ("tool_choice", "parallel_tool_calls"):
            if key in t:
                c.err(_join(path, key), "needs tools")
        return None, (), parallel
    tools = t["tools"]
    if not isinstance(tools, list) or not tools:
        c.err(_join(path, "tools"), "expected a non-empty list of tools")
        return None, (), parallel
    problems = tool_problems(tools)
    for param, message in problems:
        c.err(_join(path, _api_path("", param)), message)
    if problems:
        return None, (), parallel
    names = [tool["function"]["name"] for tool in tools]
    raw = t.get("tool_choice", ["auto"])
    choices = raw if isinstance(raw, list) else [raw]
    if not choices:
        c.err(_join(path, "tool_choice"), "must list at least one choice")
    seen: list[str] = []
    for i, choice in enumerate(choices):
        where = _join(path, f"tool_choice[{i}]" if isinstance(raw, list) else "tool_choice")
        problem = tool_choice_problem(choice, names)
        if problem:
            at, message = problem  # "tool_choice" or "tool_choice.allowed_tools.tools.0"
            c.err(where + _api_path("", at)[len("tool_choice"):], message)
            continue
        text = json.dumps(choice, sort_keys=True)
        if text not in seen:
            seen.append(text)
    return json.dumps(tools, separators=(",", ":")), tuple(seen), parallel


def _parse_list(c: _Checker, t: dict, key: str, path: str, parse_item) -> tuple:
    if key not in t:
        return ()
    items = c.seq(t[key], _join(path, key))
    if items is None:
        return ()
    out = [parse_item(item, f"{_join(path, key)}[{i}]") for i, item in enumerate(items)]
    return tuple(x for x in out if x is not None)


def _parse_template(c: _Checker, raw: Any, path: str) -> WarmupTemplate | None:
    t = c.mapping(raw, path)
    if t is None:
        return None
    before = len(c.problems)
    c.keys(t, _TEMPLATE_KEYS, path)
    name = c.string(t["name"], _join(path, "name")) if "name" in t else None
    if "name" not in t:
        c.err(path, "missing required field 'name'")
    elif name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        c.err(_join(path, "name"), "use letters, digits, '-', '_' and '.' only (it labels logs and metrics)")

    def opt(key: str, check, default):
        if key not in t:
            return default
        value = check(t[key], _join(path, key))
        return default if value is None else value

    system = opt("system", c.string, None)
    prefix = opt("prefix", c.string, None)
    pin_system = opt("pin_system", c.boolean, True)
    pin_prefix = opt("pin_prefix", c.boolean, True)
    description = opt("description", lambda v, p: c.string(v, p, allow_empty=True), "")
    max_tokens = opt("max_tokens", lambda v, p: c.integer(v, p, 1, 65536), None)
    temperature = opt("temperature", lambda v, p: c.number(v, p, 0.0, 2.0), 0.0)
    presence = opt("presence_penalty", lambda v, p: c.number(v, p, -2.0, 2.0), 0.0)
    frequency = opt("frequency_penalty", lambda v, p: c.number(v, p, -2.0, 2.0), 0.0)
    repetition = opt("repetition_penalty", lambda v, p: c.number(v, p, 0.01, 10.0), 1.0)

    pins = _parse_list(c, t, "pin", path, lambda v, p: c.string(v, p))
    convos = _parse_list(c, t, "conversations", path, lambda v, p: _parse_conversation(c, v, p, system is not None))
    prompts = _parse_list(c, t, "prompts", path, lambda v, p: c.string(v, p))
    structured = _parse_list(c, t, "structured", path, lambda v, p: _parse_structured(c, v, p))
    lengths = _parse_list(c, t, "prompt_lengths", path, lambda v, p: c.integer(v, p, 1, MAX_PROMPT_LENGTH))
    ladder = _parse_list(c, t, "concurrency", path, lambda v, p: c.integer(v, p, 1, MAX_CONCURRENCY))
    if "concurrency" in t and isinstance(t["concurrency"], list) and not t["concurrency"]:
        c.err(_join(path, "concurrency"), "must list at least one batch size")
    tools, tool_choices, parallel = _parse_tools(c, t, path)

    if len(c.problems) > before:
        return None
    if not (convos or prompts or lengths or (system and pin_system) or (prefix and pin_prefix) or pins):
        c.err(path, "warms nothing: give conversations, prompts, prompt_lengths or something to pin")
        return None
    if structured and not (convos or prompts):
        c.err(_join(path, "structured"), "needs conversations or prompts to run the grammars with")
        return None
    if tools and not convos:
        c.err(_join(path, "tools"), "needs conversations to offer the tools in (prompts are not chats)")
        return None
    assert name is not None
    return WarmupTemplate(
        name=name, source=c.source, description=description, system=system,
        pin_system=pin_system, prefix=prefix, pin_prefix=pin_prefix, pin=pins,
        conversations=convos, prompts=prompts, structured=structured,
        prompt_lengths=lengths, concurrency=tuple(sorted(set(ladder))) or DEFAULT_CONCURRENCY,
        max_tokens=max_tokens, temperature=temperature, tools=tools, tool_choices=tool_choices,
        parallel_tool_calls=parallel, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition,
    )  # fmt: skip


def _parse_document(c: _Checker, doc: Any) -> list[WarmupTemplate]:
    """A document is `{templates: [...]}` or one template mapping (has a `name`)."""
    if doc is None:  # an empty document (a trailing `---`) is harmless
        return []
    if not isinstance(doc, dict):
        c.err("", f"expected a mapping with 'templates' or a single template, got {_kind(doc)}")
        return []
    if "templates" not in doc:
        t = _parse_template(c, doc, "")
        return [t] if t is not None else []
    c.keys(doc, _TOP_KEYS, "")
    items = c.seq(doc["templates"], "templates")
    if items is None:
        return []
    out = [_parse_template(c, item, f"templates[{i}]") for i, item in enumerate(items)]
    return [t for t in out if t is not None]


def parse_templates(text: str, source: str) -> list[WarmupTemplate]:
    """Parses one YAML file (one or more documents). Raises TemplateError."""
    try:
        # Safe loading (a template is config, never code), by libyaml when PyYAML has it:
        # the pure-Python parser took ~40 ms of a restart for the shipped templates.
        docs = list(yaml.load_all(text, Loader=SAFE_LOADER))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise TemplateError([f"{source}: {where}invalid YAML: {problem}"]) from None
    problems: list[str] = []
    templates: list[WarmupTemplate] = []
    for i, doc in enumerate(docs):
        c = _Checker(source if len(docs) == 1 or i == 0 else f"{source} (document {i + 1})")
        templates += _parse_document(c, doc)
        problems += c.problems
    if problems:
        raise TemplateError(problems)
    return templates


def template_files(directory: str | os.PathLike) -> list[Path]:
    """The YAML files of a template directory, sorted. Hidden entries are skipped: a mounted
    ConfigMap holds `..data` and `..<timestamp>` entries beside symlinks to the real files."""
    d = Path(directory)
    if not d.is_dir():
        raise TemplateError([f"{d}: not a directory"])
    return sorted(
        p for p in d.iterdir() if not p.name.startswith(".") and p.suffix in TEMPLATE_SUFFIXES and p.is_file()
    )


def load_templates(directory: str | os.PathLike) -> list[WarmupTemplate]:
    """Loads every template in a directory; raises one TemplateError listing every problem."""
    problems: list[str] = []
    templates: list[WarmupTemplate] = []
    for path in template_files(directory):
        try:
            text = path.read_text(encoding="utf-8")
            templates += parse_templates(text, path.name)
        except TemplateError as e:
            problems += e.problems
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{path.name}: cannot read: {e}")
    seen: dict[str, str] = {}
    for t in templates:
        if t.name in seen:
            problems.append(f"{t.source}: name: template '{t.name}' is also defined in {seen[t.name]}")
        seen.setdefault(t.name, t.source)
    if problems:
        raise TemplateError(problems)
    return templates


# --------------------------------------------------------------------------- expansion


def _turns(template: WarmupTemplate, convo: tuple[ChatMessage, ...]) -> list[tuple[ChatMessage, ...]]:
    """Every prefix of a conversation that ends at a user message: turn 1, turns 1-2, ...
    Running each turn warms the growing history the way a real multi-turn chat reuses it."""
    full = ((ChatMessage("system", template.system),) if template.system is not None else ()) + convo
    return [full[: i + 1] for i, m in enumerate(full) if m.role == "user"]


def template_requests(template: WarmupTemplate, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[WarmupRequest]:
    """The distinct requests of one template, each to run at least once.
    Structured specs are crossed with the conversations and prompts, and tool choices with
    the conversations, so every grammar is compiled and exercised on the inputs it is meant for."""
    chats: list[dict[str, Any]] = []
    for convo in template.conversations:
        chats += [{"messages": turn} for turn in _turns(template, convo)]
    prompts = [{"prompt": (template.prefix or "") + prompt} for prompt in template.prompts]
    grammars: Sequence[StructuredSpec | None] = template.structured or (None,)
    common = {"template": template.name, "max_tokens": template.max_tokens or default_max_tokens,
              "temperature": template.temperature, "presence_penalty": template.presence_penalty,
              "frequency_penalty": template.frequency_penalty,
              "repetition_penalty": template.repetition_penalty}
    tool_sets: list[dict[str, Any]] = [
        {"tools": template.tools, "tool_choice": choice, "parallel_tool_calls": template.parallel_tool_calls}
        for choice in template.tool_choices
    ] or [{}]
    out = []
    for g in grammars:
        out += [WarmupRequest(**common, **b, **tl, structured=g) for tl in tool_sets for b in chats]
        out += [WarmupRequest(**common, **b, structured=g) for b in prompts]
    out += [WarmupRequest(**common, prompt_tokens=n) for n in template.prompt_lengths]
    return out


def template_pins(template: WarmupTemplate) -> list[PinnedPrefix]:
    pins: list[PinnedPrefix] = []
    if (template.system is not None or template.tools) and template.pin_system:
        pins.append(PinnedPrefix(template.name, "chat", template.system, template.tools))
    if template.prefix is not None and template.pin_prefix:
        pins.append(PinnedPrefix(template.name, "text", template.prefix))
    pins += [PinnedPrefix(template.name, "text", p) for p in template.pin]
    return pins


def stagger(requests: Sequence[WarmupRequest], levels: Sequence[int]) -> tuple[WarmupRequest, ...]:
    """One wave that reaches every level: all `levels[-1]` requests start together, and
    request j decodes one step longer per level below the one it is the first beyond, so
    the running batch steps down top -> ... -> levels[0], at least one decode step at each
    (the old ladder ran one wave per level: 1 + 2 + 4 + 8 + 16 requests for what 16 do).
    A request that stops early (a grammar ends it) only makes a level shorter."""
    ordered = sorted(set(levels))
    out = []
    for j, r in enumerate(requests):
        extra = sum(1 for level in ordered[:-1] if j < level)
        out.append(WarmupRequest(**{**r.__dict__, "max_tokens": r.max_tokens + extra}) if extra else r)
    return tuple(out)


def build_plan(
    templates: Sequence[WarmupTemplate],
    batch_sizes: Iterable[int] = (),
    max_concurrency: int | None = None,
    max_prompt_tokens: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    reached: Iterable[int] = (),
) -> WarmupPlan:
    """Expands templates into pins and waves. Pure and deterministic.

    - The concurrency levels are the union of every template's ladder and `batch_sizes` (the
      engine passes the batch sizes its runner specialises, e.g. the captured CUDA-graph sizes,
      so each one is replayed), capped at `max_concurrency` (the engine's max_num_seqs).
    - The first wave (the `ladder`) reaches every level not in `reached` (levels an earlier
      warmup of this process reached already: the built-in warmup reaches the templates'
      too) with the fewest requests: as many as the highest such level start together, the
      templates' distinct requests first, then copies of the cheapest one (`filler`),
      staggered (see `stagger`) so the batch steps down through every lower level. With
      every level reached there is no ladder.
    - The other requests run in waves at the highest level; the runner skips those that
      would warm nothing new (engine/warm/warmup_runner.py), so every code path, prompt not
      cached yet and grammar is warmed once.
    - Synthetic prompt lengths are clamped to `max_prompt_tokens` (prompt budget of the model).
    - A template without `max_tokens` decodes `default_max_tokens` steps (--warmup-steps).
    """
    notes: list[str] = []
    pins: list[PinnedPrefix] = []
    seen_pins: set[tuple[str, str | None, str | None]] = set()
    requests: list[WarmupRequest] = []
    for t in templates:
        for p in template_pins(t):
            if (p.kind, p.text, p.tools) not in seen_pins:  # templates may share a system prompt
                seen_pins.add((p.kind, p.text, p.tools))
                pins.append(p)
        requests += template_requests(t, default_max_tokens)

    if max_prompt_tokens is not None:
        clamped: list[WarmupRequest] = []
        for r in requests:
            if r.prompt_tokens is not None and r.prompt_tokens > max_prompt_tokens:
                notes.append(f"{r.template}: prompt length {r.prompt_tokens} clamped to {max_prompt_tokens}")
                r = WarmupRequest(**{**r.__dict__, "prompt_tokens": max_prompt_tokens})
            clamped.append(r)
        requests = clamped

    levels = sorted({n for t in templates for n in t.concurrency} | {int(b) for b in batch_sizes if int(b) >= 1})
    if max_concurrency is not None:
        dropped = [n for n in levels if n > max_concurrency]
        if dropped:
            notes.append(f"concurrency {dropped} above the engine's limit {max_concurrency}: dropped")
        levels = [n for n in levels if n <= max_concurrency] or [max_concurrency]
    if not requests:
        return WarmupPlan(tuple(pins), (), tuple(notes))

    top = levels[-1]
    done = set(reached)
    missing = [n for n in levels if n not in done]
    waves: list[Wave] = []
    rest = requests
    if missing:
        size = missing[-1]
        first = requests[:size] + [filler(requests)] * (size - len(requests[:size]))
        waves.append(Wave(size, stagger(first, missing), tuple(missing) if len(missing) > 1 else (), ladder=True))
        rest = requests[size:]  # what the ladder did not reach
    waves += [Wave(len(rest[i : i + top]), tuple(rest[i : i + top])) for i in range(0, len(rest), top)]
    return WarmupPlan(tuple(pins), tuple(waves), tuple(notes))


def filler(requests: Sequence[WarmupRequest]) -> WarmupRequest:
    """The request a ladder repeats to reach its size when the templates have fewer distinct
    ones: the first with no grammar, no penalties, greedy and a real prompt (a copy of the
    built-in prefill prompt would prefill a chunk per copy)."""
    for r in requests:
        if (r.structured is None and r.tools is None and r.prompt_tokens is None and r.temperature == 0
                and not (r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1.0)):
            return r
    return requests[0]


_FILLER = (
    "Preheat warms a language model server before it reports ready, so the first real "
    "request costs what a steady-state request costs. This paragraph is filler text used "
    "only to reach a prompt length; its words carry no meaning for the answer. "
)


def filler_token_ids(tokenize, n_tokens: int, salt: int = 0) -> list[int]:
    """A synthetic prompt of exactly `n_tokens` tokens for `WarmupRequest.prompt_tokens`.
    `tokenize(text) -> list[int]`. The salt starts the text so two synthetic prompts do not
    share a prefix: a prompt-length warmup must run a full prefill, not a cache hit."""
    if n_tokens < 1:
        raise ValueError("n_tokens must be at least 1")
    text = f"Sample {salt}. " + _FILLER
    ids = list(tokenize(text))
    if not ids:
        raise ValueError("tokenize returned no tokens for the filler text")
    filler = list(tokenize(_FILLER)) or ids
    while len(ids) < n_tokens:
        ids += filler
    return ids[:n_tokens]
