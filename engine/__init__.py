"""The Preheat inference engine: `from preheat.engine import LLM, SamplingParams`."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "Engine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    # Lazy so `preheat operator` and light tools never import torch.
    if name == "LLM":
        from preheat.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutput"):
        from preheat.engine.request import sampling_params

        return getattr(sampling_params, name)
    if name == "Engine":
        from preheat.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from preheat.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
