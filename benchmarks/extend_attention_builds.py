"""Prompt-chunk attention on every build and dtype: the CPU extend kernels against the PyTorch
path they replace (each sequence's context gathered from the pages, then SDPA), side by side
in one process per machine.

- the kernel alone: one layer's call for a 512-token chunk, with nothing cached and after
  1,536 cached tokens, at SmolLM2's heads (9 query heads, 3 kv heads, head_dim 64) and a
  Llama-8B-like layer's (32, 8, 128); bfloat16 and float32 (and both over an fp8 e4m3 pool);
- the engine: a 2,048-token prompt through SmolLM2 (the embedded GGUF dequantised, 512-token
  chunks, so later chunks attend to up to 2,048 keys), TTFT with the kernel against the same
  engine with prompt chunks sent down the PyTorch path (`long_extend_eligible` answering no),
  alternating by round.

Machines (benchmarks/cpu_builds.py's): this one as it is, and an AVX2-only CPU **emulated**
on it (PREHEAT_CPU_KERNELS=avx2 and PyTorch's, oneDNN's and MKL's AVX2 code; that CPU's clock
and memory are not emulated). The AVX-512 build hands float32 queries to the AVX2 build's
kernel. Writes benchmarks/results/extend_attention_builds.md.

    python benchmarks/extend_attention_builds.py [--rounds 3] [--machines native avx2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_builds import AVX2_MACHINE, add_machine_options, native_cpu, on_machines

RESULTS = Path(__file__).parent / "results"
SHAPES = {"SmolLM2 (9 / 3 heads, 64)": (9, 3, 64), "Llama-8B-like (32 / 8 heads, 128)": (32, 8, 128)}
CHUNK, PREFIXES = 512, (0, 1536)
PROMPT_TOKENS = 2048


def lower_quartile(f, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 4]


def kernel_rows(rounds: int) -> list[dict]:
    """One layer's call on the kernel and on the PyTorch path, same inputs, alternating."""
    import torch

    from preheat.engine.kernels import cpu_ext, kv_fp8, reference

    kernels = cpu_ext.load()
    torch.manual_seed(0)
    rows = []
    for shape, (heads, kvh, hd) in SHAPES.items():
        for prefix in PREFIXES:
            total = prefix + CHUNK
            pages = -(-total // 16)
            perm = (torch.randperm(pages + 2)[:pages] + 1).to(torch.int32)
            table = perm.view(1, -1)
            for cache in ("bfloat16", "float32", "bfloat16, fp8 e4m3 pages", "float32, fp8 e4m3 pages"):
                dtype = getattr(torch, cache.split(",")[0])
                kv = torch.randn((2, pages + 3, 16, kvh, hd)).to(dtype)
                k_cache, v_cache = kv[0], kv[1]
                if "fp8" in cache:
                    k8, v8 = (torch.empty(c.shape, dtype=torch.float8_e4m3fn) for c in (k_cache, v_cache))
                    for full, c8 in ((k_cache, k8), (v_cache, v8)):
                        c8.kv_scale = torch.tensor([0.25])
                        c8.copy_(kv_fp8.store(full.float(), c8))
                    k_cache, v_cache = k8, v8
                q = torch.randn((CHUNK, heads, hd)).to(dtype)
                pre, ext = torch.tensor([prefix], dtype=torch.int32), torch.tensor([CHUNK], dtype=torch.int32)
                ks, vs = kv_fp8.scale_value(k_cache), kv_fp8.scale_value(v_cache)

                on_kernel = functools.partial(kernels.extend_attention, q, k_cache, v_cache, table, pre, ext,
                                              hd**-0.5, ks, vs)  # fmt: skip
                on_pytorch = functools.partial(reference.extend_attention, q, k_cache, v_cache, table, [prefix],
                                               [CHUNK], hd**-0.5)  # fmt: skip
                on_kernel(), on_pytorch()
                kt, pt = [], []
                for _ in range(rounds):
                    kt.append(lower_quartile(on_kernel, 8))
                    pt.append(lower_quartile(on_pytorch, 8))
                rows.append(dict(shape=shape, prefix=prefix, cache=cache, kernel_ms=statistics.median(kt) * 1e3,
                                 pytorch_ms=statistics.median(pt) * 1e3))  # fmt: skip
    return rows


def engine_rows(rounds: int) -> list[dict]:
    """TTFT of a 2,048-token prompt with prompt chunks on the kernel and on the PyTorch path."""
    from preheat.engine import SamplingParams
    from preheat.engine.config import EngineConfig
    from preheat.engine.engine import Engine
    from preheat.engine.kernels import backend, cpu_attention

    real = cpu_attention.long_extend_eligible
    rows = []
    for dtype in ("bfloat16", "float32"):
        os.environ[backend.ENV_OVERRIDE] = "cpu"  # refuse a silent fallback to the reference backend
        try:
            engine = Engine(EngineConfig(dtype=dtype, max_total_tokens=8192, quantization="none",
                                         chunked_prefill_size=CHUNK))  # fmt: skip
        finally:
            os.environ.pop(backend.ENV_OVERRIDE)
        if engine.weight_move is not None:
            engine.weight_move.finish()
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        times: dict[str, list[float]] = {"kernel": [], "pytorch": []}
        for r in range(rounds + 1):  # the first round warms both up and is not counted
            for side in ("kernel", "pytorch"):
                cpu_attention.long_extend_eligible = real if side == "kernel" else (lambda *a: False)
                try:
                    engine.radix.reset()
                    ids = [(i * 7919 + 31 * r + (side == "pytorch")) % 30000 + 100 for i in range(PROMPT_TOKENS)]
                    t = time.perf_counter()
                    engine.add_request(ids, params)
                    while engine.has_unfinished():
                        engine.step()
                    if r:
                        times[side].append(time.perf_counter() - t)
                finally:
                    cpu_attention.long_extend_eligible = real
        rows.append(dict(dtype=dtype, kernel_s=statistics.median(times["kernel"]),
                         pytorch_s=statistics.median(times["pytorch"])))  # fmt: skip
        del engine
    return rows


def table_rows(results: dict[str, dict], section: str, keys: tuple[str, ...], kernel: str, pytorch: str) -> list[str]:
    """One table line per machine and row of `section`: its keys, both times and their ratio."""
    return [
        f"| {machine} | {res['isa']} | " + " | ".join(str(r[k]) for k in keys)
        + f" | {r[kernel]:.2f} | {r[pytorch]:.2f} | {r[kernel] / r[pytorch]:.2f}x |"
        for machine, res in results.items()
        for r in res[section]
    ]


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [
        "# Prompt-chunk attention on every build: the extend kernels against the PyTorch path",
        "",
        f"Written by `benchmarks/extend_attention_builds.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{args.rounds} rounds per cell, kernel and PyTorch path alternating; medians. `native` is this machine "
        f"({native_cpu()}); `avx2` an AVX2-only CPU **emulated** on it (a stand-in: "
        + ", ".join(f"`{k}={v}`" for k, v in AVX2_MACHINE.items())
        + "; its clock and memory are this machine's). The PyTorch path is what ran before a build had the "
        "kernel: each sequence's context gathered from the pages, then SDPA (engine/kernels/reference.py). "
        "On the native machine bfloat16 runs extend_attention_avx512.cpp, float32 the AVX2 build's kernel "
        "(extend_attention_avx2.cpp), which the AVX-512 build hands float32 queries.",
        "",
        f"## One layer's call: a {CHUNK}-token chunk (ms, lower quartile of 8 calls)",
        "",
        "| machine | kernels | shape | cached tokens | queries, pages | kernel | PyTorch path | kernel / PyTorch |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    lines += table_rows(results, "kernel", ("shape", "prefix", "cache"), "kernel_ms", "pytorch_ms")
    lines += [
        "",
        f"## The engine: a {PROMPT_TOKENS}-token prompt (SmolLM2, {CHUNK}-token chunks), time to its first token",
        "",
        "| machine | kernels | dtype | with the kernel s | with the PyTorch path s | kernel / PyTorch |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    lines += table_rows(results, "engine", ("dtype",), "kernel_s", "pytorch_s")
    lines += ["", f"1-minute load average at the end: {os.getloadavg()[0]:.2f} (2 cores, shared VM)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "extend_attention_builds.md"))
    add_machine_options(ap)
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.child:
        from preheat.engine.kernels import cpu_ext

        rows = dict(isa=cpu_ext.load().isa, kernel=kernel_rows(args.rounds), engine=engine_rows(args.rounds))
        print("ROWS " + json.dumps(rows))
        return 0
    results = on_machines(__file__, ["--rounds", str(args.rounds)], args.machines)
    text = report(results, args)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
