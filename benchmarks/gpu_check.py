#!/usr/bin/env python
"""GPU check: parity and speed of the GPU path, in one go. Writes benchmarks/results/gpu.md.

    .venv/bin/python benchmarks/gpu_check.py            # on a CUDA machine (an H200 is the target)
    .venv/bin/python benchmarks/gpu_check.py --quick    # fewer tokens, for a short device lease
    .venv/bin/python benchmarks/gpu_check.py --smoke-cpu --out /tmp/gpu.md
        # no GPU: runs the model steps on CPU with tiny counts to check this script's plumbing

Needs a CUDA build of torch, Triton, and Preheat installed with the embedded default model
(scripts/setup, then `pip install torch` for CUDA if the venv holds the CPU build).

What it checks, each step in its own subprocess because the attention backend is chosen once
per process (PREHEAT_ATTENTION_BACKEND selects it):
 1. kernels: compiled Triton decode attention and KV write vs the PyTorch reference on the
    GPU, at the default model's shapes (9 query heads, 3 KV heads, head dim 64) and GQA 4/8,
    bf16 and fp16, plus the fp8_e4m3 store and read; the MoE experts' grouped GEMM vs the
    torch grouped path at Qwen3-30B-A3B expert shapes (error, capture in a CUDA graph with
    the routing changed between replays, time per layer);
 2. model parity, greedy, default model (SmolLM2-135M-Instruct):
      reference attention, eager    vs  Triton attention, eager        (kernels agree)
      Triton, eager                 vs  Triton, CUDA graphs            (graphs agree)
    in float32 (expected identical) and bfloat16 (reported: a near-tie between two logits may
    flip under different kernel or GEMM shapes, so bf16 mismatches are shown, not failed);
    and fp8 KV (reported: agreement with the bf16 run);
 3. decode tokens/s at batch 1, 8, 32, eager vs graphs (bf16), and graph capture time.

Decode tokens/s = batch * (N - 1) / (time for N new tokens - time for 1 new token): the
prefill and the first token are subtracted out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu.md"
TOPICS = [
    "the sea", "a lighthouse keeper", "prime numbers", "bread", "a lost key", "Mars", "autumn",
    "a robot learning to paint", "the history of tea", "a chess game", "rain in a city",
    "a mountain village", "photosynthesis", "an old violin", "a train at night", "bees",
    "the moon landing", "a library", "volcanoes", "a river", "a desert caravan", "snow",
    "a market at dawn", "the internet", "a clockmaker", "whales", "a garden", "thunder",
    "a first day at school", "glaciers", "a bakery", "the northern lights",
]
PROMPTS = [f"Write a short paragraph about {t}." for t in TOPICS]
BATCHES = (1, 8, 32)


# --- child steps (each runs in a fresh process) -------------------------------------------


def child_kernels(_: dict) -> dict:
    import math

    import torch

    from preheat.engine.kernels import kv_fp8, reference, triton_attention, triton_kv

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def case(name, heads, kvh, hd, page_size, seq_lens, dtype, fp8=False):
        num_pages = sum(math.ceil(n / page_size) for n in seq_lens) + 7
        shape = (num_pages, page_size, kvh, hd)
        k_cache = torch.randn(shape, device=dev, generator=gen).to(dtype)
        v_cache = torch.randn(shape, device=dev, generator=gen).to(dtype)
        perm = (torch.randperm(num_pages - 1, device=dev, generator=gen) + 1).tolist()
        width = max(math.ceil(n / page_size) for n in seq_lens)
        table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=dev)
        for i, n in enumerate(seq_lens):
            for j in range(math.ceil(n / page_size)):
                table[i, j] = perm.pop()
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        q = torch.randn(len(seq_lens), heads, hd, device=dev, generator=gen).to(dtype)
        kw = {}
        kr, vr = k_cache.float(), v_cache.float()
        if fp8:
            ks, vs = kv_fp8.calibrated_scale(k_cache), kv_fp8.calibrated_scale(v_cache)
            k8, v8 = kv_fp8.quantize_fp8(k_cache, ks), kv_fp8.quantize_fp8(v_cache, vs)
            kr, vr = kv_fp8.dequantize_fp8(k8, ks, torch.float32), kv_fp8.dequantize_fp8(v8, vs, torch.float32)
            k_cache, v_cache, kw = k8, v8, {"k_scale": ks, "v_scale": vs}
        want = reference.decode_attention(q.float(), kr, vr, table, lens, hd**-0.5)
        got = triton_attention.decode_attention(q, k_cache, v_cache, table, lens, hd**-0.5, **kw)
        err = (got.float() - want).abs().max().item()
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * max(
            1.0, want.abs().max().item()
        )
        rows.append({"case": name, "max_abs_err": err, "tolerance": tol, "ok": err <= tol})

    lens = [1, 17, 100, 513, 2048, 4000]
    case("decode smollm2 9q/3kv hd64 bf16", 9, 3, 64, 16, lens, torch.bfloat16)
    case("decode smollm2 9q/3kv hd64 fp16", 9, 3, 64, 16, lens, torch.float16)
    case("decode gqa1 8q/8kv hd128 bf16", 8, 8, 128, 16, lens, torch.bfloat16)
    case("decode gqa4 32q/8kv hd128 bf16 page 5", 32, 8, 128, 5, lens, torch.bfloat16)
    case("decode gqa8 64q/8kv hd128 bf16 page 64", 64, 8, 128, 64, lens, torch.bfloat16)
    case("decode fp8 cache 9q/3kv hd64", 9, 3, 64, 16, lens, torch.float32, fp8=True)

    # KV write: bit for bit, model dtype and fp8.
    for dtype in (torch.bfloat16, kv_fp8.FP8_DTYPE):
        k_ref = torch.zeros(64, 16, 3, 64, dtype=dtype, device=dev)
        v_ref, k_got, v_got = k_ref.clone(), k_ref.clone(), k_ref.clone()
        k = torch.randn(200, 3, 64, device=dev, generator=gen).to(torch.bfloat16)
        v = torch.randn(200, 3, 64, device=dev, generator=gen).to(torch.bfloat16)
        slots = torch.randperm(64 * 16, device=dev, generator=gen)[:200]
        if dtype == kv_fp8.FP8_DTYPE:
            s = torch.full((1,), 0.01, device=dev)
            kv_fp8.write_kv_fp8_reference(k_ref, v_ref, k, v, slots, s, s)
            triton_kv.write_kv(k_got, v_got, k, v, slots, k_scale=s, v_scale=s)
        else:
            reference.write_kv(k_ref, v_ref, k, v, slots)
            triton_kv.write_kv(k_got, v_got, k, v, slots)
        same = torch.equal(k_ref.view(torch.uint8), k_got.view(torch.uint8)) and torch.equal(
            v_ref.view(torch.uint8), v_got.view(torch.uint8)
        )
        rows.append({"case": f"write_kv {str(dtype).removeprefix('torch.')}", "max_abs_err": 0.0 if same else float("nan"),
                     "tolerance": 0.0, "ok": same})
    moe_rows, moe_timing = _moe_kernel_checks(dev, gen)
    return {"kernels": rows + moe_rows, "moe_timing": moe_timing}


def _moe_kernel_checks(dev, gen, experts=128, top_k=8, hidden=2048, inter=768,
                       graphs=True) -> tuple[list[dict], list[dict]]:
    """Triton grouped-GEMM experts vs the torch grouped path at Qwen3-30B-A3B's expert shapes
    (128 experts, top-8, hidden 2048, width 768): error, CUDA-graph capture with the routing
    changed between replays, and milliseconds per layer (median of 20, same process)."""
    import torch

    from preheat.engine.kernels.triton_moe import fused_experts
    from preheat.engine.model.moe import grouped_experts_torch, select_experts

    rows, timing = [], []

    def inputs(tokens, dtype):
        x = torch.randn(tokens, hidden, device=dev, generator=gen).to(dtype)
        logits = torch.randn(tokens, experts, device=dev, generator=gen).to(dtype)
        return (x, *select_experts(logits, top_k, renormalize=True))

    def ms(fn, *a):
        times = []
        for _ in range(23):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(*a)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1000)
        return sorted(times[3:])[len(times[3:]) // 2]

    for dtype in (torch.float32, torch.bfloat16):
        w13 = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen) * 0.02).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=dev, generator=gen) * 0.02).to(dtype)
        name = str(dtype).removeprefix("torch.")
        for tokens in (1, 16, 512):
            x, w, ids = inputs(tokens, dtype)
            want = grouped_experts_torch(x.float(), w13.float(), w2.float(), w.float(), ids)
            got = fused_experts(x, w13, w2, w, ids).float()
            err = (got - want).abs().max().item()
            tol = (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, want.abs().max().item())
            rows.append({"case": f"moe experts {name} T={tokens}", "max_abs_err": err, "tolerance": tol,
                         "ok": err <= tol})
            timing.append({"dtype": name, "tokens": tokens, "torch_ms": ms(grouped_experts_torch, x, w13, w2, w, ids),
                           "triton_ms": ms(fused_experts, x, w13, w2, w, ids)})
        if not graphs:
            continue
        # Captured once, replayed with other routing: the layout must come from the device.
        x, w, ids = inputs(8, dtype)
        fused_experts(x, w13, w2, w, ids)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(x, w13, w2, w, ids)
        x2, w_new, ids_new = inputs(8, dtype)
        x.copy_(x2)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        eager = fused_experts(x, w13, w2, w, ids)
        err = (out.float() - eager.float()).abs().max().item()
        rows.append({"case": f"moe experts {name} CUDA graph, new routing on replay", "max_abs_err": err,
                     "tolerance": 0.0, "ok": err == 0.0})
    return rows, timing


def _graph_runner(llm):
    """The engine's CudaGraphRunner, wherever the engine keeps it (None when eager)."""
    from preheat.engine.cuda_graph import CudaGraphRunner

    runner = getattr(getattr(llm.engine, "runner", None), "graph_runner", None)
    if isinstance(runner, CudaGraphRunner):
        return runner
    for obj in vars(llm.engine).values():  # fallback: one level down
        for value in getattr(obj, "__dict__", {}).values():
            if isinstance(value, CudaGraphRunner):
                return value
    return None


def child_model(spec: dict) -> dict:
    import torch

    from preheat.engine import LLM, SamplingParams

    kwargs = dict(dtype=spec["dtype"], disable_cuda_graph=not spec["graphs"],
                  cuda_graph_max_bs=32, kv_cache_dtype=spec.get("kv", "auto"))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    llm = LLM(model=None, **kwargs)
    sync()
    load = time.perf_counter() - t0
    runner = _graph_runner(llm)
    out = {
        "load_seconds": load,
        "attention_backend": getattr(llm.engine, "attention_backend", "?"),
        "capture_seconds": getattr(runner, "capture_seconds", None),
        "captured_batch_sizes": getattr(runner, "batch_sizes", []),
        "graph_eager_reason": getattr(runner, "eager_reason", "no CudaGraphRunner found"),
    }
    greedy = SamplingParams(max_tokens=spec["parity_tokens"], temperature=0.0, ignore_eos=True)
    out["tokens"] = [r.token_ids for r in llm.generate(PROMPTS[: spec["parity_prompts"]], greedy)]
    if spec.get("timing"):
        n = spec["timing_tokens"]
        rates = {}
        for bs in spec["batches"]:
            prompts = PROMPTS[:bs]
            llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            times = {}
            for tokens in (1, n):
                params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
                sync()
                t = time.perf_counter()
                llm.generate(prompts, params)
                sync()
                times[tokens] = time.perf_counter() - t
            rates[str(bs)] = bs * (n - 1) / max(1e-9, times[n] - times[1])
        out["decode_tokens_per_s"] = rates
    return out


def run_child(step: str, spec: dict, backend: str | None, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if backend:
        env["PREHEAT_ATTENTION_BACKEND"] = backend
    cmd = [sys.executable, __file__, "--child", step, "--spec", json.dumps(spec)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["wall_seconds"] = time.perf_counter() - t
            return result
    return {"error": f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-1500:]}


# --- comparison and report (pure) ---------------------------------------------------------


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences match exactly, and the first token index where each pair differs."""
    diverge = []
    for x, y in zip(a, b):
        first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if first is None and len(x) != len(y):
            first = min(len(x), len(y))
        diverge.append(first)
    return {"match": sum(d is None for d in diverge), "total": len(diverge),
            "first_divergence": [d for d in diverge if d is not None]}


def parity_line(name: str, a: dict, b: dict, strict: bool) -> tuple[str, bool]:
    if "error" in a or "error" in b:
        return f"| {name} | not run (a step failed, see below) | FAIL |", False
    c = compare(a["tokens"], b["tokens"])
    ok = c["match"] == c["total"]
    verdict = "PASS" if ok else ("FAIL" if strict else "report")
    detail = f"{c['match']}/{c['total']} identical"
    if c["first_divergence"]:
        detail += f"; first divergences at tokens {c['first_divergence']}"
    return f"| {name} | {detail} | {verdict} |", ok or not strict


def render(env: dict, kernels: dict, models: dict, args: argparse.Namespace) -> tuple[str, bool]:
    ok = True
    lines = [
        "# GPU check",
        "",
        f"Written by `benchmarks/gpu_check.py{' --quick' if args.quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| | |", "| --- | --- |",
    ] + [f"| {k} | {v} |" for k, v in env.items()] + ["", "## Kernels: compiled Triton vs PyTorch reference", ""]
    if "error" in kernels:
        lines += ["```", kernels["error"].strip(), "```"]
        ok = False
    else:
        lines += ["| case | max abs error | tolerance | |", "| --- | --- | --- | --- |"]
        for r in kernels["kernels"]:
            lines.append(f"| {r['case']} | {r['max_abs_err']:.3g} | {r['tolerance']:.3g} | "
                         f"{'PASS' if r['ok'] else 'FAIL'} |")
            ok &= r["ok"]
    if kernels.get("moe_timing"):
        lines += ["", "## MoE experts: Triton grouped GEMM vs torch grouped path (one layer, ms, median)", "",
                  "| dtype | tokens | torch ms | Triton ms | speed-up |", "| --- | --- | --- | --- | --- |"]
        for t in kernels["moe_timing"]:
            lines.append(f"| {t['dtype']} | {t['tokens']} | {t['torch_ms']:.3f} | {t['triton_ms']:.3f} | "
                         f"{t['torch_ms'] / t['triton_ms']:.2f}x |")
    lines += ["", f"## Greedy parity on the default model ({args.parity_prompts} prompts x "
              f"{args.parity_tokens} tokens)", "", "| comparison | result | |", "| --- | --- | --- |"]
    pairs = [
        ("fp32: reference eager vs Triton eager", "fp32-torch-eager", "fp32-triton-eager", True),
        ("fp32: Triton eager vs Triton graphs", "fp32-triton-eager", "fp32-triton-graphs", True),
        ("bf16: reference eager vs Triton eager", "bf16-torch-eager", "bf16-triton-eager", False),
        ("bf16: Triton eager vs Triton graphs", "bf16-triton-eager", "bf16-triton-graphs", False),
        ("bf16 graphs: fp8_e4m3 KV vs bf16 KV", "bf16-triton-graphs", "bf16-fp8kv-graphs", False),
    ]
    for name, a, b, strict in pairs:
        line, good = parity_line(name, models[a], models[b], strict)
        lines.append(line)
        ok &= good
    lines += ["", "PASS/FAIL rows must match exactly; 'report' rows are bf16/fp8, where a near-tie "
              "between two logits may legitimately flip.", "",
              "## Decode throughput (bf16, default model)", "",
              f"Tokens/s of decode only ({args.timing_tokens} new tokens per sequence, prefill "
              "and first token subtracted).", "",
              "| batch | eager tok/s | CUDA graphs tok/s | speed-up |", "| --- | --- | --- | --- |"]
    eager, graphs = models["bf16-triton-eager"], models["bf16-triton-graphs"]
    for bs in args.batches:
        e = eager.get("decode_tokens_per_s", {}).get(str(bs))
        g = graphs.get("decode_tokens_per_s", {}).get(str(bs))
        ratio = f"{g / e:.2f}x" if e and g else "-"
        lines.append(f"| {bs} | {e:.0f} | {g:.0f} | {ratio} |" if e and g else f"| {bs} | {e} | {g} | - |")
    lines += ["", "## Start-up", "", "| run | load + capture s | capture s | captured sizes | graphs off because |",
              "| --- | --- | --- | --- | --- |"]
    for name, r in models.items():
        if "error" in r:
            continue
        cap = r.get("capture_seconds")
        lines.append(f"| {name} | {r['load_seconds']:.1f} | {'-' if cap is None else f'{cap:.2f}'} | "
                     f"{','.join(map(str, r.get('captured_batch_sizes') or [])) or '-'} | "
                     f"{r.get('graph_eager_reason') or '-'} |")
    backends = {name: r.get("attention_backend") for name, r in models.items() if "error" not in r}
    lines += ["", f"Attention backend per run: `{json.dumps(backends)}`"]
    errors = {name: r["error"] for name, r in models.items() if "error" in r}
    if errors:
        ok = False
        lines += ["", "## Failed steps", ""]
        for name, err in errors.items():
            lines += [f"### {name}", "", "```", err, "```"]
    lines += ["", f"**Overall: {'PASS' if ok else 'FAIL'}**", ""]
    return "\n".join(lines), ok


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda (torch)": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="no GPU: check this script's plumbing on CPU (tiny counts, no kernels, no fp8)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        try:
            fn = {"kernels": child_kernels, "model": child_model}[args.child]
            result = fn(json.loads(args.spec or "{}"))
        except Exception:
            result = {"error": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    args.parity_prompts, args.parity_tokens, args.timing_tokens = (
        (2, 4, 4) if args.smoke_cpu else (4, 32, 64) if args.quick else (8, 64, 128)
    )
    args.batches = (1, 2) if args.smoke_cpu else BATCHES
    timeout = 240 if args.quick else 600
    env = environment()
    print("gpu_check:", env, flush=True)
    if args.smoke_cpu:
        kernels = {"error": "CPU smoke run: kernels not compiled (tests/kernels covers them under the interpreter)"}
    else:
        kernels = run_child("kernels", {}, "triton", timeout)
    print("kernels:", "error" if "error" in kernels else "done", flush=True)
    base = {"parity_prompts": args.parity_prompts, "parity_tokens": args.parity_tokens,
            "timing_tokens": args.timing_tokens, "batches": list(args.batches)}
    runs = {
        "fp32-torch-eager": ("torch", dict(dtype="float32", graphs=False)),
        "fp32-triton-eager": ("triton", dict(dtype="float32", graphs=False)),
        "fp32-triton-graphs": ("triton", dict(dtype="float32", graphs=True)),
        "bf16-torch-eager": ("torch", dict(dtype="bfloat16", graphs=False)),
        "bf16-triton-eager": ("triton", dict(dtype="bfloat16", graphs=False, timing=True)),
        "bf16-triton-graphs": ("triton", dict(dtype="bfloat16", graphs=True, timing=True)),
        "bf16-fp8kv-graphs": ("triton", dict(dtype="bfloat16", graphs=True, kv="fp8_e4m3")),
    }
    if args.smoke_cpu:  # on CPU: reference attention only, graphs off by necessity, no fp8
        runs = {k: ("torch", {**spec, "kv": "auto"}) for k, (_, spec) in runs.items()}
    models = {}
    for name, (backend, spec) in runs.items():
        models[name] = run_child("model", {**base, **spec}, backend, timeout)
        print(f"{name}:", "error" if "error" in models[name] else
              f"done in {models[name]['wall_seconds']:.0f} s", flush=True)
    text, ok = render(env, kernels, models, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
