"""Warm-up that costs what it must (issue 27): a request is skipped when it would warm nothing
new (its code path ran, its prompt is cached: restored from a snapshot), the built-in
warmup's staggered wave reaches the templates' concurrency levels so theirs need no ladder,
and a grammar whose request is skipped is still compiled. Requests are counted, never timed.

The pure parts (the plan, which prompts to prefill before a staggered wave) first; then one
engine started twice on one snapshot directory, in process.
"""

from __future__ import annotations

import pytest
import yaml

from preheat.engine.async_engine import AsyncEngine
from preheat.engine.config import EngineConfig
from preheat.engine.lifecycle import Lifecycle
from preheat.engine.metrics import Metrics
from preheat.engine.request.sampling_params import StructuredOutput
from preheat.engine.warm.warm_start import build_warm_start
from preheat.engine.warm.warmup_runner import prompts_to_prime
from preheat.engine.warm.warmup_templates import build_plan, filler, parse_templates

# --------------------------------------------------------------------------- the plan (pure)


def _templates():
    return parse_templates(
        """
        templates:
          - {name: a, prompts: [a1, a2, a3], concurrency: [1, 4]}
          - {name: b, prompts: [b1], structured: [{regex: "[0-9]+"}], concurrency: [2]}
        """,
        "t.yaml",
    )


def test_with_every_level_reached_already_the_plan_has_no_ladder_and_nothing_runs_whole():
    plan = build_plan(_templates(), reached=[1, 2, 4])
    assert plan.waves and not any(w.ladder for w in plan.waves)
    assert sorted(r.prompt for w in plan.waves for r in w.requests) == ["a1", "a2", "a3", "b1"]
    assert all(r.max_tokens == 4 for w in plan.waves for r in w.requests)  # nothing staggered


def test_the_ladder_reaches_only_the_levels_not_reached_yet():
    (ladder, *rest) = build_plan(_templates(), reached=[1, 2]).waves
    assert ladder.ladder and (ladder.concurrency, ladder.batch_sizes) == (4, (4,))
    assert [r.prompt for r in ladder.requests] == ["a1", "a2", "a3", "b1"]
    assert [r.prompt for w in rest for r in w.requests] == []
    (full,) = [w for w in build_plan(_templates()).waves if w.ladder]
    assert full.batch_sizes == (1, 2, 4)


def test_a_ladder_wider_than_the_distinct_requests_repeats_the_cheapest_one():
    ts = parse_templates(
        """
        templates:
          - {name: synth, prompt_lengths: [600]}
          - {name: json, prompts: [j], structured: [{json_object: true}]}
          - {name: plain, prompts: [p], concurrency: [1, 6]}
        """,
        "t.yaml",
    )
    (ladder,) = build_plan(ts).waves
    kinds = [(r.prompt_tokens, r.prompt, r.structured is not None) for r in ladder.requests]
    assert kinds[:3] == [(600, None, False), (None, "j", True), (None, "p", False)]
    assert kinds[3:] == [(None, "p", False)] * 3  # not the 600-token prefill, not the grammar
    assert filler(ladder.requests[:2]).prompt_tokens == 600  # nothing cheaper: the first one


def test_a_staggered_wave_prefills_each_distinct_uncached_prompt_once_first():
    ps = 16
    shared = list(range(100, 140))  # 40 tokens: more than two pages
    prompts = [
        (shared, 0),  # not cached: prefilled
        (shared, 0),  # the same prompt: once is enough
        (shared + [7, 8], 32),  # cached but for its last 10 tokens: nothing to wait for
        (list(range(500, 560)), 48),  # 12 tokens to compute: within its last page
        (list(range(600, 640)), 16),  # 24 to compute: more than a page
    ]
    assert prompts_to_prime(prompts, ps) == [0, 4]
    assert prompts_to_prime([(shared, 32)], ps) == []  # restored: nothing to prefill


# --------------------------------------------------------------------------- a restart, in process

SYSTEM = ("You are the support assistant of a bicycle shop. Answer questions about orders, "
          "repairs and returns in two sentences at most, politely and precisely. ") * 3
SCHEMA = {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"],
          "additionalProperties": False}


def _template_dir(tmp_path):
    d = tmp_path / "templates"
    d.mkdir()
    (d / "shop.yaml").write_text(yaml.safe_dump({"templates": [
        {"name": "chat", "system": SYSTEM, "concurrency": [1, 2],
         "conversations": [[{"role": "user", "content": "Where is my order?"},
                            {"role": "assistant", "content": "It ships tomorrow."},
                            {"role": "user", "content": "Can I still change the address?"}]]},
        {"name": "extract", "system": SYSTEM, "structured": [{"json_schema": SCHEMA}],
         "conversations": [[{"role": "user", "content": "Order 123 is late."}]]},
        {"name": "check", "prompts": ["Order number in 'my order 88 broke':"],
         "structured": [{"regex": "[0-9]{1,6}"}]},
    ]}))
    return d


async def _start(config):
    aengine = AsyncEngine(Metrics())
    warm = build_warm_start(config, aengine.metrics)
    aengine.on_shutdown.extend(warm.shutdown_callbacks())  # the snapshot save, as `preheat serve`
    life = Lifecycle(config, aengine, warm.steps())
    assert await life.start()
    return aengine, warm, life


def _by_template(warm):
    """Template name -> its TemplateReport, for the templates step (the last report)."""
    return warm.reports[-1].templates


@pytest.mark.slow
async def test_a_restart_skips_what_the_snapshot_and_the_builtin_warmup_already_warmed(tmp_path):
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    config = EngineConfig(dtype="float32", max_model_len=1024, max_total_tokens=8192, page_size=16,
                          max_num_seqs=8, chunked_prefill_size=256, snapshot_dir=str(snapshots),
                          snapshot_interval=0, warmup_templates=str(_template_dir(tmp_path)))
    # 1. Nothing cached: every template request runs (its prompt's KV is what it warms).
    aengine, warm, life = await _start(config)
    first = _by_template(warm)
    first_count = aengine.metrics.warmup_requests._value.get()
    await life.shutdown(5)  # saves the snapshot
    assert {n: (r.requests, r.skipped) for n, r in first.items()} == {
        "chat": (2, 0), "extract": (1, 0), "check": (1, 0)}

    # 2. The same engine again: pins and prompts are restored.
    aengine, warm, life = await _start(config)
    try:
        assert aengine.metrics.snapshot_restored_tokens._value.get() > 0
        again = _by_template(warm)
        # Greedy chat and a JSON schema are the built-in warmup's paths: with their prompts
        # restored, the templates run none of them. The regex is a path of its own: one request.
        assert {n: (r.requests, r.skipped) for n, r in again.items()} == {
            "chat": (0, 2), "extract": (0, 1), "check": (1, 0)}
        assert again["chat"].pins == 1  # restored, pinned as it is (the JSON template shares it)
        assert "json_schema" in again["extract"].grammars
        # ... and its schema was compiled all the same: the first user's compile is a cache hit.
        backend = aengine.engine.grammar_backend
        hits, misses = backend.cache_hits, backend.cache_misses
        backend.compile(StructuredOutput("json_schema", SCHEMA))
        assert (backend.cache_hits, backend.cache_misses) == (hits + 1, misses)
        # The built-in ladder reached the templates' levels: no staggered wave of their own,
        # and nothing was prefilled before a wave (every prompt restored).
        restart_count = aengine.metrics.warmup_requests._value.get()
        assert restart_count < first_count
        assert sum(r.requests for r in again.values()) == 1
    finally:
        await life.shutdown(5)


@pytest.mark.slow
async def test_the_builtin_warmup_alone_runs_one_request_per_path_and_prefills_nothing_twice(tmp_path):
    """No templates, on CPU (no CUDA-graph sizes): the ladder is one request, which nothing
    can hold up, so no prompt is prefilled ahead of it; the other four paths run once each."""
    config = EngineConfig(dtype="float32", max_model_len=1024, max_total_tokens=8192, page_size=16,
                          max_num_seqs=8, chunked_prefill_size=256)
    aengine, warm, life = await _start(config)
    try:
        (report,) = warm.reports
        assert {n: (r.requests, r.skipped) for n, r in report.templates.items()} == {
            name: (1, 0) for name in ("builtin-chat", "builtin-sampling", "builtin-json", "builtin-tools",
                                      "builtin-prefill")}
        assert aengine.metrics.warmup_requests._value.get() == 5
    finally:
        await life.shutdown(5)
