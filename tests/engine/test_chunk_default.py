"""The prompt-token budget of a step, when --chunked-prefill-size is not given, follows the
device: small on CPU so decodes never stall long, large on a GPU with memory to spare."""

from __future__ import annotations

import pytest

from preheat.engine.config import EngineConfig, default_chunked_prefill_size

GiB = 2**30


@pytest.mark.parametrize(
    "device, memory, expected",
    [("cpu", 0, 512), ("cuda", 24 * GiB, 2048), ("cuda", 80 * GiB, 8192), ("cuda", 141 * GiB, 8192)],
)
def test_default_budget_by_device(device, memory, expected):
    assert default_chunked_prefill_size(device, memory) == expected


def test_a_given_budget_wins(tiny_llama_dir):
    from preheat.engine.engine import Engine

    assert Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=256)).chunked_prefill_size == 512
    assert Engine(EngineConfig(model=str(tiny_llama_dir), max_total_tokens=256,
                               chunked_prefill_size=40)).chunked_prefill_size == 40
