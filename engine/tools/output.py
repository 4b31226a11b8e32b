"""Tool calling, the response side: generated text to OpenAI's `message.tool_calls` and
streamed `delta.tool_calls`, through the format's parser (engine/tools/parsers.py).

Shapes, as OpenAI sends them:

- a message with calls: `{"role": "assistant", "content": null | "text", "tool_calls":
  [{"id": "call_...", "type": "function", "function": {"name", "arguments"}}]}` and
  `finish_reason: "tool_calls"` (a `length` finish stays `length`);
- a stream: `{"tool_calls": [{"index": i, "id", "type": "function", "function": {"name",
  "arguments": ""}}]}` first for each call, then `{"tool_calls": [{"index": i, "function":
  {"arguments": "<piece>"}}]}`; the pieces concatenate to the call's JSON arguments.
Pure: no engine, no HTTP.
"""

from __future__ import annotations

from typing import Any

from preheat.engine.tools.calling import ToolPlan, new_call_id, tool_call_dict
from preheat.engine.tools.parsers import Delta, ToolFormat


def parses_calls(plan: ToolPlan | None) -> bool:
    """Whether answers are read for calls: not without tools, not under tool_choice "none"."""
    return plan is not None and plan.active


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_message(text: str, reason: str | None, plan: ToolPlan | None, fmt: ToolFormat) -> tuple[dict, str | None]:
    """The assistant message and finish reason for a whole answer."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if not parses_calls(plan):
        return message, reason
    parsed = fmt.parse(text)
    if not parsed.calls:
        return message, reason
    message["content"] = parsed.content
    message["tool_calls"] = [tool_call_dict(c) for c in parsed.calls]
    return message, finish_reason(reason, True)


class DeltaStream:
    """One choice's stream: generated text pieces in, OpenAI `delta` objects out."""

    def __init__(self, plan: ToolPlan | None, fmt: ToolFormat) -> None:
        self.streamer = fmt.streamer() if parses_calls(plan) else None
        self.ids: dict[int, str] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason once its stream ended ("tool_calls" after a call)."""
        return finish_reason(reason, self.has_calls)

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self.streamer is None:
            return [{"content": text}] if text else []
        deltas = self.streamer.feed(text) if text else []
        if finished:
            deltas += self.streamer.finish()
        return [self._delta(d) for d in _coalesce(deltas)]

    def _delta(self, d: Delta) -> dict:
        if d.index is None:
            return {"content": d.content}
        entry: dict[str, Any] = {"index": d.index}
        fn: dict[str, Any] = {"arguments": d.arguments}
        if d.name is not None:
            self.ids[d.index] = new_call_id()
            entry.update(id=self.ids[d.index], type="function")
            fn = {"name": d.name, "arguments": d.arguments}
        entry["function"] = fn
        return {"tool_calls": [entry]}


def _coalesce(deltas: list[Delta]) -> list[Delta]:
    """Joins neighbouring pieces of the same kind (content, or one call's arguments), so one
    engine step makes one chunk per kind rather than one per parser event."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and d.name is None and d.index == last.index:
            if d.index is None:
                last.content += d.content
            else:
                last.arguments += d.arguments
            continue
        out.append(Delta(d.content, d.index, d.name, d.arguments))
    return out
