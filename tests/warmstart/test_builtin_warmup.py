"""The built-in warmup: what an engine with no templates runs before /ready, what
--skip-server-warmup leaves out, and a staggered wave reaching every batch size (the
templates' too) with one request per slot. In process (the real engine and warm-start steps) so the compile cache and
the decode batch sizes are observable."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import yaml

from preheat.engine.async_engine import AsyncEngine
from preheat.engine.config import EngineConfig
from preheat.engine.lifecycle import Lifecycle
from preheat.engine.metrics import Metrics
from preheat.engine.warm.builtin_warmup import builtin_templates
from preheat.engine.warm.warm_start import build_warm_start, plan_limits
from preheat.engine.warm.warmup_templates import build_plan

pytestmark = pytest.mark.slow

LADDER = [1, 2, 3, 6]


def test_the_builtin_plan_covers_grammars_sampling_chunks_and_every_captured_batch_size():
    engine = SimpleNamespace(cuda_graph_batch_sizes=[1, 2, 4, 8], config=SimpleNamespace(max_num_seqs=64),
                             max_model_len=2048)
    plan = build_plan(builtin_templates(512, 16), **plan_limits(engine, 4), default_max_tokens=4)
    assert plan.pins == ()  # nothing of a deployment's own: nothing pinned
    assert plan.waves[0].batch_sizes == (1, 2, 4, 8)
    reqs = [r for w in plan.waves for r in w.requests]
    kinds = {(r.structured.kind if r.structured else None, bool(r.tools)) for r in reqs}
    assert ("json_schema", False) in kinds and (None, True) in kinds
    assert any(r.temperature > 0 and r.presence_penalty and r.repetition_penalty != 1.0 for r in reqs)
    assert any(r.temperature == 0 and r.presence_penalty == 0 for r in reqs)
    assert [r.prompt_tokens for r in reqs if r.prompt_tokens] and all(
        r.prompt_tokens == 512 + 16 for r in reqs if r.prompt_tokens)  # a full chunk, then a page over it


def _config(tmp_path, **extra) -> EngineConfig:
    return EngineConfig(dtype="float32", max_model_len=1024, max_total_tokens=8192, page_size=16,
                        max_num_seqs=8, chunked_prefill_size=128, **extra)


def _recording_factory(batch_sizes: list[int]):
    from preheat.engine.engine import Engine

    def factory(config):
        engine = Engine(config)
        run = engine.runner.run

        def recording(decode, extend):
            if decode:
                batch_sizes.append(len(decode))
            return run(decode, extend)

        engine.runner.run = recording
        return engine

    return factory


async def test_with_no_templates_the_builtin_warmup_runs_before_ready_and_compiles_both_grammars(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="preheat.engine.warm.warmup_runner")
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "ladder.yaml").write_text(yaml.safe_dump(
        {"name": "ladder", "prompts": ["Count: one, two,"], "concurrency": LADDER, "max_tokens": 2}))
    config = _config(tmp_path, warmup_templates=str(templates), warmup_steps=3)
    aengine = AsyncEngine(Metrics())
    warm = build_warm_start(config, aengine.metrics)
    assert [s.name for s in warm.steps()] == ["engine-facts", "warmup", "templates"]
    batch_sizes: list[int] = []
    life = Lifecycle(config, aengine, warm.steps(), engine_factory=_recording_factory(batch_sizes))
    assert await life.start()
    try:
        backend = aengine.engine.grammar_backend
        assert backend.cache_misses >= 2  # the JSON schema and the tool grammar, compiled before ready
        lines = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("warmed ")}
        for name in ("builtin-sampling", "builtin-json", "builtin-tools", "builtin-prefill"):
            assert "1 request(s)" in lines[f"warmed {name}"] and "refused" not in lines[f"warmed {name}"], lines
        # The built-in ladder reaches the template's levels too: 6 requests, its 5 paths and
        # one copy of the plain chat (the cheapest) to fill the sixth slot.
        assert "2 request(s)" in lines["warmed builtin-chat"], lines
        assert "grammars json_schema" in lines["warmed builtin-json"]
        assert "grammars tools:auto" in lines["warmed builtin-tools"]
        # That one staggered wave of 6 stepped down through every level.
        assert set(LADDER) <= set(batch_sizes), batch_sizes
        # The template then warms only its one new path (a raw prompt), with no ladder of
        # its own: 6 + 1, where every path run in full was 5 + 6.
        assert "1 request(s) (1 prompt)" in lines["warmed ladder"], lines
        # Before the wave, its prompts were prefilled once each (nothing was cached): else
        # the wave's requests are admitted over several steps (the prefill budget, sharers
        # deferred) and the batch misses levels. Three distinct ones: chat, tools, prefill.
        primed = [int(m.group(1)) for r in caplog.records
                  if (m := re.match(r"warmup: prefilled (\d+) prompt", r.getMessage()))]
        assert primed == [3], primed
        warmed = aengine.metrics.warmup_requests._value.get()
        assert warmed == max(LADDER) + 1 + sum(primed)
        assert set(aengine.startup_steps) >= {"load", "warmup", "templates"}
    finally:
        await life.shutdown(5)


async def test_skip_server_warmup_leaves_out_only_the_builtin_warmup(tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "one.yaml").write_text(yaml.safe_dump({"name": "one", "prompts": ["Hello"]}))
    config = _config(tmp_path, warmup_templates=str(templates), skip_server_warmup=True)
    warm = build_warm_start(config, Metrics())
    assert [s.name for s in warm.steps()] == ["engine-facts", "templates"]
    assert [s.name for s in build_warm_start(_config(tmp_path, skip_server_warmup=True), Metrics()).steps()] == [
        "engine-facts"]
