"""The built-in warmup: what every engine runs before /ready unless --skip-server-warmup.

Without it an engine started with no templates turns ready after model load and hands its
first users every first-time cost (SGLang warms by default for the same reason). It warms
the paths any deployment's requests take, whatever its business shape:

- a chat request, greedy (chat template rendering, prefill, decode, detokenizing);
- a sampled chat request with presence / frequency / repetition penalties (the sampler's
  temperature and penalty paths);
- a chat request under a JSON schema (one structured-output grammar compiled and masked);
- a chat request offering a tool, `tool_choice: auto` (one tool-call grammar compiled);
- a synthetic prompt one chunk plus a page longer than `--chunked-prefill-size`, so both
  prefill shapes the scheduler uses run: a full chunk, and a short chunk over a cached prefix;
- every captured CUDA-graph batch size, which the plan adds to the concurrency levels
  (engine/warm/warm_start.py `plan_limits`; on CPU there are none and the ladder is [1]).

The templates are built here in code, not read from files, so the wheel needs no package
data for them. Nothing is pinned: these prefixes are no deployment's hot prefixes, they stay
ordinary evictable cache.
"""

from __future__ import annotations

import json

from preheat.engine.warm.warmup_templates import ChatMessage, StructuredSpec, WarmupTemplate

_SYSTEM = "You are a concise assistant. Answer in one short sentence."
_ASK = (ChatMessage("user", "What is the capital of France?"),)
_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "country"],
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
}
_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]  # fmt: skip


def builtin_templates(chunk_size: int, page_size: int) -> list[WarmupTemplate]:
    """The built-in warmup as templates (max_tokens left to --warmup-steps)."""
    src = "built-in"
    chat = {"system": _SYSTEM, "pin_system": False, "conversations": (_ASK,), "source": src}
    return [
        WarmupTemplate(name="builtin-chat", **chat),
        WarmupTemplate(name="builtin-sampling", temperature=0.7, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.1, **chat),
        WarmupTemplate(name="builtin-json", structured=(StructuredSpec(
            "json_schema", json.dumps(_SCHEMA, sort_keys=True, separators=(",", ":"))),), **chat),
        WarmupTemplate(name="builtin-tools", tools=json.dumps(_TOOLS, separators=(",", ":")),
                       tool_choices=(json.dumps("auto"),), **chat),
        WarmupTemplate(name="builtin-prefill", source=src, prompt_lengths=(chunk_size + page_size,)),
    ]
