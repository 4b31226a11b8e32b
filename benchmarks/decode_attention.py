"""The CPU decode attention kernel alone, per layer, over batches whose rows differ in length.

A decode step's attention reads every row's keys and values from pages anywhere in the pool.
This calls the kernel (`decode_attention` of the CPU extension, as the decode stack does)
on a bfloat16 pool shaped like the embedded SmolLM2's layer (9 query heads, 3 kv heads,
head_dim 64, 16-token pages, pages in random order), once per layer of 30 layers each with
its own pages, so each call finds its keys and values in memory, not in cache, as inside a
step. Batches of equal rows and of mixed ones (one long row beside short ones, two long
ones, one very long one): the threads' split of the work shows in the mixed rows. Reports
the median time per layer over the rounds and the rate it reads the KV at.

    python benchmarks/decode_attention.py [--rounds 40] [--out benchmarks/results/decode_attention.md]

Compare two builds with benchmarks/before_after.py (its --bench runs this in each tree).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30
BATCHES = {
    "8 rows of 300": [300] * 8,
    "16 rows of 300": [300] * 16,
    "1 row of 2000, 7 of 300": [2000] + [300] * 7,
    "6 rows of 100, 2 of 1200": [100] * 6 + [1200] * 2,
    "1 row of 4000, 1 of 64": [4000, 64],
}


def time_batch(kernels, lens: list[int], rounds: int, gen: torch.Generator) -> tuple[float, float]:
    """(median, min) microseconds per layer call."""
    pages_per_row = max(-(-n // PAGE) for n in lens)
    pages = len(lens) * pages_per_row
    k = torch.randn(LAYERS, pages + 1, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    v = torch.randn(LAYERS, pages + 1, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    table = (torch.randperm(pages, generator=gen) + 1).reshape(len(lens), -1).to(torch.int32).contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    for layer in range(LAYERS):  # untimed: first touch of every page
        kernels.decode_attention(q, k[layer], v[layer], table, seq_lens, scale)
    per_layer = []
    for _ in range(rounds):
        t = time.perf_counter()
        for layer in range(LAYERS):
            kernels.decode_attention(q, k[layer], v[layer], table, seq_lens, scale)
        per_layer.append((time.perf_counter() - t) / LAYERS * 1e6)
    return statistics.median(per_layer), min(per_layer)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="timed passes over the 30 layers per batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_attention.md")
    args = ap.parse_args(argv)
    from preheat.engine.kernels import cpu_ext

    kernels = cpu_ext.load()
    if kernels is None:
        raise SystemExit("the CPU kernels do not run here (see cpu_ext.choose_isa)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, lens in BATCHES.items():
        median, best = time_batch(kernels, lens, args.rounds, gen)
        kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2  # keys and values, bf16
        rows.append(f"| {name} | {sum(lens)} | {median:.0f} | {best:.0f} | {kv_bytes / median / 1e3:.1f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "## CPU decode attention per layer, equal and mixed rows",
        "",
        f"Written by `benchmarks/decode_attention.py`: SmolLM2-135M's layer shape ({HEADS} query heads, "
        f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}), bfloat16 KV in {PAGE}-token pages in random order, "
        f"{LAYERS} layers with their own pages called in turn (the KV comes from memory), {args.threads} threads, "
        f"{args.rounds} passes; the {getattr(kernels, 'isa', '?')} build of the kernels; {platform.machine()}, "
        f"{os.cpu_count()} CPUs.",
        "",
        "| batch | tokens | us per layer (median) | us (min) | KV read GB/s (median) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"1-minute load average at the end: {os.getloadavg()[0]:.2f}.",
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
