"""CudaGraphRunner bookkeeping, on CPU: static buffers, padding rows, capture order, replay.

A fake graph backend stands in for CUDA and behaves like a graph: capture runs the function
once on the static buffers and remembers its output tensor; replay re-runs the same function
on the same buffers and writes into the same output. So a runner that forgot to copy inputs
into the buffers, padded wrongly, or returned the padded rows would fail here as on a GPU.
A real CUDA capture is tested at the end (skipped without CUDA).
"""

from __future__ import annotations

import logging

import pytest
import torch

from preheat.engine.cuda_graph import CudaGraphRunner, DecodeInputs, StaticDecodeBuffers

MAX_PAGES = 6


class FakeGraphs:
    def __init__(self):
        self.captured_batch_sizes = []
        self.replays = 0

    def capture(self, fn):
        out = fn()
        self.captured_batch_sizes.append(out.shape[0])

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out


def toy_decode(inputs: DecodeInputs) -> torch.Tensor:
    """A 'model' whose output row depends on every input of its row."""
    return torch.stack(
        [
            inputs.input_ids.float(),
            inputs.positions.float(),
            inputs.slots.float(),
            inputs.page_table.float().sum(1),
            inputs.seq_lens.float(),
        ],
        dim=1,
    )


def batch(bs, width=3, base=100):
    ids = torch.arange(bs)
    return DecodeInputs(
        input_ids=base + ids,
        positions=10 + ids,
        slots=64 + ids,
        page_table=(ids[:, None] + torch.arange(1, width + 1)).to(torch.int32),
        seq_lens=(5 + ids).to(torch.int32),
    )


def make_runner(max_bs=8, backend=None, **kw):
    return CudaGraphRunner(
        toy_decode, max_bs=max_bs, max_pages=MAX_PAGES, device="cpu",
        backend=backend or FakeGraphs(), **kw,
    )


def test_padding_rows_point_at_scratch_page_zero_with_one_token():
    buffers = StaticDecodeBuffers(max_bs=8, max_pages=MAX_PAGES, device="cpu")
    view = buffers.load(batch(3), padded_bs=4)
    assert view.batch_size == 4
    assert view.input_ids.tolist() == [100, 101, 102, 0]
    assert view.positions.tolist() == [10, 11, 12, 0]
    assert view.slots.tolist() == [64, 65, 66, 0]
    assert view.seq_lens.tolist() == [5, 6, 7, 1]
    assert view.page_table[3].tolist() == [0] * MAX_PAGES
    assert view.page_table[0].tolist() == [1, 2, 3, 0, 0, 0]


def test_buffers_are_updated_in_place_and_stale_pages_cleared():
    buffers = StaticDecodeBuffers(max_bs=8, max_pages=MAX_PAGES, device="cpu")
    addresses = [t.data_ptr() for t in (buffers.input_ids, buffers.page_table, buffers.seq_lens)]
    buffers.load(batch(4, width=6), padded_bs=4)
    view = buffers.load(batch(2, width=2, base=7), padded_bs=4)
    assert [t.data_ptr() for t in (buffers.input_ids, buffers.page_table, buffers.seq_lens)] == addresses
    # The earlier, wider batch's pages must not survive in columns or rows now unused.
    assert view.page_table.tolist() == [[1, 2, 0, 0, 0, 0], [2, 3, 0, 0, 0, 0], [0] * 6, [0] * 6]
    assert view.input_ids.tolist() == [7, 8, 0, 0]


def test_buffers_refuse_what_does_not_fit():
    buffers = StaticDecodeBuffers(max_bs=4, max_pages=MAX_PAGES, device="cpu")
    with pytest.raises(ValueError, match="max_bs"):
        buffers.load(batch(5), padded_bs=8)
    with pytest.raises(ValueError, match="columns"):
        buffers.load(batch(2, width=MAX_PAGES + 1), padded_bs=2)


def test_capture_goes_largest_first_over_the_whole_ladder():
    graphs = FakeGraphs()
    seen = []
    runner = make_runner(max_bs=16, backend=graphs, on_capture=lambda s, sizes: seen.append((s, sizes)))
    seconds = runner.capture()
    assert graphs.captured_batch_sizes == [16, 8, 4, 2, 1]
    assert runner.batch_sizes == [1, 2, 4, 8, 16]
    assert runner.capture_seconds == seconds > 0
    assert seen == [(seconds, [1, 2, 4, 8, 16])]


@pytest.mark.parametrize("bs", [1, 3, 5, 8])
def test_replay_returns_exactly_what_eager_decode_returns(bs):
    graphs = FakeGraphs()
    runner = make_runner(backend=graphs)
    runner.capture()
    out = runner.run(batch(bs))
    assert graphs.replays == 1
    assert torch.equal(out, toy_decode(batch(bs)))


def test_consecutive_steps_see_their_own_inputs():
    runner = make_runner()
    runner.capture()
    first = runner.run(batch(3, base=100)).clone()
    second = runner.run(batch(3, base=200))
    assert first[:, 0].tolist() == [100, 101, 102]
    assert second[:, 0].tolist() == [200, 201, 202]


def test_a_batch_above_max_runs_eagerly_and_says_so_once(caplog):
    graphs = FakeGraphs()
    runner = make_runner(max_bs=4, backend=graphs)
    runner.capture()
    with caplog.at_level(logging.INFO, logger="preheat.engine.cuda_graph"):
        out = runner.run(batch(6))
        runner.run(batch(7))
    assert torch.equal(out, toy_decode(batch(6)))
    assert graphs.replays == 0
    assert not runner.uses_graph(6) and runner.uses_graph(3)
    assert sum("above --cuda-graph-max-bs 4" in r.message for r in caplog.records) == 1


def test_disabled_runner_captures_nothing_and_decodes_eagerly(caplog):
    graphs = FakeGraphs()
    runner = make_runner(backend=graphs, disable=True)
    with caplog.at_level(logging.INFO, logger="preheat.engine.cuda_graph"):
        assert runner.capture() == 0.0
    assert graphs.captured_batch_sizes == [] and runner.batch_sizes == []
    assert runner.eager_reason == "--disable-cuda-graph is set"
    assert "CUDA graphs off (--disable-cuda-graph is set)" in caplog.text
    assert torch.equal(runner.run(batch(3)), toy_decode(batch(3)))


def test_a_caller_reason_forces_eager_and_is_logged(caplog):
    graphs = FakeGraphs()
    runner = make_runner(backend=graphs, eager_because="attention backend is torch")
    with caplog.at_level(logging.INFO, logger="preheat.engine.cuda_graph"):
        runner.capture()
    assert graphs.captured_batch_sizes == [] and not runner.enabled
    assert "CUDA graphs off (attention backend is torch)" in caplog.text


def test_without_cuda_the_same_code_path_runs_eagerly_and_says_so(caplog):
    runner = CudaGraphRunner(toy_decode, max_bs=8, max_pages=MAX_PAGES, device="cpu")
    with caplog.at_level(logging.INFO, logger="preheat.engine.cuda_graph"):
        runner.capture()
    assert not runner.enabled and runner.batch_sizes == []
    assert "decoding eagerly" in caplog.text
    assert torch.equal(runner.run(batch(5)), toy_decode(batch(5)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_replay_with_new_inputs_and_share_one_pool():
    def decode(inputs: DecodeInputs) -> torch.Tensor:
        # Allocates intermediates inside the graph: they must come from the shared pool.
        x = inputs.input_ids.float()[:, None] * torch.ones(1, 4, device="cuda")
        return x + inputs.seq_lens.float()[:, None]

    runner = CudaGraphRunner(decode, max_bs=16, max_pages=MAX_PAGES, device="cuda")
    runner.capture()
    assert runner.batch_sizes == [1, 2, 4, 8, 16]
    for bs in (1, 3, 11):
        inputs = DecodeInputs(*(t.cuda() for t in vars(batch(bs)).values()))
        got = runner.run(inputs)
        torch.testing.assert_close(got, decode(inputs))
