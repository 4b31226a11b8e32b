"""This CPU's rate of 512-bit dot-product instructions, and the floor it sets on a decode
step's multiply-adds beside the memory floor (benchmarks/bandwidth.py).

At batch 1 a decode step reads every weight once and does one multiply-add per weight: the
memory sets its floor. At batch 8 it does eight per weight read, and the instruction that
does them decides whether it still can: vdpbf16ps (bf16 weights and activations, 32
multiply-adds: 16 lanes x a pair), vpdpwssd (int8 / 4-bit codes against 16-bit activation
codes, the default: 32) or vpdpbusd (8-bit activation codes, --int8-activation-bits 8: 64).
Measured here: each instruction on 16 independent accumulators held in registers (no
dependency stalls, no memory), on every thread at once for a fixed count, instructions per
second; then each format's multiply-adds per step (rows x the model's weights, attention left
out) over that rate, against the memory floor and issue 28's goal of 1.5x it.

    python benchmarks/dot_product_rate.py [--threads N]   # writes benchmarks/results/dot_product_rate.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bandwidth  # benchmarks/bandwidth.py, beside this file

RESULTS = Path(__file__).resolve().parent / "results"

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <thread>
#include <vector>

// One kind of instruction on ACC independent accumulators, one register each: unrolled so
// that no accumulator lives in memory (an earlier version kept them in an array the
// compiler stored to the stack every iteration, and measured the stores: ~3 G/s a core
// where this CPU issues ~8). No memory operand, no dependency stall.
constexpr int ACC = 16;
template <int KIND>
static double run_one(long count) {
  __m512i acc[ACC];
  const __m512i a = _mm512_set1_epi32(0x3f803f80), b = _mm512_set1_epi32(0x00010001);
  // Different starting values the compiler cannot see through: identical accumulators
  // were folded into one chain (one instruction an iteration, bound by its latency).
#pragma GCC unroll 16
  for (int i = 0; i < ACC; ++i) {
    acc[i] = _mm512_set1_epi32(i);
    asm volatile("" : "+v"(acc[i]));
  }
  for (long it = 0; it < count / ACC; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < ACC; ++i) {
      if (KIND == 0) acc[i] = _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(acc[i]), (__m512bh)a, (__m512bh)a));
      if (KIND == 1) acc[i] = _mm512_dpwssd_epi32(acc[i], b, b);
      if (KIND == 2) acc[i] = _mm512_dpbusd_epi32(acc[i], b, b);
      // Two kinds interleaved, half the accumulators each: whether the CPU runs them on
      // different pipes at once (then the pair issues faster than either alone).
      if (KIND == 3) acc[i] = i % 2 ? _mm512_dpwssd_epi32(acc[i], b, b)
                                    : _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(acc[i]), (__m512bh)a, (__m512bh)a));
      if (KIND == 4) acc[i] = i % 2 ? _mm512_dpwssd_epi32(acc[i], b, b)
                                    : _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(acc[i]), _mm512_castsi512_ps(a), _mm512_castsi512_ps(a)));
    }
  }
  double sink = 0;
#pragma GCC unroll 16
  for (int i = 0; i < ACC; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  return sink;
}

// Instructions per second of one kind (0 vdpbf16ps, 1 vpdpwssd, 2 vpdpbusd; 3 vpdpwssd and
// vdpbf16ps, 4 vpdpwssd and vfmadd231ps, interleaved) summed over `threads` threads running
// at once, `count` each.
double dot_rate(int64_t kind, int64_t threads, int64_t count) {
  std::vector<std::thread> pool;
  std::vector<double> sinks(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      sinks[t] = kind == 0   ? run_one<0>(count)
                 : kind == 1 ? run_one<1>(count)
                 : kind == 2 ? run_one<2>(count)
                 : kind == 3 ? run_one<3>(count)
                             : run_one<4>(count);
    });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sinks[0] == -1.0 ? 0.0 : (double)count * threads / s;
}
"""

INSTRUCTIONS = [  # (name, multiply-adds per instruction, what uses it)
    ("vdpbf16ps", 32, "bf16"),
    ("vpdpwssd", 32, "int8 / 4-bit codes, 16-bit activation codes (default)"),
    ("vpdpbusd", 64, "int8 / 4-bit codes, 8-bit activation codes"),
]

PAIRS = [  # (kernel kind, the two instructions interleaved, what running them at once would allow)
    (3, ("vpdpwssd", "vdpbf16ps"), "a product split between 16-bit codes and a bf16 panel"),
    (4, ("vpdpwssd", "vfmadd231ps"), "the int8 GEMM's float epilogue hidden under its dot products"),
]


@dataclass
class ModelFacts:
    weights: int  # multiply-adds per row: the matrices' weights, the LM head once
    bytes: dict[str, int]  # weight bytes a step reads, per format
    kv_bytes_per_token: int  # all layers' K and V of one token, bf16


def model_facts() -> ModelFacts:
    """The embedded model as decode_step.py builds its sides: bf16 (the GGUF dequantized),
    the GGUF's own blocks, and the bf16 checkpoint quantized to 8-bit codes."""
    from preheat.engine.kernels.linear import LinearWeight
    from preheat.engine.llm import LLM

    bf16 = LLM(max_num_seqs=4, max_total_tokens=2048, quantization="none").engine
    model = bf16.model
    weights = [w for layer in model.layers for part in (layer.attn, layer.mlp)
               for w in vars(part).values() if isinstance(w, LinearWeight)] + [model.lm_head]  # fmt: skip
    gguf = LLM(max_num_seqs=4, max_total_tokens=2048, quantization="int8").engine.model
    codes = LLM(model=bf16.hf_dir, max_num_seqs=4, max_total_tokens=2048, quantization="int8").engine.model
    spec = model.spec
    return ModelFacts(sum(w.out_features * w.in_features for w in weights),
                      {"bf16": model.step_weight_bytes, "gguf": gguf.step_weight_bytes, "codes": codes.step_weight_bytes},
                      spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2)  # fmt: skip


def run(threads: int, count: int, context: int) -> str:
    from torch.utils.cpp_extension import load_inline

    rates_gbps = [bandwidth.measure(threads).best]

    module = load_inline("preheat_dot_rate", cpp_sources=[SOURCE], functions=["dot_rate"],
                         extra_cflags=["-O2", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx512vnni"],
                         verbose=False)  # fmt: skip

    def best(kind: int, n: int) -> float:  # instructions per second, best of 3
        return max(module.dot_rate(kind, n, count) for _ in range(3))

    rates = {}
    for kind, (name, _, _) in enumerate(INSTRUCTIONS):
        module.dot_rate(kind, threads, count // 10)  # warm: clocks up
        rates[name] = best(kind, threads)
        rates[name + " (1 thread)"] = best(kind, 1)
    pair_rates = {}
    for kind, _, _ in PAIRS:
        module.dot_rate(kind, threads, count // 10)
        pair_rates[kind] = best(kind, threads)
    facts = model_facts()
    weights = facts.weights
    rates_gbps.append(bandwidth.measure(threads).best)
    gbps = max(rates_gbps)  # the fastest: the strictest memory floor (decode_step.py's choice)
    lines = [
        "## Dot-product rate and the compute floor of a decode step",
        "",
        f"Written by `benchmarks/dot_product_rate.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{bandwidth.cpu_model()}, {threads} threads, {os.cpu_count()} CPUs. Each instruction on 16 independent accumulators, no "
        f"memory, {count:,} per thread, best of 3.",
        "",
        "| instruction | multiply-adds | G instructions/s, 1 thread | G instructions/s, all threads | multiply-adds/s, all threads | used by |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, macs, use in INSTRUCTIONS:
        lines.append(f"| {name} | {macs} | {rates[name + ' (1 thread)'] / 1e9:.2f} | {rates[name] / 1e9:.2f} | "
                     f"{rates[name] * macs / 1e9:.0f} G | {use} |")  # fmt: skip
    lines += [
        "",
        "Two kinds interleaved on the same 16 accumulators (8 each), all threads: if the CPU ran them on "
        "different pipes, the pair would issue faster than vpdpwssd alone (up to 2x), and what the last "
        "column names would pay.",
        "",
        "| instructions | G instructions/s, all threads | x vpdpwssd alone | would allow |",
        "| --- | ---: | ---: | --- |",
    ]
    for kind, (first, second), use in PAIRS:
        lines.append(f"| {first} + {second} | {pair_rates[kind] / 1e9:.2f} | {pair_rates[kind] / rates['vpdpwssd']:.2f} | "
                     f"{use} |")  # fmt: skip
    lines += [
        "",
        f"The embedded model's matrices: {weights / 1e6:.1f} M weights (the LM head once); a step reads "
        f"{facts.bytes['bf16'] / 1e6:.0f} MB of them in bf16, {facts.bytes['codes'] / 1e6:.0f} MB as 8-bit "
        f"codes, {facts.bytes['gguf'] / 1e6:.0f} MB in the GGUF's own blocks, plus "
        f"{facts.kv_bytes_per_token / 1e3:.1f} kB of bf16 KV per token of context ({context} tokens a row "
        f"here, decode_step.py's mean). Memory rate: {gbps:.1f} GB/s, the faster of "
        + " and ".join(f"{g:.1f}" for g in rates_gbps)
        + " measured at the start and the end (bandwidth.py, best of copy / triad / read; on a shared VM "
        "it moves: ~50-80 GB/s on the AMD EPYC host, ~30 on the Xeon). Compute floor = rows x weights / the multiply-adds per second above (attention, "
        "norms and everything else left out: a floor below the real one); memory floor = (weight bytes + "
        "the batch's KV) / the rate, as decode_step.py counts it.",
        "",
        "| format | instruction | batch | compute floor ms | memory floor ms | 1.5x memory floor ms | compute / memory |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    formats = [("bf16", "vdpbf16ps", facts.bytes["bf16"]), ("int8 (8-bit codes)", "vpdpwssd", facts.bytes["codes"]),
               ("4-bit (GGUF blocks)", "vpdpwssd", facts.bytes["gguf"]),
               ("4-bit, 8-bit activation codes", "vpdpbusd", facts.bytes["gguf"])]  # fmt: skip
    macs = {name: m for name, m, _ in INSTRUCTIONS}
    beyond: list[str] = []  # cells whose multiply-adds alone take longer than 1.5x their memory floor
    for fmt, instr, nbytes in formats:
        for batch in (1, 8, 16):
            compute = batch * weights / (rates[instr] * macs[instr]) * 1e3
            memory = bandwidth.floor_ms(nbytes + batch * context * facts.kv_bytes_per_token, gbps)
            lines.append(f"| {fmt} | {instr} | {batch} | {compute:.2f} | {memory:.2f} | {1.5 * memory:.2f} | "
                         f"{compute / memory:.2f} |")  # fmt: skip
            if compute > 1.5 * memory:
                beyond.append(f"{fmt} at batch {batch}")
    lines += [
        "",
        "Where the compute floor alone passes 1.5x the memory floor, issue 28's goal for that cell cannot be "
        "met by any kernel on this CPU: the multiply-adds take longer than the goal allows. In this run: "
        + (", ".join(beyond) if beyond else "none; every cell's multiply-adds fit under its goal") + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--count", type=int, default=200_000_000, help="instructions per thread per measurement")
    ap.add_argument("--context", type=int, default=273, help="tokens of context per row (decode_step.py: 256 growing by 34)")
    ap.add_argument("--out", default=str(RESULTS / "dot_product_rate.md"))
    args = ap.parse_args()
    report = run(args.threads, args.count, args.context)
    Path(args.out).write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
