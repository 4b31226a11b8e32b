"""One chat request's tools, decided once and used at each step of its way through the
serving layer: what the model may call (engine/tools/calling.py's ToolPlan, or None without
tools), how the prompt shows the tools and which call format the model answers in
(chat_render.py's ToolRendering), the grammar that holds the model to the plan, and the
answer's OpenAI shapes (engine/tools/output.py).

The plan and the format are one value, so the prompt, the grammar and the parser of one
request cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from preheat.engine.api.chat_render import ToolRendering, chat_prompt_ids, engine_tool_rendering
from preheat.engine.engine_client import ServedEngine, Tokenizer
from preheat.engine.request.sampling_params import StructuredOutput
from preheat.engine.tools.calling import ToolPlan, plan_tools, tool_structured_output
from preheat.engine.tools.output import DeltaStream, chat_message


@dataclass(frozen=True)
class ChatTools:
    plan: ToolPlan | None
    rendering: ToolRendering

    @classmethod
    def decide(cls, engine: ServedEngine, tools: list[Any] | None, tool_choice: Any = None,
               parallel: bool | None = None) -> ChatTools:
        """The request's tool plan and this model's tool rendering (its --tool-call-parser)."""
        return cls(plan_tools(tools, tool_choice, parallel), engine_tool_rendering(engine))

    def prompt_ids(self, tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                   add_generation_prompt: bool = True) -> list[int]:
        """The chat with the offered tools, rendered and encoded (chat_render.py)."""
        tools = self.plan.tools if self.plan is not None else None
        return chat_prompt_ids(tokenizer, messages, tools, self.rendering, add_generation_prompt)

    def structured(self, requested: StructuredOutput | None) -> StructuredOutput | None:
        """The one constraint the engine applies: the tool grammar, joined with or instead
        of the request's own response_format / regex."""
        if self.plan is None:
            return requested
        return tool_structured_output(self.plan, self.rendering.fmt, requested)

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's assistant message and finish reason."""
        return chat_message(text, reason, self.plan, self.rendering.fmt)

    def deltas(self) -> DeltaStream:
        """A new stream of one choice's `delta` objects."""
        return DeltaStream(self.plan, self.rendering.fmt)
