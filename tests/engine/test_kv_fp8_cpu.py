"""fp8 KV on CPU: vLLM's spellings accepted, 8-bit pages with calibrated per-layer scales,
attention reading them (dequantised) close to the full-precision result, about twice the
tokens in the same memory, snapshots and L3 refusing KV of another dtype or scale."""

from __future__ import annotations

import pytest
import torch

from preheat.engine import LLM, SamplingParams
from preheat.engine.config import ConfigError, EngineConfig
from preheat.engine.kernels import kv_fp8, reference
from preheat.engine.kv.pool import pool_pages
from preheat.engine.kv.snapshot import load_latest_snapshot, save_snapshot

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.mark.parametrize("name,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                        ("fp8_e5m2", torch.float8_e5m2), ("auto", torch.bfloat16)])
def test_every_vllm_spelling_is_accepted_on_cpu(name, dtype):
    assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    assert kv_fp8.kv_storage_dtype(name, torch.bfloat16, torch.device("cpu")) == dtype


def test_an_unknown_kv_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="--kv-cache-dtype: 'int4' is not one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_attention_over_fp8_pages_matches_full_precision_within_fp8_error(fp8):
    g = torch.Generator().manual_seed(0)
    pages, ps, kvh, hd, heads = 6, 4, 2, 32, 4
    k = torch.randn(pages * ps, kvh, hd, generator=g)
    v = torch.randn(pages * ps, kvh, hd, generator=g)
    slots = torch.arange(pages * ps)
    full_k, full_v = torch.zeros(pages, ps, kvh, hd), torch.zeros(pages, ps, kvh, hd)
    reference.write_kv(full_k, full_v, k, v, slots)
    q8 = torch.zeros(2, pages, ps, kvh, hd, dtype=fp8)
    k8, v8 = q8[0], q8[1]
    scale = kv_fp8.power_of_two_scale(float(k.abs().max()), fp8)
    k8.kv_scale = torch.tensor([scale])
    v8.kv_scale = torch.tensor([scale])
    reference.write_kv(k8, v8, k, v, slots)
    assert k8.element_size() == 1 and (k8.float() != 0).any()
    q = torch.randn(2, heads, hd, generator=g)
    table = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], dtype=torch.int32)
    lens = torch.tensor([20, 13], dtype=torch.int32)
    want = reference.decode_attention(q, full_k, full_v, table, lens, hd**-0.5)
    got = reference.decode_attention(q, k8, v8, table, lens, hd**-0.5)
    tol = 0.08 if fp8 == torch.float8_e4m3fn else 0.15  # 3 vs 2 mantissa bits
    assert (got - want).abs().max() < tol, (got - want).abs().max()
    assert not torch.allclose(got, want, atol=1e-6)  # it really read 8-bit values


def test_the_same_memory_holds_at_least_1_9x_the_tokens(tiny_llama_dir):
    full = LLM(model=str(tiny_llama_dir), dtype="bfloat16", page_size=4, max_total_tokens=4096)
    fp8 = LLM(model=str(tiny_llama_dir), dtype="bfloat16", page_size=4, max_total_tokens=4096, kv_cache_dtype="fp8")
    spec = full.engine.model_config
    memory = 64 * 2**20
    tokens = [pool_pages(spec.kv_bytes_per_token(e.engine.kv_dtype), memory, 1.0, 4, None) * 4
              for e in (full, fp8)]
    assert tokens[1] >= 1.9 * tokens[0], tokens
    # The pool itself: bytes per page halve (the scales are a few floats per layer).
    per_page = [e.engine.pool.bytes / e.engine.pool.num_pages for e in (full, fp8)]
    assert per_page[0] / per_page[1] >= 1.9
    assert fp8.engine.pool.kv.dtype == torch.float8_e4m3fn
    scales = fp8.engine.pool.scales.flatten()
    assert (scales > 0).all() and torch.equal(torch.log2(scales), torch.log2(scales).round())  # powers of two
    assert fp8.engine.fingerprint["kv_scales"] == scales.tolist()


def test_fp8_pages_serve_cache_hits_and_snapshots_refuse_another_kv_dtype(tiny_llama_dir, tmp_path):
    fp8 = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024, kv_cache_dtype="fp8")
    prompt = torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    first = fp8.generate([prompt], GREEDY)[0]
    again = fp8.generate([prompt], GREEDY)[0]
    assert again.cached_tokens >= 36 and again.token_ids == first.token_ids  # read back from fp8 pages
    records = fp8.engine.export_prefixes(max_tokens=None)
    assert records and records[0].kv.dtype == torch.float8_e4m3fn
    save_snapshot(tmp_path, fp8.engine.fingerprint, records, "pod-a")

    same = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024, kv_cache_dtype="fp8")
    loaded = load_latest_snapshot(tmp_path, same.engine.fingerprint)
    assert loaded.rejected == [] and same.engine.import_prefixes(loaded.records) > 0
    restored = same.generate([prompt], GREEDY)[0]
    assert restored.cached_tokens >= 36 and restored.token_ids == first.token_ids

    full = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    refused = load_latest_snapshot(tmp_path, full.engine.fingerprint)
    assert refused.records == [] and [r.reason for r in refused.rejected] == ["fingerprint_mismatch"]
