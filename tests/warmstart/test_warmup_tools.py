"""A template that lists tools warms what an agent's first request would pay for: its tool
grammars are compiled before /ready (the request then compiles nothing), and the system
prompt with the tool listing is cached. In process — the real engine, the real warm-start
steps, the real app driven by the real `openai` SDK — because the compile cache is only
observable from inside."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import httpx2
import openai
import pytest
import yaml

from preheat.engine.api.chat_render import engine_tool_rendering
from preheat.engine.async_engine import AsyncEngine
from preheat.engine.config import EngineConfig
from preheat.engine.lifecycle import Lifecycle
from preheat.engine.metrics import Metrics
from preheat.engine.serve.server import create_app
from preheat.engine.tools.calling import plan_tools
from preheat.engine.warm.warm_start import build_warm_start
from preheat.engine.warm.warmup_runner import chat_pin_ids

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[2] / "warmup_templates" / "support_agent.yaml"


def reordered(value):
    """The same JSON with every object's keys in reverse order, as another client might
    serialise it: the grammar built from it must still be the warmed one."""
    if isinstance(value, dict):
        return {k: reordered(value[k]) for k in reversed(list(value)) if k != "properties"} | (
            {"properties": {k: reordered(v) for k, v in value["properties"].items()}}
            if "properties" in value else {})
    if isinstance(value, list):
        return [reordered(v) for v in value]
    return value


async def test_tool_grammars_and_the_tool_prompt_are_warm_before_ready(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preheat.engine.warm.warmup_runner")
    shutil.copy(SHIPPED, tmp_path)
    template = yaml.safe_load(SHIPPED.read_text())
    config = EngineConfig(dtype="float32", max_model_len=1024, max_total_tokens=4096, page_size=16,
                          max_num_seqs=8, warmup_templates=str(tmp_path))
    aengine = AsyncEngine(Metrics())
    warm = build_warm_start(config, aengine.metrics)
    life = Lifecycle(config, aengine, warm.steps())
    assert await life.start()
    try:
        engine = aengine.engine
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warmed support-agent:")]
        assert "pinned 1 prefix(es)" in line and "grammars tools:auto, tools:required;" in line, line
        assert "refused" not in line
        backend = engine.grammar_backend
        compiled, hits = backend.cache_misses, backend.cache_hits

        app = create_app(aengine)
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
        tools = reordered(template["tools"])  # same tools, keys in another order
        assert list(tools[0]) != list(template["tools"][0])
        messages = [{"role": "system", "content": template["system"]},
                    {"role": "user", "content": "Can you check order NW-55501234 for me?"}]
        shared = chat_pin_ids(engine.tokenizer, template["system"], plan_tools(template["tools"]).tools,
                              engine_tool_rendering(engine))
        args = dict(model=engine.served_model_name, messages=messages, tools=tools, max_tokens=4, temperature=0)
        r = await client.chat.completions.create(**args, tool_choice="auto")
        usages = [r.usage]
        stream = await client.chat.completions.create(**args, tool_choice="required", stream=True,
                                                      stream_options={"include_usage": True})
        usages += [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert len(usages) == 2
        for usage in usages:
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached >= len(shared) - config.page_size, (cached, len(shared))
        assert backend.cache_misses == compiled, "a request compiled a grammar warmup should have"
        assert backend.cache_hits == hits + 2
        await http.aclose()
    finally:
        await life.shutdown(5)
