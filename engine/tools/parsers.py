"""Tool-call output formats: how a model family writes calls, and how to read them back.

Each format (a `ToolFormat`) knows both directions, so the grammar that constrains a call and
the parser that reads it can never disagree:

- `call_text(name, arguments)`: the exact text of one call (history rendering, docs, tests);
- `begin(name)` / `end` / `separator` / `trigger`: the pieces the xgrammar structural tag is
  built from (engine/tools/calling.py `tool_grammar`);
- `streamer()`: an incremental parser fed the generated text piece by piece, which yields
  content and tool-call deltas; `parse(text)` is that same streamer run over the whole text,
  so a non-streamed answer is exactly the concatenation of the streamed one.

Registered formats (`FORMATS`, by name): `hermes` (Hermes / Qwen 2.5+ / the default:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the text) and
`llama3_json` (Llama 3.x JSON: `{"name": ..., "parameters": {...}}`, calls only, at the start of
the answer, separated by `; `). Everything here is pure: no model, no tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as generated


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when the answer holds only calls (or nothing)
    calls: tuple[ParsedCall, ...]


@dataclass
class Delta:
    """One streaming event: `content` text, or a piece of call `index` (`name` set on its first
    piece only; `arguments` pieces concatenate to the call's JSON arguments)."""

    content: str = ""
    index: int | None = None
    name: str | None = None
    arguments: str = ""


# --------------------------------------------------------------------------- JSON scanning


class JsonObjectScanner:
    """Finds where a JSON object that starts at the first character fed ends, one piece at a
    time, without parsing it: tracks nesting depth outside strings, and string escapes."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """Consumes text; returns how many characters belong to the object (all of them
        until the closing brace is seen, then the count up to and including it)."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if not self.started:
                if ch != "{":
                    raise ValueError("not an object")
                self.started = True
                self.depth = 1
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def _object_arguments(value: object) -> str | None:
    """The arguments of a parsed call as JSON text, when they are an object."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


def _longest_partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: text that
    could still turn into the marker and so must not be streamed as content yet."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# --------------------------------------------------------------------------- formats


class ToolStreamer:
    """Base of the incremental parsers: owns the content side (whitespace next to calls is
    dropped, so an answer of only calls has no content) and the call numbering."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text[:pos] is consumed
        self.calls = 0  # calls opened so far
        self.out: list[Delta] = []
        self._held_ws = ""  # trailing whitespace not yet streamed
        self._skip_ws = False  # right after a call: leading whitespace is dropped
        self.finished = False

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """The generation ended: flush what was held back; an unfinished call is reported as
        far as it got (its arguments may then be incomplete, as for a `length` finish)."""
        if not self.finished:
            self.finished = True
            self._advance(final=True)
            if self._held_ws and not self.calls:
                self.out.append(Delta(content=self._held_ws))
            self._held_ws = ""
        return self._take()

    def _take(self) -> list[Delta]:
        out, self.out = self.out, []
        return out

    def _content(self, text: str, before_call: bool = False) -> None:
        text = self._held_ws + text
        self._held_ws = ""
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        body = text.rstrip()
        if not before_call:
            self._held_ws = text[len(body):]
        if body:
            self.out.append(Delta(content=body))

    def _open_call(self, name: str) -> int:
        index = self.calls
        self.calls += 1
        self._held_ws = ""
        self.out.append(Delta(index=index, name=name))
        return index

    def _arguments(self, index: int, text: str) -> None:
        if text:
            self.out.append(Delta(index=index, arguments=text))

    def _advance(self, final: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


_NAME = r'"((?:[^"\\]|\\.)*)"'


class ToolFormat:
    """A model family's tool-call syntax. Subclasses set the class attributes and `streamer`."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # text that opens a call (the structural tag's trigger)
    separator: ClassVar[str]  # between two calls
    end: ClassVar[str]  # after a call's arguments object
    arguments_key: ClassVar[str]
    calls_anywhere: ClassVar[bool]  # may text come before a call (else: text or calls only)
    instructions: ClassVar[str]  # how to call, for the default prompt (chat_render.py)

    def begin(self, name: str) -> str:
        """Text of a call up to (not including) its arguments object."""
        raise NotImplementedError

    def call_text(self, name: str, arguments: str) -> str:
        return self.begin(name) + arguments + self.end

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return self.separator.join(self.call_text(n, a) for n, a in calls)

    def streamer(self) -> ToolStreamer:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedMessage:
        """The whole answer at once; the same result as streaming it."""
        s = self.streamer()
        return collect(s.feed(text) + s.finish())


def collect(deltas: list[Delta]) -> ParsedMessage:
    """Folds streaming deltas into the message they add up to."""
    content = "".join(d.content for d in deltas)
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.name is not None:
            names[d.index] = d.name
        args.setdefault(d.index, []).append(d.arguments)
    calls = tuple(ParsedCall(names[i], "".join(args[i])) for i in sorted(names))
    return ParsedMessage(content or None, calls)


# --------------------------------------------------------------------------- hermes


class HermesFormat(ToolFormat):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, anywhere in the text,
    calls separated by a newline (NousResearch Hermes 2/3, Qwen 2.5 / Qwen 3 instruct)."""

    name = "hermes"
    trigger = "<tool_call>"
    close = "</tool_call>"
    separator = "\n"
    end = "}\n</tool_call>"
    arguments_key = "arguments"
    calls_anywhere = True
    instructions = (
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def begin(self, name: str) -> str:
        return '<tool_call>\n{"name": "' + name + '", "arguments": '

    def streamer(self) -> ToolStreamer:
        return _HermesStreamer()


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


class _HermesStreamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self.state = "text"  # text -> head -> args -> tail -> text ...
        self.index = -1
        self.scanner: JsonObjectScanner | None = None
        self.call_start = 0  # where the current `<tool_call>` began, for the fallback

    def _advance(self, final: bool) -> None:
        fmt = HermesFormat
        while True:
            rest = self.text[self.pos:]
            if self.state == "text":
                i = rest.find(fmt.trigger)
                if i < 0:
                    keep = 0 if final else _longest_partial(rest, fmt.trigger)
                    self._content(rest[: len(rest) - keep])
                    self.pos += len(rest) - keep
                    return
                self._content(rest[:i], before_call=True)
                self.call_start = self.pos + i
                self.pos += i + len(fmt.trigger)
                self.state = "head"
            elif self.state == "head":
                m = _HERMES_HEAD.match(rest)
                close = rest.find(fmt.close)
                if m and rest[m.end()] == "{" and (close < 0 or m.end() < close):
                    self.index = self._open_call(json.loads(f'"{m.group(1)}"'))
                    self.pos += m.end()
                    self.scanner = JsonObjectScanner()
                    self.state = "args"
                    continue
                if close < 0 and not final:
                    return  # the head may still complete
                body = rest if close < 0 else rest[:close]
                self.pos += len(rest) if close < 0 else close + len(fmt.close)
                self._whole_call(body, self.text[self.call_start: self.pos])
                self.state = "text"
            elif self.state == "args":
                assert self.scanner is not None
                n = self.scanner.feed(rest)
                self._arguments(self.index, rest[:n])
                self.pos += n
                if not self.scanner.done:
                    return
                self.state = "tail"
            elif self.state == "tail":
                close = rest.find(fmt.close)
                if close < 0:
                    if final:
                        self.pos = len(self.text)
                        self._skip_ws = True
                    return
                self.pos += close + len(fmt.close)
                self._skip_ws = True
                self.state = "text"

    def _whole_call(self, body: str, raw: str) -> None:
        """A call whose head is not in the usual order: parse its JSON whole, or, when it is
        not a call at all, give its text back as content."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            text = _object_arguments(args)
            if text is not None:
                index = self._open_call(obj["name"])
                self._arguments(index, text)
                self._skip_ws = True
                return
        self._content(raw)


# --------------------------------------------------------------------------- llama 3 JSON


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 / 3.2 JSON tool calls: the answer is `{"name": "f", "parameters": {...}}`
    (optionally after `<|python_tag|>`), several calls separated by `; `. Text that does not
    start with a call is plain content (vLLM's `llama3_json` reads it the same way)."""

    name = "llama3_json"
    trigger = '{"name": '
    separator = "; "
    end = "}"
    arguments_key = "parameters"
    calls_anywhere = False
    instructions = (
        "To call a function, respond with only a JSON object of the form "
        '{"name": <function-name>, "parameters": <args-json-object>}; for several calls, '
        'separate the objects with "; ". Do not use variables.'
    )

    def begin(self, name: str) -> str:
        return '{"name": "' + name + '", "parameters": '

    def streamer(self) -> ToolStreamer:
        return _Llama3Streamer()


_LLAMA_HEAD = re.compile(r'\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\S)')
_PYTHON_TAG = "<|python_tag|>"


class _Llama3Streamer(ToolStreamer):
    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start -> (content | head -> args -> tail -> head ...)
        self.index = -1
        self.scanner: JsonObjectScanner | None = None

    def _advance(self, final: bool) -> None:
        while True:
            rest = self.text[self.pos:]
            if self.state == "start":
                stripped = rest.lstrip()
                if stripped.startswith(_PYTHON_TAG):
                    self.pos += len(rest) - len(stripped) + len(_PYTHON_TAG)
                    continue
                if not stripped or (_PYTHON_TAG.startswith(stripped) and not final):
                    if final:
                        self._content(rest)
                        self.pos = len(self.text)
                    return
                if stripped[0] == "{":
                    self.pos += len(rest) - len(stripped)
                    self.state = "head"
                else:
                    self.state = "content"
            elif self.state == "content":
                self._content(rest)
                self.pos = len(self.text)
                return
            elif self.state == "head":
                m = _LLAMA_HEAD.match(rest)
                if m and rest[m.end()] == "{":
                    self.index = self._open_call(json.loads(f'"{m.group(1)}"'))
                    self.pos += m.end()
                    self.scanner = JsonObjectScanner()
                    self.state = "args"
                    continue
                # Not in the usual key order: wait for the whole object, then read it.
                scanner = JsonObjectScanner()
                try:
                    n = scanner.feed(rest)
                except ValueError:
                    self.state = "content"
                    continue
                if not scanner.done:
                    if final:
                        self.state = "content"
                        continue
                    return
                if not self._whole_call(rest[:n]):
                    self.state = "content"
                    continue
                self.pos += n
                self.state = "tail"
            elif self.state == "args":
                assert self.scanner is not None
                n = self.scanner.feed(rest)
                self._arguments(self.index, rest[:n])
                self.pos += n
                if not self.scanner.done:
                    return
                self.state = "close"
            elif self.state == "close":  # the outer object's closing brace
                stripped = rest.lstrip()
                if not stripped:
                    return
                self.pos += len(rest) - len(stripped)
                if stripped[0] == "}":
                    self.pos += 1
                self.state = "tail"
            elif self.state == "tail":  # between calls: `; ` then the next one, or the end
                stripped = rest.lstrip()
                if not stripped:
                    return
                if stripped[0] == ";":
                    self.pos += len(rest) - len(stripped) + 1
                    continue
                if stripped[0] == "{":
                    self.pos += len(rest) - len(stripped)
                    self.state = "head"
                    continue
                self._skip_ws = True
                self.state = "content"

    def _whole_call(self, body: str) -> bool:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        text = _object_arguments(obj.get("parameters", obj.get("arguments", {})))
        if text is None:
            return False
        self._arguments(self._open_call(obj["name"]), text)
        return True


# --------------------------------------------------------------------------- registry


FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (HermesFormat, Llama3JsonFormat)}
DEFAULT_FORMAT = "hermes"


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}") from None
