"""The model's linear layers (activations x weight matrix), as pure functions.

`prepare` turns a weight, dense or int8-quantized (engine/kernels/int8.py), into the form a
backend reads, once at load; `apply` multiplies. Given the CPU kernels module
(engine/kernels/cpu_ext.py; the CPU backend passes it) a bfloat16 weight is packed for
vdpbf16ps, a float32 one for 16-wide FMAs and an int8 weight for vpdpwssd / vpdpbusd (the AVX2 build
reads the same packings), and one kernel call does the product, the bias and the residual
add. Without it (GPU, a CPU without the kernels) it is F.linear, exactly as before: the GPU
path does not change. A packed weight keeps the module
that packed it, so `apply` needs no backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from preheat.engine.kernels import int8


@dataclass
class LinearWeight:
    out_features: int
    in_features: int
    kind: str  # "dense" (F.linear), "bf16" / "f32" / "int8" (packed), "int8-reference"
    weight: torch.Tensor | None = None  # dense [N, K]; int8-reference: dequantized float32
    # bf16 [N/16, K/2, 16, 2], f32 [N/16, K, 16] or int8 codes [N/16, K/2, 16, 2]
    packed: torch.Tensor | None = None
    scales: torch.Tensor | None = None  # int8: [N/16, K/32, 2, 16] float16
    bias: torch.Tensor | None = None
    kernels: ModuleType | None = None  # the module that packed it (packed kinds only)
    # Packed kinds: from this many rows (a long prompt) the product goes through dense rows
    # unpacked for the call and F.linear (oneDNN on AMX); None: always the kernel.
    dense_from_rows: int | None = None
    # int8: the width of the activation codes the kernel multiplies by (16 or 8; --int8-activation-bits)
    activation_bits: int = 16

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def tensors(self) -> list[torch.Tensor]:
        """What one product reads (a decode step's weight bytes are their sizes)."""
        return [t for t in (self.weight, self.packed, self.scales, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def prepare(
    weight: torch.Tensor | int8.QuantizedWeight | LinearWeight, bias: torch.Tensor | None, dtype: torch.dtype,
    kernels: ModuleType | None = None, dense_from_rows: dict[str, int] | None = None, activation_bits: int = 16,
) -> LinearWeight:
    """The form of one weight that `apply` multiplies by: packed for `kernels` (the CPU
    kernels module) where they take it, else plain. `dtype` is the activations' (the model's).
    `dense_from_rows` (per packed kind, cpu_ext.dense_prefill_rows) sends long prompts in
    bfloat16 through dense rows instead of the kernel; the weight is still stored once, packed.
    `activation_bits`: an int8 weight's activation codes (16, or 8 where `kernels` run it).
    A weight already prepared (`restore`, its bias inside) comes back as it is."""
    if isinstance(weight, LinearWeight):
        if bias is not None:
            raise ValueError("a prepared weight carries its own bias")
        return weight
    long_rows = _long_prompt_rows(dtype, dense_from_rows)
    if isinstance(weight, int8.QuantizedWeight):
        n, k = weight.shape
        if kernels is not None and weight.codes.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            codes, scales = int8.pack(weight)
            return LinearWeight(n, k, "int8", packed=codes, scales=scales, bias=bias, kernels=kernels,
                                dense_from_rows=long_rows.get("int8"), activation_bits=activation_bits)  # fmt: skip
        return LinearWeight(n, k, "int8-reference", weight=int8.dequantize(weight), bias=bias)
    n, k = weight.shape
    if kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and k % 2 == 0:
        return LinearWeight(n, k, "bf16", packed=_pack(weight, 2), bias=bias, kernels=kernels,
                            dense_from_rows=long_rows.get("bf16"))  # fmt: skip
    if kernels is not None and weight.device.type == "cpu" and weight.dtype == torch.float32 == dtype:
        return LinearWeight(n, k, "f32", packed=_pack(weight, 1).squeeze(-1), bias=bias, kernels=kernels)
    return LinearWeight(n, k, "dense", weight=weight, bias=bias)


def _pack(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K/group, 16, group] (rows padded to whole blocks of 16): one
    64-byte load holds 16 output columns x `group` inputs, the operand of the kernel's
    product — bf16 pairs for vdpbf16ps (group 2), float32 columns for an FMA (group 1)."""
    n, k = weight.shape
    nb = -(-n // 16)
    # F.pad copies even when it pads nothing: half of packing a model's weights at load.
    rows = F.pad(weight, (0, 0, 0, nb * 16 - n)) if nb * 16 != n else weight
    return rows.reshape(nb, 16, k // group, group).permute(0, 2, 1, 3).contiguous()


def _long_prompt_rows(dtype: torch.dtype, dense_from_rows: dict[str, int] | None) -> dict[str, int]:
    """Per packed kind, the rows from which a product goes through dense rows: float32
    activations keep the kernels' arithmetic at every size."""
    return dict(dense_from_rows or {}) if dtype == torch.bfloat16 else {}


# The packed kinds and the tensors each stores (`stored` / `restore`).
PACKED_TENSORS = {"bf16": ("packed",), "f32": ("packed",), "int8": ("packed", "scales")}


def stored(w: LinearWeight) -> dict[str, torch.Tensor]:
    """What `restore` needs of a packed weight besides its kind and shape: the packed
    tensors and the bias (a restart reads them instead of packing the checkpoint again)."""
    if w.kind not in PACKED_TENSORS:
        raise ValueError(f"only packed weights are stored, not {w.kind!r}")
    out = {name: getattr(w, name) for name in PACKED_TENSORS[w.kind]}
    return out | ({"bias": w.bias} if w.bias is not None else {})


def packed_shapes(kind: str, n: int, k: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) choices `prepare` gives a packed weight [n, k]'s packed tensor
    (int8: 8-bit codes, or 4-bit when every code fits) and then its scales."""
    nb = -(-n // 16)
    if kind == "bf16":
        return [((nb, k // 2, 16, 2), torch.bfloat16)]
    if kind == "f32":
        return [((nb, k, 16), torch.float32)]
    return [((nb, k // 2, 16, 2), torch.uint8), ((nb, k // 4, 32), torch.uint8),
            ((nb, k // int8.BLOCK, 2, 16), torch.float16)]


def restore(kind: str, n: int, k: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
            kernels: ModuleType, dense_from_rows: dict[str, int] | None = None,
            activation_bits: int = 16) -> LinearWeight:  # fmt: skip
    """The LinearWeight `prepare` made for these `stored` tensors, multiplied by `kernels`
    (the same rules for long prompts). Raises ValueError when a tensor is not what `prepare`
    packs for a [n, k] weight of that kind (a damaged or foreign cache entry)."""
    if kind not in PACKED_TENSORS or set(tensors) - {"bias"} != set(PACKED_TENSORS[kind]):
        raise ValueError(f"{kind!r} weight with tensors {sorted(tensors)}")
    shapes = packed_shapes(kind, n, k)
    packed, scales = tensors["packed"], tensors.get("scales")
    if (tuple(packed.shape), packed.dtype) not in shapes[:2] or (
        scales is not None and (tuple(scales.shape), scales.dtype) != shapes[-1]
    ):
        raise ValueError(f"{kind!r} [{n}, {k}] weight: packed {tuple(packed.shape)} {packed.dtype}")
    bias = tensors.get("bias")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{kind!r} [{n}, {k}] weight: bias {tuple(bias.shape)}")
    return LinearWeight(n, k, kind, packed=packed, scales=scales, bias=bias, kernels=kernels,
                        dense_from_rows=_long_prompt_rows(dtype, dense_from_rows).get(kind),
                        activation_bits=activation_bits if kind == "int8" else 16)


def apply(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> x W^T (+ bias) (+ residual), in x's dtype. `residual` is added after the
    product is rounded to that dtype, as `residual + F.linear(x, W)` does."""
    if w.dense_from_rows is not None and x.shape[0] >= w.dense_from_rows:
        return _dense_product(x, w, residual)
    if w.kind == "bf16":
        return w.kernels.linear_bf16(_rows(x), w.packed, w.out_features, w.bias, residual)
    if w.kind == "f32":
        return w.kernels.linear_f32(_rows(x), w.packed, w.out_features, w.bias, residual)
    if w.kind == "int8":
        return w.kernels.linear_int8(_rows(x), w.packed, w.scales, w.out_features, w.bias, residual,
                                     w.activation_bits)
    if w.kind == "int8-reference":
        return int8.reference_linear(x, w.weight, w.bias, residual)
    y = F.linear(x, w.weight, w.bias)
    return y if residual is None else residual + y


def _dense_product(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor | None) -> torch.Tensor:
    """A long prompt's product: the packed weight unpacked (bf16) or dequantized to x's dtype
    (int8 / 4-bit codes: w = d q + m, rounded once) into dense rows for this call — about one
    pass over the weight — then the library GEMM, many times faster than the skinny kernels
    at hundreds of rows where the CPU has AMX."""
    kernels = w.kernels
    assert kernels is not None and w.packed is not None
    if w.kind == "bf16":
        dense = kernels.dense_bf16(w.packed, w.out_features)
    else:
        dense = kernels.dense_int8(w.packed, w.scales, w.out_features, x.dtype)
    y = F.linear(x, dense, w.bias)
    return y if residual is None else residual + y


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
