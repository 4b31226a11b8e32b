"""A long prompt's matrix multiply: the skinny CPU kernels against dense rows + the library
GEMM (linear.py's `_dense_product`: the packed weight unpacked or dequantized for the call,
then F.linear, which oneDNN runs on AMX-BF16 tiles where the CPU has them), per row count,
one of SmolLM2-135M's MLP matrices (1536 x 576) and its down projection (576 x 1536), in one
run, alternating. This is what sets cpu_ext.DENSE_PREFILL_ROWS. For int8 / 4-bit codes it
also times the kernel's own paths side by side: its default (from the build's
`int8_bf16_panel_rows` bf16 rows the codes are dequantized into a bf16 panel and multiplied
by vdpbf16ps), the int16 activation codes at every size (`bf16_panel_rows=0`, the path
before the panel) and 8-bit activation codes (`--int8-activation-bits 8`), which sets
the panel's row count.

Writes benchmarks/results/long_prompt_matmul.md.

    python benchmarks/long_prompt_matmul.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from preheat.engine.kernels import cpu_ext, int8, linear

RESULTS = Path(__file__).parent / "results"
ROWS = (8, 16, 32, 64, 128, 256, 512)


def best_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 4]  # lower quartile: this VM's neighbours add noise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "long_prompt_matmul.md")
    args = ap.parse_args()
    flags = cpu_ext.read_cpu_flags()
    kernels = cpu_ext.load()
    if kernels is None:
        print(f"no CPU kernels here: {cpu_ext.unavailable_reason}")
        return 1
    lines = [
        "# A long prompt's matrix multiply: skinny kernels vs dense rows + oneDNN",
        "",
        f"CPU kernels: {kernels.isa} build; AMX-BF16: {'yes' if 'amx_bf16' in flags else 'no'}; "
        f"{torch.get_num_threads()} threads. bfloat16 activations; each cell the lower-quartile ms of 15 calls. "
        "`dense` = the packed weight unpacked (bf16) or dequantized (int8 / 4-bit codes) for the call, then "
        "F.linear; the engine switches at cpu_ext.DENSE_PREFILL_ROWS "
        f"({cpu_ext.DENSE_PREFILL_ROWS}; in use here: {cpu_ext.dense_prefill_rows(flags, kernels.isa) or 'never'}). "
        f"int8 / 4-bit `kernel` = the kernel's default: int16 activation codes, and from "
        f"{getattr(kernels, 'int8_bf16_panel_rows', 0) or '(never, this build)'} rows the codes dequantized into a "
        "bf16 panel per group of column blocks and multiplied by the bf16 GEMM; `int16 codes` = int16 activation "
        "codes at every size (the panel off); `8-bit codes` = `--int8-activation-bits 8`.",
        "",
    ]
    g = torch.Generator().manual_seed(0)
    for n, k in ((1536, 576), (576, 1536)):
        w = torch.randn((n, k), generator=g) * 0.05
        q = int8.quantize(w)
        packed = {
            "bf16": linear.prepare(w.bfloat16(), None, torch.bfloat16, kernels),
            "4-bit": linear.prepare(int8.QuantizedWeight(q.codes // 17, q.scales, q.offsets), None, torch.bfloat16,
                                    kernels),  # fmt: skip
            "int8": linear.prepare(q, None, torch.bfloat16, kernels),
        }
        int8_kinds = [kind for kind, w_ in packed.items() if w_.kind == "int8"]
        header = ["bf16 kernel", "bf16 dense"]
        for kind in int8_kinds:
            header += [f"{kind} kernel", f"{kind} int16 codes", f"{kind} 8-bit codes", f"{kind} dense"]
        lines += [f"## {n} x {k}", "", "| rows | " + " | ".join(header) + " |", "| --- |" + " --- |" * len(header)]
        for m in ROWS:
            x = torch.randn((m, k), generator=g).bfloat16()
            cells = []
            for w_ in packed.values():
                cells.append(f"{best_ms(lambda x=x, w_=w_: linear.apply(x, w_)):.3f}")
                if w_.kind == "int8":
                    for bits, panel in ((16, 0), (8, -1)):
                        cells.append(f"{best_ms(lambda x=x, w_=w_, b=bits, p=panel: kernels.linear_int8(x, w_.packed, w_.scales, w_.out_features, activation_bits=b, bf16_panel_rows=p)):.3f}")
                cells.append(f"{best_ms(lambda x=x, w_=w_: linear._dense_product(x, w_, None)):.3f}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
