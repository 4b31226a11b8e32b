"""Evicted pages go down to L2 (host) and L3 (disk) and come back on a later match with
the same greedy output; snapshots export and import the hottest prefixes."""

from __future__ import annotations

import torch

from preheat.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (length,), generator=g).tolist() for _ in range(n)]


def evict_everything(llm: LLM) -> None:
    radix = llm.engine.radix
    radix.evict(radix.total_pages)
    assert radix.total_pages == 0


def test_prefix_evicted_from_l1_is_served_from_l2_with_identical_output(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512, host_cache_size=0.01)
    first = prompts(0, 1, 64)
    reference = llm.generate(first, GREEDY)[0]
    evict_everything(llm)

    again = llm.generate(first, GREEDY)[0]

    assert again.token_ids == reference.token_ids
    assert again.cached_tokens >= 60  # all whole pages but the last token's came back
    assert llm.engine.tier_hit_tokens["l2"] >= 60


def test_prefix_evicted_to_disk_is_served_from_l3_with_identical_output(tiny_llama_dir, tmp_path):
    llm = LLM(
        model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512,
        disk_cache_dir=str(tmp_path / "l3"), prefetch_policy="wait_complete",
    )
    first = prompts(1, 1, 48)
    reference = llm.generate(first, GREEDY)[0]
    evict_everything(llm)
    assert any((tmp_path / "l3").rglob("*.safetensors"))

    again = llm.generate(first, GREEDY)[0]

    assert again.token_ids == reference.token_ids
    assert again.cached_tokens >= 44
    assert llm.engine.tier_hit_tokens["l3"] >= 44


def test_snapshot_export_import_restores_pinned_prefix_first(tiny_qwen2_dir):
    source = LLM(model=str(tiny_qwen2_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    system, other = prompts(2, 2, 40)
    source.generate([system, other], GREEDY)
    assert source.engine.pin_prefix(system) == 40
    records = source.engine.export_prefixes(max_tokens=40)
    assert [r.token_ids for r in records] == [system]  # the pinned prefix wins the budget
    assert records[0].pinned

    target = LLM(model=str(tiny_qwen2_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    assert target.engine.import_prefixes(records) == 40
    result = target.generate([system + [7, 8, 9]], GREEDY)[0]
    expected = source.generate([system + [7, 8, 9]], GREEDY)[0]
    assert result.cached_tokens == 40
    assert result.token_ids == expected.token_ids
    # pinned: survives a full eviction
    target.engine.radix.evict(target.engine.radix.total_pages)
    assert target.engine.radix.match_prefix(system, touch=False).length == 40


def test_a_shared_prefix_is_stored_once_and_restores_before_what_extends_it(tiny_llama_dir, tmp_path):
    from preheat.engine.kv.snapshot import load_latest_snapshot, save_snapshot

    source = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    (system,) = prompts(3, 1, 40)
    tails = prompts(4, 3, 12)
    conversations = [system + tail for tail in tails]
    source.generate(conversations, GREEDY)
    source.engine.pin_prefix(system)
    records = source.engine.export_prefixes(max_tokens=None)

    assert records[0].token_ids == system and records[0].pinned and records[0].kv_start == 0
    extending = records[1:]
    assert len(extending) == 3 and all(r.kv_start == 40 for r in extending)
    assert sum(r.stored_tokens for r in records) == 40 + sum(r.num_tokens - 40 for r in extending)

    save_snapshot(tmp_path, source.engine.fingerprint, records, "pod-a")
    loaded = load_latest_snapshot(tmp_path, source.engine.fingerprint)
    assert loaded.rejected == [] and loaded.num_tokens == sum(r.stored_tokens for r in records)

    target = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    assert target.engine.import_prefixes(loaded.records) == loaded.num_tokens
    again = target.generate(conversations, GREEDY)
    expected = source.generate(conversations, GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in expected]
    assert all(r.cached_tokens >= 48 for r in again)


def test_a_budget_too_small_for_the_shared_prefix_restores_nothing_that_extends_it(tiny_llama_dir, tmp_path):
    from preheat.engine.kv.snapshot import load_latest_snapshot, save_snapshot

    source = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    (system,) = prompts(5, 1, 40)
    source.generate([system + t for t in prompts(6, 2, 12)], GREEDY)
    source.engine.pin_prefix(system)
    save_snapshot(tmp_path, source.engine.fingerprint, source.engine.export_prefixes(None), "pod-a")

    loaded = load_latest_snapshot(tmp_path, source.engine.fingerprint, max_tokens=20)
    # the 40-token pinned prefix does not fit; its extensions are useless without it
    assert loaded.records == []
