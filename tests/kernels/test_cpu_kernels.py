"""The C++ CPU kernels against the PyTorch reference, over shapes hypothesis picks: batch
sizes, contexts crossing page boundaries, GQA ratios, head dims, row counts that fill no
register tile evenly.

Every test runs once per build of the kernels this CPU runs (`kernels` is the extension's
`avx512` or `avx2` submodule): CI's CPU has AVX-512 VNNI/BF16, so there both run, the AVX2
build forced as an AVX2-only laptop would choose it. On a CPU with neither (not x86-64) the
module is skipped with the reason; on a CPU with them, a failed build fails here, loudly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preheat.engine.kernels import cpu_attention, cpu_ext, int8, kv_fp8, reference
from preheat.engine.kernels.cpu_backend import CpuKernelBackend
from preheat.engine.kernels.torch_backend import TorchBackend

ISAS = cpu_ext.runnable_isas(cpu_ext.read_cpu_flags())
if not ISAS:
    pytest.skip(f"this CPU lacks {', '.join(cpu_ext.missing_cpu_flags(set(), 'avx2'))}", allow_module_level=True)

extension = cpu_ext.build()
assert extension.isas() == ISAS  # the runtime check agrees with /proc/cpuinfo
TORCH = TorchBackend()
PACKER = CpuKernelBackend(getattr(extension, ISAS[0]))  # packing is the same for every build


@pytest.fixture(scope="module", params=ISAS)
def kernels(request):
    """One build of the kernels (module-scoped: hypothesis runs many examples per test)."""
    module = getattr(extension, request.param)
    assert module.isa == request.param and module.supported()
    return module


@pytest.fixture(scope="module")
def cpu(kernels) -> CpuKernelBackend:
    return CpuKernelBackend(kernels)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Within a few units in the last place of the dtype, relative to the values' scale."""
    tol = (1e-5 if dtype == torch.float32 else 2e-2) * scale
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def paged_cache(g: torch.Generator, lens: list[int], page_size: int, kvh: int, hd: int, dtype: torch.dtype):
    """A pool-shaped cache (a view into [layers, 2, pages, ...] like KVPool's) with each
    sequence's pages scattered, and its page table."""
    pages_each = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_each) + 3
    kv = torch.randn((2, 2, num_pages, page_size, kvh, hd), generator=g).to(dtype)
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 is scratch
    table = torch.zeros((len(lens), max(pages_each)), dtype=torch.int32)
    for i, n in enumerate(pages_each):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    return kv[1, 0], kv[1, 1], table


@SETTINGS
@given(
    batch=st.integers(1, 6),
    kvh=st.integers(1, 4),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    hd=st.sampled_from([64, 128, 96]),
    page_size=st.sampled_from([1, 4, 16]),
    max_len=st.integers(1, 600),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_decode_attention_matches_the_reference(batch, kvh, group, hd, page_size, max_len, dtype, seed, kernels):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    k_cache, v_cache, table = paged_cache(g, lens, page_size, kvh, hd, dtype)
    q = torch.randn((batch, kvh * group, hd), generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.decode_attention(q, k_cache, v_cache, table, seq_lens, hd**-0.5)
    close(kernels.decode_attention(q, k_cache, v_cache, table, seq_lens, hd**-0.5), expected, dtype)


@SETTINGS
@given(
    extends=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 80)), min_size=1, max_size=4),
    kvh=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 7, 17]),  # 7, 17: rows whose heads straddle two vectors
    hd=st.sampled_from([64, 128]),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_extend_attention_matches_the_reference(extends, kvh, group, hd, page_size, dtype, seed, kernels):
    """A prompt chunk per sequence (prefix cached, new tokens causal among themselves),
    (new token, query head) pairs in the lanes, in bfloat16 and float32 (the AVX-512 build
    hands float32 to the AVX2 build's kernel); the reference is SDPA over the gathered
    context."""
    assert kernels.has_extend_attention
    g = torch.Generator().manual_seed(seed)
    prefix = [p for p, _ in extends]
    extend = [e for _, e in extends]
    k_cache, v_cache, table = paged_cache(g, [p + e for p, e in extends], page_size, kvh, hd, dtype)
    q = torch.randn((sum(extend), kvh * group, hd), generator=g).to(dtype)
    expected = reference.extend_attention(q, k_cache, v_cache, table, prefix, extend, hd**-0.5)
    got = kernels.extend_attention(q, k_cache, v_cache, table, torch.tensor(prefix), torch.tensor(extend), hd**-0.5)
    assert got.dtype == dtype
    close(got, expected, dtype)


def test_extend_attention_refuses_what_it_does_not_take(kernels):
    """Queries of another dtype, caches of neither q's dtype nor fp8, odd-strided bfloat16
    queries, other head sizes: a clear error, not a wrong answer."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, table = paged_cache(g, [20], 16, 1, 64, torch.bfloat16)
    args = (table, torch.tensor([4]), torch.tensor([16]), 0.125)
    q = torch.randn((16, 2, 64), generator=g)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 expected"):
        kernels.extend_attention(q.half(), k_cache, v_cache, *args)
    with pytest.raises(RuntimeError, match="caches must be of the activation dtype or fp8"):
        kernels.extend_attention(q, k_cache, v_cache, *args)  # float32 queries, bfloat16 pages
    odd = torch.randn((16, 2, 65), generator=g).to(torch.bfloat16)[:, :, :64]
    with pytest.raises(RuntimeError, match="even-strided"):
        kernels.extend_attention(odd, k_cache, v_cache, *args)
    k96, v96, t96 = paged_cache(g, [20], 16, 1, 96, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        kernels.extend_attention(torch.randn((16, 2, 96), generator=g), k96, v96, t96, *args[1:])
    assert not cpu_attention.long_extend_eligible(kernels, odd, k_cache)
    assert cpu_attention.long_extend_eligible(kernels, q, k_cache.float())


@SETTINGS
@given(
    extends=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 80)), min_size=1, max_size=3),
    kvh=st.integers(1, 3),
    group=st.sampled_from([1, 3, 7]),
    hd=st.sampled_from([64, 128]),
    page_size=st.sampled_from([1, 16]),
    fp8=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
    scales=st.tuples(st.sampled_from([2.0**-6, 0.25, 1.0]), st.sampled_from([2.0**-8, 0.5, 2.0])),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_extend_attention_reads_fp8_pages_in_place_like_the_reference(
    extends, kvh, group, hd, page_size, fp8, scales, dtype, seed, kernels
):
    """A prompt chunk over an fp8 cache (either format, subnormals included): the extend
    kernel widens the bytes as it reads them (exactly: each fp8 value is a bfloat16 one),
    against the PyTorch path, which dequantises the same bytes."""
    g = torch.Generator().manual_seed(seed)
    prefix, extend = [p for p, _ in extends], [e for _, e in extends]
    k_full, v_full, table = paged_cache(g, [p + e for p, e in extends], page_size, kvh, hd, torch.float32)
    k8, v8 = (torch.empty(c.shape, dtype=fp8) for c in (k_full, v_full))
    k8.kv_scale, v8.kv_scale = torch.tensor([scales[0]]), torch.tensor([scales[1]])
    spread = torch.logspace(-4, 1, hd)  # tiny (subnormal) to large values in every row
    for full, q8 in ((k_full, k8), (v_full, v8)):
        q8.copy_(kv_fp8.store(full * spread * q8.kv_scale, q8))
    q = torch.randn((sum(extend), kvh * group, hd), generator=g).to(dtype)
    expected = reference.extend_attention(q, k8, v8, table, prefix, extend, hd**-0.5)
    got = kernels.extend_attention(q, k8, v8, table, torch.tensor(prefix), torch.tensor(extend), hd**-0.5,
                                   scales[0], scales[1])
    close(got, expected, dtype, scale=max(1.0, float(expected.abs().max())))
    assert cpu_attention.long_extend_eligible(kernels, q, k8)
    close(cpu_attention.long_extend(kernels, q, k8, v8, table, torch.tensor(prefix, dtype=torch.int32),
                                    torch.tensor(extend, dtype=torch.int32), hd**-0.5), got, dtype, scale=0)


@SETTINGS
@given(
    batch=st.integers(1, 4),
    kvh=st.integers(1, 3),
    group=st.sampled_from([1, 3, 7]),  # 7: more heads than the value pass holds at once (5 at 64, 2 at 128)
    hd=st.sampled_from([64, 128]),
    page_size=st.sampled_from([4, 16]),
    max_len=st.integers(1, 400),
    dtype=DTYPES,
    fp8=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
    scales=st.tuples(st.sampled_from([2.0**-6, 0.25, 1.0]), st.sampled_from([2.0**-8, 0.5, 2.0])),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_reads_fp8_pages_in_place_like_the_reference(
    batch, kvh, group, hd, page_size, max_len, dtype, fp8, scales, seed, kernels
):
    """fp8 caches (either format, subnormals included: values of every magnitude) through the
    kernel against the PyTorch path, which dequantises the same bytes (the AVX-512 build
    widens a kv head's rows to bfloat16 once for its group, for bfloat16 queries)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    k_full, v_full, table = paged_cache(g, lens, page_size, kvh, hd, torch.float32)
    k8, v8 = (torch.empty(c.shape, dtype=fp8) for c in (k_full, v_full))
    k8.kv_scale, v8.kv_scale = torch.tensor([scales[0]]), torch.tensor([scales[1]])
    spread = torch.logspace(-4, 1, hd)  # tiny (subnormal) to large values in every row
    for full, q8 in ((k_full, k8), (v_full, v8)):
        q8.copy_(kv_fp8.store(full * spread * q8.kv_scale, q8))
    q = torch.randn((batch, kvh * group, hd), generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.decode_attention(q, k8, v8, table, seq_lens, hd**-0.5)
    got = kernels.decode_attention(q, k8, v8, table, seq_lens, hd**-0.5, scales[0], scales[1])
    close(got, expected, dtype, scale=max(1.0, float(expected.abs().max())))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("hd", [64, 128])
def test_fp8_pages_widen_alike_by_table_lookup_and_through_float16(kernels, fp8, hd):
    """The AVX-512 build widens fp8 pages to bfloat16 by AVX-512 VBMI table lookups where the
    CPU has them, else through float16 and float32: every finite code of both formats, in
    keys and values, must come out the same bits either way."""
    if kernels.isa != "avx512":
        assert not hasattr(kernels, "use_vbmi")
        return
    if "avx512vbmi" not in cpu_ext.read_cpu_flags():
        pytest.skip("this CPU has no AVX512_VBMI: only the float16 path runs here")
    g = torch.Generator().manual_seed(hd)
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(fp8).float())]
    pages, kvh = 24, 2
    k8, v8 = (finite[torch.randint(0, len(finite), (pages, 16, kvh, hd), generator=g)].view(fp8) for _ in "kv")
    table = torch.randperm(pages, generator=g).to(torch.int32).view(3, 8)
    lens = torch.tensor([128, 77, 3], dtype=torch.int32)
    q = (torch.randn((3, kvh * 3, hd), generator=g) * 0.01).bfloat16()
    was = kernels.use_vbmi(True)
    try:
        assert kernels.vbmi()
        by_table = kernels.decode_attention(q, k8, v8, table, lens, 0.01, 0.5, 0.25)
        kernels.use_vbmi(False)
        through_float16 = kernels.decode_attention(q, k8, v8, table, lens, 0.01, 0.5, 0.25)
    finally:
        kernels.use_vbmi(was)
    assert torch.isfinite(by_table).all()
    assert torch.equal(by_table, through_float16)


def test_decode_attention_reads_strided_queries_and_long_contexts(kernels):
    g = torch.Generator().manual_seed(1)
    lens = [1, 3000, 17]  # 3000 tokens: many chunks of one row merged
    k_cache, v_cache, table = paged_cache(g, lens, 16, 2, 64, torch.float32)
    qkv = torch.randn((3, 8 * 64), generator=g)
    q = qkv.view(3, 8, 64)[:, :4]  # a view with a row stride of the fused projection
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.decode_attention(q.contiguous(), k_cache, v_cache, table, seq_lens, 0.125)
    close(kernels.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125), expected, torch.float32)


def test_decode_attention_refuses_lengths_beyond_the_page_table(kernels):
    k_cache = torch.zeros((4, 4, 1, 64))
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        kernels.decode_attention(
            torch.zeros((1, 1, 64)), k_cache, k_cache, torch.ones((1, 1), dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32), 1.0,
        )


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    return PACKER.prepare_linear(w, None, torch.bfloat16).packed


@SETTINGS
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 200),
    k=st.integers(1, 150).map(lambda x: 2 * x),
    bias=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_linear_matches_torch(m, n, k, bias, residual, seed, kernels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=g).bfloat16()
    w = torch.randn((n, k), generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    r = torch.randn((m, n), generator=g).bfloat16() if residual else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    if r is not None:
        expected = r.float() + expected.bfloat16().float()
    y = kernels.linear_bf16(x, pack_bf16(w), n, b, r)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    close(y, expected, torch.bfloat16, scale=k**0.5 / 4)


AMX = "avx512" in ISAS and extension.avx512.amx()  # the CPU has AMX-BF16 and Linux granted its tiles


def on_tiles_and_vectors(product):
    """(on AMX tiles, on the AVX-512 vector kernel): `product()` run once each way, the
    tiles switched back on after, and the two held to one bf16 unit in the last place of the
    larger value (a float32 sum rounded on either side of a bf16 rounding boundary; nearly
    always identical)."""
    kernels = extension.avx512
    assert kernels.amx()
    try:
        tiles = product()
        assert kernels.use_amx(False)
        vectors = product()
    finally:
        kernels.use_amx(True)
    ulp = torch.maximum(tiles.float().abs(), vectors.float().abs()) * 2**-7 + 1e-30
    assert ((tiles.float() - vectors.float()).abs() <= ulp).all()
    return tiles, vectors


@pytest.mark.skipif(not AMX, reason="this CPU (or kernel) gives no AMX-BF16 tiles: the AVX-512 kernel runs every size")
@SETTINGS
@given(
    m=st.integers(1, 80),
    n=st.integers(1, 120),
    k=st.one_of(st.integers(1, 200).map(lambda x: 2 * x), st.integers(1, 12).map(lambda x: 32 * x)),
    pad=st.sampled_from([0, 2, 64]),
    bias=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_linear_on_amx_tiles_matches_the_avx512_kernel(m, n, k, pad, bias, residual, seed):
    """The AVX-512 build multiplies on AMX tiles where it can (gemm_bf16_amx.cpp: one tile of
    rows with tail tiles for any K up to 16 rows; past 16 rows, when K is a multiple of 32,
    groups of 32 rows in two tiles, the last group overlapping the one before; else the
    vector kernel): the same sums of exact bf16 products in
    float32 as vdpbf16ps, so both kernels agree to float32 rounding before the output's bf16
    rounding; rows with a stride (`pad`), inputs that are not a multiple of a tile's 32,
    every column tail."""
    kernels = extension.avx512
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k + pad), generator=g).bfloat16()[:, :k]
    w = torch.randn((n, k), generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    r = torch.randn((m, n), generator=g).bfloat16() if residual else None
    packed = pack_bf16(w)
    tiles, _ = on_tiles_and_vectors(lambda: kernels.linear_bf16(x, packed, n, b, r))
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    if r is not None:
        expected = r.float() + expected.bfloat16().float()
    close(tiles, expected, torch.bfloat16, scale=k**0.5 / 4)


@pytest.mark.skipif(not AMX, reason="this CPU (or kernel) gives no AMX-BF16 tiles: the AVX-512 kernel runs every size")
@SETTINGS
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 100),
    blocks=st.integers(1, 8),
    four_bit=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_prompt_panel_on_amx_tiles_matches_the_avx512_kernel(m, n, blocks, four_bit, residual, seed):
    """A prompt's bf16 rows against int8 / 4-bit codes go through a bf16 panel of the
    dequantized codes (forced here at every row count): on AMX tiles where the CPU has them,
    in groups of 32 rows past 16; the same sums as vdpbf16ps to float32 rounding."""
    kernels = extension.avx512
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    qw = int8.quantize(torch.randn((n, k), generator=g))
    if four_bit:
        qw = int8.QuantizedWeight((qw.codes.int() // 16).to(torch.uint8), qw.scales, qw.offsets)
    codes, dm = int8.pack(qw)
    x = torch.randn((m, k), generator=g).bfloat16()
    r = torch.randn((m, n), generator=g).bfloat16() if residual else None
    tiles, _ = on_tiles_and_vectors(lambda: kernels.linear_int8(x, codes, dm, n, None, r, bf16_panel_rows=1))
    expected = F.linear(x.float(), int8.dequantize(qw).bfloat16().float())
    if r is not None:
        expected = r.float() + expected.bfloat16().float()
    close(tiles, expected, torch.bfloat16, scale=k**0.5 / 4)


def test_amx_can_be_switched_off_and_on():
    if "avx512" not in ISAS:
        pytest.skip("no AVX-512 build here")
    kernels = extension.avx512
    was = kernels.amx()
    assert kernels.use_amx(False) == was and not kernels.amx()
    assert kernels.use_amx(True) is False and kernels.amx() == was  # on only where the CPU allows
    assert not hasattr(extension.avx2, "use_amx")


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    prepared = PACKER.prepare_linear(w, None, torch.float32)
    assert prepared.kind == "f32"  # a float32 model's weights go to the kernel, not F.linear
    return prepared.packed


@SETTINGS
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    bias=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_f32_linear_matches_torch(m, n, k, bias, residual, seed, kernels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=g)
    w = torch.randn((n, k), generator=g)
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn((m, n), generator=g) if residual else None
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    if r is not None:
        expected = r.double() + expected
    y = kernels.linear_f32(x, pack_f32(w), n, b, r)
    assert y.shape == (m, n) and y.dtype == torch.float32
    close(y, expected, torch.float32, scale=k**0.5)


def test_f32_linear_reads_strided_rows_and_refuses_a_foreign_packing(kernels):
    g = torch.Generator().manual_seed(3)
    x = torch.randn((5, 2 * 96), generator=g)[:, ::2]  # rows with a stride, not contiguous
    w = torch.randn((40, 96), generator=g)
    y = PACKER.apply_linear(x, PACKER.prepare_linear(w, None, torch.float32))
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="packed float32 weight"):
        kernels.linear_f32(x.contiguous(), pack_bf16(w.bfloat16()), 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [32, 33])  # whole blocks of 16 rows (no padding), and not
def test_packing_a_strided_weight_is_packing_its_contiguous_copy(n, dtype):
    """A tensor-parallel shard is a strided view of the checkpoint's tensor: packing must read
    it as its values, with or without rows of padding."""
    w = torch.randn((n * 2, 64), generator=torch.Generator().manual_seed(n)).to(dtype)[::2]
    assert not w.is_contiguous()
    pack = pack_bf16 if dtype == torch.bfloat16 else pack_f32
    assert torch.equal(pack(w), pack(w.contiguous()))


@SETTINGS
@given(
    # Up to 48 rows: decode-sized tiles, and the panels prompts' rows multiply (8-bit codes
    # from 16 rows, bf16 rows at 16-bit codes from kernels.int8_bf16_panel_rows).
    m=st.integers(1, 48),
    n=st.integers(1, 120),
    k=st.integers(1, 12).map(lambda x: 32 * x),
    dtype=DTYPES,
    bias=st.booleans(),
    residual=st.booleans(),
    four_bit=st.booleans(),
    bits=st.sampled_from([16, 8]),
    seed=st.integers(0, 2**16),
)
def test_int8_linear_matches_its_reference(m, n, k, dtype, bias, residual, four_bit, bits, seed, kernels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=g).to(dtype)
    qw = int8.quantize(torch.randn((n, k), generator=g))
    if four_bit:  # codes as a GGUF Q4_1 has them
        qw = int8.QuantizedWeight(qw.codes // 17, qw.scales, (torch.randn(qw.offsets.shape, generator=g) * 0.1).half())
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn((m, n), generator=g).to(dtype) if residual else None
    codes, scales = int8.pack(qw)
    if bits not in kernels.int8_activation_bits_choices:  # int8 codes: the AVX-512 VNNI build's
        with pytest.raises(RuntimeError, match=f"the {kernels.isa} build takes activation_bits 16, got 8"):
            kernels.linear_int8(x, codes, scales, n, b, r, bits)
        return
    y = kernels.linear_int8(x, codes, scales, n, b, r, bits)
    expected = int8.reference_linear(x, int8.dequantize(qw), b, r, activation_bits=bits,
                                     bf16_panel_rows=kernels.int8_bf16_panel_rows)
    assert y.dtype == dtype
    # Same quantized products; only the order of the float32 sums differs.
    close(y, expected, dtype, scale=10 if dtype == torch.float32 else 1)


def test_int8_linear_reads_asymmetric_blocks_like_gguf_q4_1(kernels):
    g = torch.Generator().manual_seed(3)
    n, k = 40, 96
    qw = int8.QuantizedWeight(
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        (torch.rand((n, k // 32), generator=g) * 0.1).half(),
        (torch.randn((n, k // 32), generator=g) * 0.1).half(),
    )
    codes, scales = int8.pack(qw)
    assert codes.shape == (3, k // 4, 32)  # kept at 4 bits: half the bytes
    for rows in (1, 5, 16):
        x = torch.randn((rows, k), generator=g)
        close(kernels.linear_int8(x, codes, scales, n), int8.reference_linear(x, int8.dequantize(qw)), torch.float32, 10)
        for bits in set(kernels.int8_activation_bits_choices) - {16}:
            close(kernels.linear_int8(x, codes, scales, n, activation_bits=bits),
                  int8.reference_linear(x, int8.dequantize(qw), activation_bits=bits), torch.float32, 10)


def test_int8_linear_multiplies_a_prompts_bf16_rows_by_bf16_weights(kernels):
    """From int8_bf16_panel_rows bf16 rows (16-bit codes) the kernel dequantizes the codes to
    bfloat16 and multiplies the rows as they are; fewer rows keep the integer products. The
    weights here tell the two apart: w = 1 + 2^-9 is not a bfloat16 (it rounds to 1), so
    sum(x w) over alternating +1 / -1 inputs is 16 * 2^-9 exactly with the codes and 0 with
    the weights rounded."""
    panel_rows = kernels.int8_bf16_panel_rows
    assert (panel_rows > 0) == (kernels.isa == "avx512")  # the AVX2 build: int16 codes at every size
    n, k = 20, 32
    qw = int8.QuantizedWeight(
        (torch.arange(k) % 2 == 0).to(torch.uint8).repeat(n, 1),  # q = 1 on even inputs, 0 on odd
        torch.full((n, 1), 2.0**-9).half(),
        torch.ones((n, 1)).half(),
    )
    codes, scales = int8.pack(qw)
    for rows in (panel_rows - 1, panel_rows, panel_rows + 7) if panel_rows else (1, 40, 200):
        x = torch.tensor([1.0, -1.0] * (k // 2)).repeat(rows, 1).bfloat16()
        y = kernels.linear_int8(x, codes, scales, n)
        panel = 0 < panel_rows <= rows
        assert torch.equal(y, torch.full((rows, n), 0.0 if panel else 2.0**-5).bfloat16()), rows
        assert torch.equal(y, int8.reference_linear(x, int8.dequantize(qw), bf16_panel_rows=panel_rows))
        # Turned off (a benchmark's side): the integer products at every size.
        assert torch.equal(kernels.linear_int8(x, codes, scales, n, bf16_panel_rows=0),
                           torch.full((rows, n), 2.0**-5).bfloat16())


@SETTINGS
@given(m=st.integers(1, 70), n=st.sampled_from([16, 72, 576, 100]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_rms_norm_matches_the_reference(m, n, dtype, seed, kernels, cpu):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((m, n), generator=g) * 3).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    expected = TORCH.rms_norm(x, w, 1e-5)
    close(kernels.rms_norm(x, w, 1e-5), expected, dtype)
    close(cpu.rms_norm(x, w, 1e-5), expected, dtype)


@SETTINGS
@given(m=st.integers(1, 40), inter=st.sampled_from([16, 40, 1536]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_silu_mul_matches_the_reference(m, inter, dtype, seed, kernels, cpu):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn((m, 2 * inter), generator=g) * 4).to(dtype)
    expected = TORCH.silu_mul(gu)
    close(kernels.silu_mul(gu), expected, dtype)
    close(cpu.silu_mul(gu), expected, dtype)


@SETTINGS
@given(
    m=st.integers(1, 12),
    n=st.sampled_from([1, 7, 8, 15, 17, 49152]),
    few_values=st.booleans(),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "-0.0"]), max_size=3),
    stride_pad=st.sampled_from([0, 5]),
    seed=st.integers(0, 2**16),
)
def test_argmax_rows_picks_what_torch_argmax_picks(m, n, few_values, specials, stride_pad, seed, kernels, cpu):
    """Greedy sampling's choice: the first of tied maxima (few distinct values make ties
    common), a row's first NaN where it has one, rows whose tail fills no vector."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (m, n + stride_pad), generator=g).float() if few_values else torch.randn(m, n + stride_pad, generator=g)
    for i, s in enumerate(specials):
        x[(seed + i) % m, (seed * 7 + i * 13) % n] = float(s)
    x = x[:, :n]  # rows strided when padded
    expected = x.argmax(-1)
    assert torch.equal(kernels.argmax_rows(x), expected)
    assert torch.equal(cpu.argmax(x), expected)


def test_argmax_rows_of_all_minus_infinity_and_refusals(kernels):
    x = torch.full((3, 20), float("-inf"))
    x[1, 9] = float("nan")
    x[2, 19] = 0.0
    assert kernels.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 9, 19]
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(x.bfloat16())
    with pytest.raises(RuntimeError, match="N > 0"):
        kernels.argmax_rows(torch.empty(2, 0))


@SETTINGS
@given(
    rows=st.integers(1, 20),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1)]),
    hd=st.sampled_from([64, 128]),
    dtype=DTYPES,
    normed_qk=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_and_kv_write_match_the_reference(rows, heads, hd, dtype, normed_qk, seed, cpu):
    from preheat.engine.kernels.rope import RotaryEmbedding

    num_heads, kvh = heads
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), 1.0, dtype)
    qkv = torch.randn((rows + 2, (num_heads + 2 * kvh) * hd), generator=g).to(dtype)  # 2 padding rows
    positions = torch.randint(0, 3000, (rows + 2,), generator=g)
    slots = torch.randperm(64, generator=g)[:rows] + 4
    caches = [torch.zeros((2, 5, 16, kvh, hd), dtype=dtype) for _ in range(2)]
    # Qwen3 normalises q and k per head before the rotation: they come in separately.
    qk = (qkv[:, : (num_heads + kvh) * hd].view(-1, num_heads + kvh, hd) * 0.5) if normed_qk else None
    q_ref = TORCH.rope_write_kv(qkv, rows, TORCH.rope_inputs(rope, positions, hd), caches[0][0], caches[0][1],
                                slots, num_heads, kvh, hd, qk)
    inputs = cpu.rope_inputs(rope, positions, hd)
    assert inputs.use_kernel
    q = cpu.rope_write_kv(qkv, rows, inputs, caches[1][0], caches[1][1], slots, num_heads, kvh, hd, qk)
    close(q, q_ref, dtype)
    close(caches[1], caches[0], dtype)


def fp8_edge_values(fp8: torch.dtype, scale: float) -> torch.Tensor:
    """Values whose fp8 bytes are easy to get wrong, times `scale` (a cache stores x / scale):
    every finite code's value, the midpoints between neighbours (ties round to even), just
    beside them, beyond the largest value (clamped), subnormals, signed zeros and a NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    top = torch.finfo(fp8).max
    extra = torch.tensor([top * 1.01, -top * 1.5, top * 1e3, 0.0, -0.0, float("nan"), 1e-30, -1e-12])
    x = torch.cat([finite, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), extra])
    return x * scale


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scale", [0.25, 0.3])
def test_rope_kv_writes_an_fp8_cache_with_the_bytes_of_the_pytorch_store(kernels, fp8, dtype, scale):
    """An fp8 cache is written by the kernel as kv_fp8.store writes it (x / scale, clamped,
    rounded to nearest even): V byte for byte over every code, the midpoints between codes
    and past the ends; K the rotated key the same kernel writes into a cache of the
    activations' dtype, then stored."""
    from preheat.engine.kernels.rope import RotaryEmbedding

    heads, kvh, hd = 4, 2, 64
    v = fp8_edge_values(fp8, scale).to(dtype)
    rows = -(-v.numel() // (kvh * hd))
    v = torch.cat([v, torch.randn(rows * kvh * hd - v.numel()).to(dtype)]).view(rows, kvh * hd)
    g = torch.Generator().manual_seed(3)
    qk = torch.randn((rows, (heads + kvh) * hd), generator=g).to(dtype) * torch.logspace(-6, 3, rows)[:, None].to(dtype)
    qkv = torch.cat([qk, v], dim=1).contiguous()
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), 1.0, dtype)
    positions = torch.randint(0, 500, (rows,), generator=g)
    slots = torch.randperm(rows * 2, generator=g)[:rows]
    table = rope.table(500)
    plain = [torch.zeros((rows * 2, kvh, hd), dtype=dtype) for _ in range(2)]
    q_plain = kernels.rope_kv(qkv, rows, heads, kvh, table, positions, slots, *plain)
    caches = [torch.zeros((rows * 2, kvh, hd), dtype=fp8) for _ in range(2)]
    q = kernels.rope_kv(qkv, rows, heads, kvh, table, positions, slots, *caches, k_scale=scale, v_scale=scale)
    assert torch.equal(q, q_plain)
    for cache in caches:
        cache.kv_scale = torch.tensor([scale])
    for got, want in zip(caches, plain, strict=True):
        expected = kv_fp8.store(want[slots], got)  # the written slots, as the PyTorch path stores them
        assert torch.equal(got[slots].view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(RuntimeError, match="activation dtype or fp8"):
        kernels.rope_kv(qkv, rows, heads, kvh, table, positions, slots, *[c.to(torch.float16) for c in plain])


def test_short_extends_run_as_decode_rows(cpu):
    from preheat.engine.kernels import cpu_attention

    g = torch.Generator().manual_seed(4)
    prefix, extend = [30, 0, 7], [4, 3, 1]
    lens = [p + e for p, e in zip(prefix, extend)]
    k_cache, v_cache, table = paged_cache(g, lens, 4, 2, 64, torch.float32)
    q = torch.randn((sum(extend), 6, 64), generator=g)
    expected = reference.extend_attention(q, k_cache, v_cache, table, prefix, extend, 0.125)
    plan = cpu.prepare_extend(table, prefix, extend, 4)
    assert isinstance(plan, cpu_attention.ShortExtend) and plan.seq_lens.tolist() == [31, 32, 33, 34, 1, 2, 3, 8]
    got = cpu.extend_attention(q, k_cache, v_cache, table, prefix, extend, 0.125, plan)
    assert cpu_attention.plan_short_extend(table, [0], [cpu_attention.SHORT_EXTEND + 1]) is None
    close(got, expected, torch.float32)
    # Unprepared (an extend no forward pass planned), the backend lays it out itself.
    close(cpu.extend_attention(q, k_cache, v_cache, table, prefix, extend, 0.125), expected, torch.float32)


def test_fills_extend_lanes_weighs_vectors_against_decode_rows():
    from preheat.engine.kernels.cpu_attention import fills_extend_lanes

    assert fills_extend_lanes([5, 5, 4], 3)  # verify steps of 4-token drafts: 15, 15, 12 of 16 lanes
    assert fills_extend_lanes([3], 3)  # 9 of 16
    assert not fills_extend_lanes([2, 2], 3)  # 6 of 16: decode rows are cheaper
    assert not fills_extend_lanes([1], 4) and not fills_extend_lanes([2], 4) and fills_extend_lanes([3], 4)
    assert not fills_extend_lanes([8], 1) and fills_extend_lanes([9], 1)
    assert fills_extend_lanes([16], 1) and fills_extend_lanes([6], 3)  # 18 lanes in 2 vectors: 9 a vector
    assert not fills_extend_lanes([17], 1)  # 17 lanes in 2 vectors
    # The AVX2 kernel's 8 lanes a vector: at least 6 of them.
    assert fills_extend_lanes([2], 3, 8) and not fills_extend_lanes([1], 4, 8) and fills_extend_lanes([2], 4, 8)
    assert not fills_extend_lanes([3], 3, 8)  # 9 lanes in 2 vectors
    assert fills_extend_lanes([4], 3, 8) and fills_extend_lanes([5, 5, 4], 3, 8)


def test_extend_kernel_lanes_follow_the_kernel_that_runs(kernels):
    width = cpu_attention.extend_kernel_lanes
    assert width(kernels, torch.float32) == 8
    assert width(kernels, torch.bfloat16) == (16 if kernels.isa == "avx512" else 8)


def test_short_extends_that_fill_the_lanes_run_on_the_extend_kernel(cpu, kernels, monkeypatch):
    """A verify step's extend (a few tokens per sequence over a cached context) in bfloat16:
    on the extend kernel where its lanes fill (SmolLM2's 3 heads a group, 5 tokens: 15 of
    16, or 8 and 7 of the AVX2 kernel's 8), as decode rows where they do not (1 token a
    sequence), the same answer every way."""
    from preheat.engine.kernels import cpu_attention

    g = torch.Generator().manual_seed(5)
    calls: list[int] = []
    real = cpu_attention.long_extend
    monkeypatch.setattr(cpu_attention, "long_extend", lambda *a, **k: calls.append(1) or real(*a, **k))
    for extend, on_kernel in (([5, 4, 5], True), ([1, 1, 1], False)):
        prefix = [40, 7, 100]
        k_cache, v_cache, table = paged_cache(g, [p + e for p, e in zip(prefix, extend)], 16, 2, 64, torch.bfloat16)
        q = torch.randn((sum(extend), 6, 64), generator=g).bfloat16()
        expected = reference.extend_attention(q, k_cache, v_cache, table, prefix, extend, 0.125)
        plan = cpu.prepare_extend(table, prefix, extend, 16)
        assert isinstance(plan, cpu_attention.ShortExtend)
        calls.clear()
        got = cpu.extend_attention(q, k_cache, v_cache, table, prefix, extend, 0.125, plan)
        assert bool(calls) == on_kernel
        close(got, expected, torch.bfloat16)
        rows = cpu_attention.decode_attention(kernels, q, k_cache, v_cache, plan.page_table, plan.seq_lens, 0.125)
        close(got, rows, torch.bfloat16)


@pytest.mark.parametrize("n", [40, 48])  # a partial column block, and none
def test_packed_weights_unpack_to_their_dense_rows_exactly(kernels, n):
    """The long-prompt path (linear._dense_product) multiplies by these rows: the bf16 packing
    undone bit for bit, int8 / 4-bit codes dequantized as int8.dequantize does (then rounded
    once to bfloat16), and the product equals F.linear by those rows."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn((n, 96), generator=g)
    bf16 = PACKER.prepare_linear(w.bfloat16(), None, torch.bfloat16)
    assert torch.equal(kernels.dense_bf16(bf16.packed, n), w.bfloat16())
    q = int8.quantize(w)
    for qw in (q, int8.QuantizedWeight(q.codes // 17, q.scales, (torch.randn(q.offsets.shape, generator=g) * 0.1).half())):
        codes, scales = int8.pack(qw)
        assert torch.equal(kernels.dense_int8(codes, scales, n, torch.float32), int8.dequantize(qw))
        assert torch.equal(kernels.dense_int8(codes, scales, n, torch.bfloat16), int8.dequantize(qw).bfloat16())
    from preheat.engine.kernels import linear

    x, r = torch.randn((40, 96), generator=g).bfloat16(), torch.randn((40, n), generator=g).bfloat16()
    long = linear.prepare(w.bfloat16(), None, torch.bfloat16, kernels, {"bf16": 32})
    assert long.dense_from_rows == 32
    assert torch.equal(linear.apply(x, long, r), r + F.linear(x, w.bfloat16()))
    close(linear.apply(x[:8], long), F.linear(x[:8], w.bfloat16()), torch.bfloat16, scale=4)  # short: the kernel


def test_a_build_without_8_bit_activation_codes_runs_16_and_says_so(caplog):
    from preheat.engine.kernels.cpu_backend import int8_activation_bits_for

    avx2 = extension.avx2
    assert avx2.int8_activation_bits_choices == [16]
    with caplog.at_level("WARNING", logger="preheat.engine.kernels.cpu_backend"):
        assert int8_activation_bits_for(avx2, 8) == 16
    assert "--int8-activation-bits 8 needs the avx512 kernels (this is the avx2 build); using 16" in caplog.text
    assert int8_activation_bits_for(avx2, 16) == 16
    assert extension.avx512.int8_activation_bits_choices == [16, 8]
    assert int8_activation_bits_for(extension.avx512, 8) == 8
