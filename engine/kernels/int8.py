"""Weight-only int8 quantization (`--quantization int8`): the format, and its PyTorch reference.

A quantized weight [N, K] is stored per row in blocks of 32 along K: unsigned 8-bit codes q
with, per block, a scale d and an offset m (both float16), meaning w = d * q + m. Our own
quantization is symmetric (q = round(w / d) + 128 with d = absmax / 127, m = -128 d). The
form is chosen so GGUF's blocks map onto it exactly: Q8_0 is the symmetric case, and Q4_1
(w = d * q + m with 4-bit q) is the general one, so a GGUF model's quantized weights are
used as they are, not re-quantized (engine/model/gguf_weights.py).

Only the weights are quantized; the KV cache and every activation between the matrix
multiplies stay in the model's dtype. Inside a multiply the CPU kernel quantizes the input
rows to int16 per block of 32 (scale = absmax / 32767, a relative error near 1e-5, well
below bfloat16's own rounding) so that the products run as integer dot products (vpdpwssd)
and the weights' bytes are read once, at one byte per weight. `--int8-activation-bits 8`
quantizes them to int8 instead (absmax / 127, vpdpbusd: 64 products an instruction where
vpdpwssd does 32), as llama.cpp does against its 4-bit blocks: its multiplies at 8+ rows take
~0.75-0.85x the time, and it moves the model's output more than the weights do
(benchmarks/results/int8_accuracy.md), hence not the default. `reference_linear` computes the
same thing with PyTorch ops: the ground truth the kernel is tested against and the path used
where the kernel is not available (there at 16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # float16 [N, K / 32]
    offsets: torch.Tensor  # float16 [N, K / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), self.offsets.to(device))

    def contiguous(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes.contiguous(), self.scales.contiguous(), self.offsets.contiguous())

    def narrow(self, dim: int, start: int, count: int) -> QuantizedWeight:
        """Rows (dim 0) or input columns (dim 1) [start, start + count), like Tensor.narrow.
        Columns are cut at block boundaries only: a block's scale covers 32 inputs."""
        if dim == 0:
            return QuantizedWeight(*(t.narrow(0, start, count) for t in (self.codes, self.scales, self.offsets)))
        if start % BLOCK or count % BLOCK:
            raise ValueError(f"an int8 weight's input columns split at multiples of {BLOCK}, "
                             f"not [{start}, {start + count})")  # fmt: skip
        return QuantizedWeight(
            self.codes.narrow(1, start, count),
            self.scales.narrow(1, start // BLOCK, count // BLOCK),
            self.offsets.narrow(1, start // BLOCK, count // BLOCK),
        )


def quantize(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-block int8 of a float weight [N, K] (K a multiple of 32)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"int8 quantization needs K divisible by {BLOCK}, got {k}")
    blocks = w.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)
    inv = torch.where(scales > 0, 1.0 / scales.to(torch.float32), torch.zeros((), dtype=torch.float32))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int16) + 128
    return QuantizedWeight(
        q.to(torch.uint8).reshape(n, k), scales, (scales.to(torch.float32) * -128.0).to(torch.float16)
    )


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = qw.shape
    q = qw.codes.reshape(n, k // BLOCK, BLOCK).to(torch.float32)
    w = q * qw.scales.to(torch.float32)[..., None] + qw.offsets.to(torch.float32)[..., None]
    return w.reshape(n, k).to(dtype)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks weights along N (fused q/k/v or gate/up): blocks run along K, so rows are free."""
    return QuantizedWeight(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), torch.cat([p.offsets for p in parts])
    )


ACTIVATION_LEVELS = {16: 32767.0, 8: 127.0}  # activation code width -> largest code


def quantize_activations(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x [M, K] rounded the way the kernel quantizes its input to `bits`-bit codes (per row
    and block of 32, scale absmax / 32767 or / 127, round half to even), returned
    dequantized in float32."""
    levels = ACTIVATION_LEVELS[bits]
    m, k = x.shape
    blocks = x.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / levels
    inv = torch.where(d > 0, 1.0 / d, torch.zeros((), dtype=torch.float32))
    return (torch.round(blocks * inv).clamp_(-levels, levels) * d).reshape(m, k)


def reference_linear(
    x: torch.Tensor, weight_f32: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    activation_bits: int = 16, bf16_panel_rows: int = 0,
) -> torch.Tensor:
    """What the int8 kernel computes, with PyTorch ops: `weight_f32` is dequantize(qw).
    `bf16_panel_rows`: the kernels' `int8_bf16_panel_rows` (0: none). From that many bfloat16
    rows at 16-bit codes the kernel multiplies the rows as they are by the weights rounded to
    bfloat16 (a prompt's path: vdpbf16ps over a dequantized panel)."""
    if 0 < bf16_panel_rows <= x.shape[0] and x.dtype == torch.bfloat16 and activation_bits == 16:
        y = torch.nn.functional.linear(x.to(torch.float32), weight_f32.to(torch.bfloat16).to(torch.float32))
    else:
        y = torch.nn.functional.linear(quantize_activations(x, activation_bits), weight_f32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    y = y.to(x.dtype)
    return y if residual is None else residual + y


def pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: codes [ceil(N/16), K/2, 16, 2] (one 32-byte load = 16 columns x 2
    inputs, widened to vpdpwssd's operand) and scale/offset pairs [ceil(N/16), K/32, 2, 16].
    Codes that all fit in 4 bits (a GGUF Q4_1's) stay at 4 bits: [ceil(N/16), K/4, 32], the
    low nibbles holding input pair 2p and the high ones pair 2p + 1, so such a matrix costs
    a decode step the bytes it has in the file."""
    n, k = qw.shape
    nb = -(-n // 16)
    pad = nb * 16 - n
    four_bit = bool(qw.codes.max() <= 15) if qw.codes.numel() else False
    codes = torch.nn.functional.pad(qw.codes, (0, 0, 0, pad))  # padded rows have d = m = 0
    codes = codes.reshape(nb, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if four_bit:
        pairs = codes.reshape(nb, k // 4, 2, 32)
        codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
    scales = torch.nn.functional.pad(qw.scales, (0, 0, 0, pad)).reshape(nb, 16, k // BLOCK).permute(0, 2, 1)
    offsets = torch.nn.functional.pad(qw.offsets, (0, 0, 0, pad)).reshape(nb, 16, k // BLOCK).permute(0, 2, 1)
    return codes, torch.stack((scales, offsets), dim=2).contiguous()
