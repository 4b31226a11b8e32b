"""Per-layer fp8 KV scales, calibrated once at start-up (see engine/kernels/kv_fp8.py).

A fixed calibration text runs through the model into a small pool of the model's dtype; each
layer's K and V absolute maximum gives that layer's scales (power-of-two, with a margin for
activations larger than the text's). Deterministic: every engine of one model gets the same
scales, so they can go into the model fingerprint and snapshots / L3 pages move between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from preheat.engine.kernels.kv_fp8 import power_of_two_scale
from preheat.engine.kv.pool import KVPool

log = logging.getLogger(__name__)

# prefill(pool, token_ids, pages): the model computes the tokens' KV (from position 0) into
# `pool` at `pages`. The engine passes engine/runner.py's run_prompt bound to its model.
Prefill = Callable[[KVPool, list[int], list[int]], None]

CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. A customer writes: my order NW-20481377 has "
    "not arrived; can you check the tracking and tell me when it ships? The assistant answers "
    "politely, in two sentences, and offers a refund of 42.50 EUR if the parcel is lost. "
    '{"city": "Paris", "country": "France", "temperature_c": 18.5} def f(x): return x * 2\n'
    "Les prix augmentent de 3 % par an; 価格は毎年上がります。Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000."
)


def calibrate_kv_scales(prefill: Prefill, tokenizer: Any, spec: Any, device: torch.device, dtype: torch.dtype,
                        fp8_dtype: torch.dtype, page_size: int) -> torch.Tensor:
    """Scales [num_layers, 2] (K, V) for an fp8 pool of `fp8_dtype`, from the text's KV in a
    pool of the model's `dtype` (page 0 stays the scratch page)."""
    ids = list(tokenizer.encode(CALIBRATION_TEXT))
    pages = -(-len(ids) // page_size)
    pool = KVPool(spec.num_layers, spec.num_kv_heads, spec.head_dim, pages + 1, page_size, dtype, device,
                  prefault_bytes=0)  # written once, then dropped: nothing to populate ahead
    prefill(pool, ids, list(range(1, pages + 1)))
    amax = pool.kv[:, :, 1:].abs().amax(dim=(2, 3, 4, 5)).float().cpu()  # [L, 2]
    scales = torch.tensor([[power_of_two_scale(float(a), fp8_dtype) for a in row] for row in amax])
    log.info("fp8 KV scales calibrated on %d tokens: K %s..%s, V %s..%s", len(ids),
             f"{scales[:, 0].min():g}", f"{scales[:, 0].max():g}", f"{scales[:, 1].min():g}", f"{scales[:, 1].max():g}")
    return scales
