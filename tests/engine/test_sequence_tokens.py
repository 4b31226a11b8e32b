"""Sequence.token_ids(start, end) slices prompt + output without building the whole list
(what the runner asks of every entry every step): the same tokens as all_token_ids[start:end]
for every range, within the prompt, within the output and across the boundary."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from preheat.engine.request.detokenizer import IncrementalDetokenizer
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import Sequence


@given(
    prompt=st.lists(st.integers(0, 50000), min_size=1, max_size=40),
    output=st.lists(st.integers(0, 50000), max_size=40),
    bounds=st.tuples(st.integers(0, 90), st.integers(0, 90)),
)
def test_a_range_is_the_slice_of_all_tokens(smollm_tokenizer, prompt, output, bounds):
    seq = Sequence("r", list(prompt), SamplingParams(), torch.Generator(),
                   IncrementalDetokenizer(smollm_tokenizer, []), set(), 4096)  # fmt: skip
    seq.output_token_ids.extend(output)
    start, end = min(bounds), max(bounds)
    assert seq.token_ids(start, end) == seq.all_token_ids[start:end]
