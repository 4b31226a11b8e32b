"""The decisions behind CUDA-graph decode: which sizes to capture, how far to pad, when not to."""

from __future__ import annotations

import pytest
import torch

from preheat.engine.cuda_graph import capture_batch_sizes, graphs_off_reason, padded_batch_size


def test_default_ladder_is_powers_of_two_then_every_eight():
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize(
    "max_bs,ladder",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_ladder_always_ends_at_max_bs(max_bs, ladder):
    assert capture_batch_sizes(max_bs) == ladder


@pytest.mark.parametrize("max_bs", range(1, 130))
def test_padding_never_wastes_more_than_seven_rows(max_bs):
    sizes = capture_batch_sizes(max_bs)
    assert sizes == sorted(set(sizes))
    for bs in range(1, max_bs + 1):
        padded = padded_batch_size(bs, sizes)
        assert padded is not None and bs <= padded < bs + 8


def test_ladder_rejects_zero():
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


@pytest.mark.parametrize(
    "bs,padded", [(1, 1), (3, 4), (5, 8), (9, 16), (16, 16), (17, 24), (31, 32), (32, 32)]
)
def test_a_batch_pads_up_to_the_next_captured_size(bs, padded):
    assert padded_batch_size(bs, capture_batch_sizes(32)) == padded


def test_a_batch_above_the_largest_graph_is_not_padded():
    assert padded_batch_size(33, capture_batch_sizes(32)) is None


@pytest.mark.parametrize(
    "device,disable,cuda,reason",
    [
        ("cuda", False, True, None),
        ("cuda", True, True, "--disable-cuda-graph is set"),
        ("cpu", False, True, "device is cpu, not cuda"),
        ("cpu", False, False, "device is cpu, not cuda"),
        ("cuda", False, False, "CUDA is not available"),
    ],
)
def test_graphs_are_off_for_a_stated_reason(device, disable, cuda, reason):
    assert graphs_off_reason(torch.device(device), disable, cuda) == reason
