"""Every CPU, every dtype (issue 28 item 6): engine_vs_hf.py's multi-turn chat workload
(conversations sharing a system prompt, a reply per turn) for Preheat against transformers'
batched `generate` in the same dtype, bfloat16 and float32, on two machines:

- this machine as it is (its report line names its CPU features): Preheat's AVX-512 kernels;
- an AVX2-only CPU, **emulated** on this one (a stand-in: a child process with
  PREHEAT_CPU_KERNELS=avx2 for our kernels, ATEN_CPU_CAPABILITY=avx2 for PyTorch's own
  kernels, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 for its libraries, so
  every side runs the code an AVX2 CPU runs; that CPU's clock and memory are not emulated):
  Preheat's AVX2 kernels, and the PyTorch reference an AVX2 CPU ran before the AVX2 build.

Each machine is one process; in it the sides alternate per round and the cells are medians.
Writes benchmarks/results/cpu_builds.md (engine_vs_hf.md links it).

    python benchmarks/cpu_builds.py [--conversations 8] [--turns 3] [--max-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
AVX2_MACHINE = {
    "PREHEAT_CPU_KERNELS": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
MACHINES = {"native": {}, "avx2": AVX2_MACHINE}


def measure(args: argparse.Namespace) -> list[dict]:
    """In this process (one machine): rows of (dtype, side, gen tok/s per round)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    import engine_vs_hf

    from preheat.engine.config import EngineConfig
    from preheat.engine.engine import Engine
    from preheat.engine.kernels import backend

    def make_engine(name: str, dtype: str) -> Engine:
        os.environ[backend.ENV_OVERRIDE] = name  # "cpu": refuse a silent fallback to the reference
        try:
            engine = Engine(EngineConfig(dtype=dtype, max_total_tokens=32768, max_num_seqs=64, quantization="none"))
            if engine.weight_move is not None:  # the weights in huge pages, as a server has them
                engine.weight_move.finish()
            return engine
        finally:
            os.environ.pop(backend.ENV_OVERRIDE)

    n, turns, max_tokens = args.conversations, args.turns, args.max_tokens
    rows = []
    for dtype in args.dtypes:
        engines = {name: make_engine(name, dtype) for name in ("cpu", "torch")}
        isa = engines["cpu"].model.layers[0].attn.backend.kernels.isa
        first = engines["cpu"]
        hf = AutoModelForCausalLM.from_pretrained(first.hf_dir, dtype=getattr(torch, dtype))
        hf.eval()
        for engine in engines.values():  # a short warm-up each: no side pays one-time costs inside
            engine_vs_hf.run_preheat(engine, 2, 1, 4)
        engine_vs_hf.run_transformers(hf, first.tokenizer, 2, 1, 4)
        runs: dict[str, list[dict]] = {"cpu": [], "torch": [], "hf": []}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                engine.radix.reset()
                r = engine_vs_hf.run_preheat(engine, n, turns, max_tokens)
                runs[name].append(engine_vs_hf.summarise(name, r, turns))
            r = engine_vs_hf.run_transformers(hf, first.tokenizer, n, turns, max_tokens)
            runs["hf"].append(engine_vs_hf.summarise("hf", r, turns))
        for name, side in (("cpu", f"{isa} kernels"), ("torch", "PyTorch reference (no kernels)"),
                           ("hf", "transformers generate (batched)")):  # fmt: skip
            rows.append(dict(dtype=dtype, side=side, key=name, tok_s=[r["tok_s"] for r in runs[name]],
                             later_p50=[r["later_p50"] for r in runs[name]]))  # fmt: skip
        del engines, hf
    return rows


def add_machine_options(ap: argparse.ArgumentParser) -> None:
    """--machines (which of MACHINES to run on) and the hidden --child that on_machines passes."""
    ap.add_argument("--machines", nargs="+", default=list(MACHINES), choices=list(MACHINES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def on_machines(script: str, argv: list[str], machines: list[str]) -> dict:
    """Runs `script --child argv` once per machine (a child process with that machine's
    environment) and returns each child's result: the JSON on its stdout line `ROWS ...`."""
    results = {}
    for machine in machines:
        command = [sys.executable, script, "--child", *argv]
        out = subprocess.run(command, env={**os.environ, **MACHINES[machine]}, capture_output=True, text=True)
        if out.returncode != 0:
            sys.stderr.write(out.stderr)
            raise SystemExit(f"the {machine} machine's run failed")
        results[machine] = json.loads(next(line[5:] for line in out.stdout.splitlines() if line.startswith("ROWS ")))
    return results


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def native_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This CPU as the report names it: its model and which of the kernels' features it has
    (the AMX-or-not difference moves transformers' bf16 side by 2x)."""
    from preheat.engine.kernels.cpu_ext import read_cpu_flags

    flags = read_cpu_flags(cpuinfo)
    try:
        model = next((line.split(":", 1)[1].strip() for line in open(cpuinfo) if line.startswith("model name")),
                     "unknown model")
    except OSError:
        model = "unknown model"
    features = [("avx512_vnni", "AVX-512 VNNI"), ("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX")]
    have = [name for flag, name in features if flag in flags]
    lack = [name for flag, name in features if flag not in flags]
    return f"{model}: {', '.join(have) or 'none of AVX-512 VNNI/BF16, AMX'}" + (f"; no {', '.join(lack)}" if lack and have else "")


def report(results: dict[str, list[dict]], args: argparse.Namespace, threads: int) -> str:
    lines = [
        "# Every CPU, every dtype: Preheat's kernel builds against transformers",
        "",
        f"Model: SmolLM2-135M-Instruct (embedded GGUF, dequantised: every side reads the same weights), "
        f"{threads} threads. Workload: engine_vs_hf.py's, {args.conversations} concurrent conversations x "
        f"{args.turns} turns, {args.max_tokens} new tokens per turn (greedy, eos ignored). One process per "
        f"machine; in it every side ran {args.repeats} times per dtype, alternating; medians.",
        "",
        f"`native` is this machine ({native_cpu()}). `avx2` is an AVX2-only CPU **emulated** on it "
        "(a stand-in: " + ", ".join(f"`{k}={v}`" for k, v in AVX2_MACHINE.items()) + " — Preheat, PyTorch, "
        "oneDNN and MKL all run their AVX2 code; the clock and memory stay this machine's).",
        "",
        "| machine | dtype | side | gen tok/s | vs transformers (goal >= 5x) | per round | TTFT later turns p50 s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for machine, rows in results.items():
        for dtype in args.dtypes:
            hf = next(r for r in rows if r["dtype"] == dtype and r["key"] == "hf")
            for row in (r for r in rows if r["dtype"] == dtype):
                ratio = median(row["tok_s"]) / median(hf["tok_s"])
                per = ", ".join(f"{a / b:.2f}x" for a, b in zip(row["tok_s"], hf["tok_s"]))
                cell = f"**{ratio:.2f}x**" if row["key"] == "cpu" else ("1x" if row["key"] == "hf" else f"{ratio:.2f}x")
                lines.append(
                    f"| {machine} | {dtype} | {row['side']} | {median(row['tok_s']):.1f} | {cell} | {per} | "
                    f"{median(row['later_p50']):.3f} |"
                )
    lines += ["", f"1-minute load average at the end: {os.getloadavg()[0]:.2f} (2 cores, shared VM)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default=str(RESULTS / "cpu_builds.md"))
    add_machine_options(ap)
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.child:
        print("ROWS " + json.dumps(measure(args)))
        return 0
    argv = ["--conversations", str(args.conversations), "--turns", str(args.turns), "--max-tokens",
            str(args.max_tokens), "--repeats", str(args.repeats), "--dtypes", *args.dtypes]  # fmt: skip
    results = on_machines(__file__, argv, args.machines)
    import torch

    text = report(results, args, torch.get_num_threads())
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
