"""Decode-step cost, side by side in one process: Preheat's whole engine step (scheduling,
forward over the paged KV pool, sampling, detokenizing) against transformers' forward over
a dense static KV cache, at batch 1 / 8 / 16 with the same weights, dtype and context; and
batch-1 decode speed against llama.cpp (llama-cpp-python) on the same GGUF file.

Sides:
- preheat bf16: `--quantization none`, the GGUF dequantized to bf16 (CPU kernels);
- preheat int8 on the GGUF: the engine as served by default (`--quantization auto`, = int8 on
  a block-quantized GGUF: this Q4_1 file's layers at 4 bits and its Q8_0 LM head, in place);
- preheat int8 (8-bit codes): `--quantization int8` on the bf16 checkpoint (every matrix 8-bit);
- preheat int8 on the GGUF, 8-bit activation codes: the same with `--int8-activation-bits 8`
  (AVX-512 VNNI build only);
- preheat bf16, fp8 KV: `--kv-cache-dtype fp8`, the decode kernel reading 8-bit pages in place;
- preheat bf16, torch kernels: PREHEAT_ATTENTION_BACKEND=torch, the PyTorch reference path
  (oneDNN matmuls, gathered-context SDPA): what the engine ran before the CPU kernels;
- transformers dense: `model(input_ids, past_key_values=StaticCache)` then argmax, eager
  (no torch.compile), the default attention implementation.

Sides alternate in rounds (a few steps each, medians over all), so machine drift hits all
of them alike. Each step is also put against its memory-bandwidth floor (bytes it reads /
this machine's bandwidth, measured by benchmarks/bandwidth.py in the same run, before and
after the sides, and before every round of steps, each round also put against its own):
bf16, int8 and 4-bit at every batch size, goal <= 1.5x at batch 1 and 8. Writes benchmarks/results/decode_step.md; benchmarks/engine_vs_hf.py runs it
too and puts the same section into engine_vs_hf.md.

    python benchmarks/decode_step.py [--batches 1 8 16] [--context 256] [--rounds 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from preheat.engine import SamplingParams
from preheat.engine.config import EngineConfig
from preheat.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).parent))
import bandwidth  # benchmarks/bandwidth.py, beside this file

RESULTS = Path(__file__).parent / "results"
INT8_GGUF = "preheat int8 on the GGUF (Q4_1 layers at 4 bits)"
INT8_CODES = "preheat int8 (8-bit codes)"
INT8_GGUF_A8 = "preheat int8 on the GGUF, 8-bit activation codes"
# Which side stands for which weight format in the floor table. On the Q4_1 GGUF,
# `--quantization int8` keeps the file's Q4_1 blocks (4 bits a weight, in place) and its
# Q8_0 LM head: that is the 4-bit row (and what `preheat serve` runs by default: `auto`).
# Q4_0 / Q4_K GGUFs take the same 4-bit path (engine/model/gguf_weights.py).
FORMATS = (("bf16", "preheat bf16"), ("int8", INT8_CODES), ("4-bit (Q4_1 layers, Q8_0 head)", INT8_GGUF),
           ("4-bit, 8-bit activation codes", INT8_GGUF_A8), ("bf16, fp8 KV", "preheat bf16, fp8 KV"))
FLOOR_GOAL = 1.5  # issue 28: a step at most 1.5x its floor at batch 1 and 8
STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 40


@contextlib.contextmanager
def backend(name: str):
    """Has the engine built inside choose `name` as its kernel backend; the engine keeps that
    backend object (engine.kernels), so its later steps need nothing of this."""
    before = os.environ.get("PREHEAT_ATTENTION_BACKEND")
    os.environ["PREHEAT_ATTENTION_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PREHEAT_ATTENTION_BACKEND", None)
        else:
            os.environ["PREHEAT_ATTENTION_BACKEND"] = before


class EngineSide:
    def __init__(self, label: str, backend_name: str, **config) -> None:
        self.label = label
        self.backend_name = backend_name
        with backend(backend_name):
            self.engine = Engine(EngineConfig(max_total_tokens=65536, max_num_seqs=64, **config))
        if self.engine.weight_move is not None:  # weights into huge pages, as a server has them once it
            self.engine.weight_move.finish()  # serves; here before the first measured step
        self.forward_times: list[float] = []
        self.context_tokens: list[int] = []  # KV tokens the batch reads, per measured step
        runner = self.engine.runner
        inner = runner.decode_forward

        def timed(*args):
            t0 = time.perf_counter()
            out = inner(*args)
            self.forward_times.append(time.perf_counter() - t0)
            return out

        runner.decode_forward = timed

    def start(self, prompts: list[list[int]]) -> None:
        eng = self.engine
        params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        for p in prompts:
            eng.add_request(p, params)
        while eng.waiting or not eng.inbox.empty() or any(s.num_computed < s.num_tokens - 1 for s in eng.running):
            eng.step()

    def steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            self.context_tokens.append(sum(s.num_tokens for s in self.engine.running))
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
        return times

    def step_bytes(self) -> tuple[int, int]:
        """(weight bytes, mean KV bytes) one measured decode step reads."""
        eng = self.engine
        ctx = statistics.mean(self.context_tokens) if self.context_tokens else 0
        per_token = eng.model_config.kv_bytes_per_token(eng.kv_dtype)
        return eng.model.step_weight_bytes, int(per_token * ctx)

    def stop(self) -> None:
        eng = self.engine
        for s in list(eng.running):
            eng.abort_request(s.request_id)
        eng.step()
        if eng.radix is not None:
            eng.radix.reset()


class DenseSide:
    """transformers' forward over a StaticCache: the dense-cache baseline of the issue."""

    label = "transformers dense (static cache)"

    def __init__(self, hf_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
        self.forward_times: list[float] = []

    def start(self, prompts: list[list[int]], max_len: int) -> None:
        from transformers import StaticCache

        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        ids = torch.tensor(prompts)
        self.pos = ids.shape[1]
        with torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=self.cache, cache_position=torch.arange(self.pos),
                             use_cache=True)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    def steps(self, n: int) -> list[float]:
        times = []
        with torch.inference_mode():
            for _ in range(n):
                t0 = time.perf_counter()
                out = self.model(input_ids=self.next, past_key_values=self.cache,
                                 cache_position=torch.tensor([self.pos]), use_cache=True)
                self.next = out.logits[:, -1].argmax(-1, keepdim=True)
                self.pos += 1
                times.append(time.perf_counter() - t0)
        self.forward_times.extend(times)
        return times

    def stop(self) -> None:
        self.cache = None


def prompts_for(tokenizer, batch: int, context: int) -> list[list[int]]:
    ids = tokenizer.encode(STORY)
    return [ids[i : i + context] for i in range(batch)]  # same length, different tokens


def where_the_time_goes(side: EngineSide, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Milliseconds per step by kind of work, from timers around the engine's kernel backend
    methods (the kernels release the GIL and run to completion, so wall time per call is
    their cost)."""
    acc: dict[str, float] = defaultdict(float)
    patched = []
    outer: list[str] = []  # the timed call we are inside, if any: nested calls count once

    def wrap(obj, name: str, kind: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if outer and outer[-1] != "forward":
                return inner(*args, **kwargs)
            outer.append(kind)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                acc[kind] += time.perf_counter() - t0
                outer.pop()

        patched.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, timed)

    side.start(prompts)
    side.steps(2)
    model = side.engine.model
    # The decode stack runs a step's layers in one call, leaving no backend calls to time:
    # the breakdown runs them one call at a time (the Python between them is then its own row).
    stack, model.decode_stack = model.decode_stack, None
    wrap(model, "forward", "forward")
    wrap(model, "logits", "LM head (logits of the sampled rows)")
    kernels = side.engine.kernels  # the object every layer of the model calls
    wrap(kernels, "apply_linear", "matrix multiplies (layers)")
    wrap(kernels, "decode_attention", "attention")
    for name in ("rms_norm", "silu_mul", "rope_write_kv"):
        wrap(kernels, name, "norm / rope + KV write / SiLU")
    try:
        times = side.steps(steps)
    finally:
        for obj, name, own in reversed(patched):  # the instance's own attribute, or none
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        model.decode_stack = stack
        side.stop()
    total = sum(times)
    forward = acc.pop("forward")
    head = acc.pop("LM head (logits of the sampled rows)")
    out = {k: 1000 * v / steps for k, v in acc.items()}
    out["rest of the forward (embedding, Python between calls)"] = 1000 * (forward - sum(acc.values())) / steps
    out["LM head (logits of the sampled rows)"] = 1000 * head / steps
    out["rest of the step (schedule, sample, detokenize)"] = 1000 * (total - forward - head) / steps
    out["whole step"] = 1000 * total / steps
    return out


def batch1_tokens_per_s(side: EngineSide, prompt: list[int], tokens: int) -> float:
    eng = side.engine
    eng.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    stamps = []
    while eng.has_unfinished():
        for out in eng.step():
            stamps.extend([time.perf_counter()] * len(out.new_token_ids))
    if eng.radix is not None:
        eng.radix.reset()
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def llama_cpp_tokens_per_s(llm, prompt: list[int], tokens: int) -> float:
    llm.reset()
    stamps = [time.perf_counter() for _ in llm.create_completion(prompt, max_tokens=tokens, temperature=0, stream=True)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per side per round")
    ap.add_argument("--b1-tokens", type=int, default=128)
    ap.add_argument("--no-reference", action="store_true", help="skip the torch-kernels side")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=str(RESULTS / "decode_step.md"))
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> str:
    """Measures every side; returns the markdown report."""
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    bw_before = bandwidth.measure_all([1, threads])
    # quantization="none": the GGUF dequantized to bf16 (`auto`, the default, serves its blocks:
    # that is the int8-on-the-GGUF side).
    sides = [EngineSide("preheat bf16", "cpu", dtype="bfloat16", quantization="none"),
             EngineSide(INT8_GGUF, "cpu", dtype="bfloat16", quantization="int8")]
    ours = sides[0].engine
    # 8-bit codes everywhere: the bf16 checkpoint quantized (on the GGUF, int8 keeps Q4_1 at 4 bits).
    sides.append(EngineSide(INT8_CODES, "cpu", model=ours.hf_dir, dtype="bfloat16", quantization="int8"))
    # --int8-activation-bits 8: the same blocks multiplied by int8 activation codes (vpdpbusd).
    if 8 in getattr(ours.kernels.kernels, "int8_activation_bits_choices", ()):
        sides.append(EngineSide(INT8_GGUF_A8, "cpu", dtype="bfloat16", quantization="int8", int8_activation_bits=8))
    sides.append(EngineSide("preheat bf16, fp8 KV", "cpu", dtype="bfloat16", kv_cache_dtype="fp8", quantization="none"))
    if not args.no_reference:
        sides.append(EngineSide("preheat bf16, torch kernels (before)", "torch", dtype="bfloat16", quantization="none"))
    if ours.attention_backend != "cpu":
        print(f"warning: the CPU kernels are not in use ({ours.attention_backend})", file=sys.stderr)
    dense = DenseSide(ours.hf_dir)
    tok = ours.tokenizer
    all_sides = sides + [dense]
    results: dict[int, dict[str, float]] = {}
    forward: dict[int, dict[str, float]] = {}
    step_bytes: dict[int, dict[str, tuple[int, int]]] = {}
    paired: dict[int, dict[str, list[tuple[float, float]]]] = {}  # batch -> side -> (round's median ms, its GB/s)
    round_gbps: dict[int, list[float]] = defaultdict(list)
    for batch in args.batches:
        prompts = prompts_for(tok, batch, args.context)
        for s in sides:
            s.start(prompts)
            s.forward_times.clear()
            s.context_tokens.clear()
        dense.start(prompts, args.context + args.rounds * args.steps + 16)
        dense.forward_times.clear()
        times: dict[str, list[float]] = defaultdict(list)
        for s in all_sides:
            s.steps(2)  # warm: first steps at a new batch size build kernels / caches
            s.forward_times.clear()
            if isinstance(s, EngineSide):
                s.context_tokens.clear()
        paired[batch] = defaultdict(list)
        for _ in range(args.rounds):
            # The machine's rate now: on this shared VM it moved between ~50 and ~80 GB/s at
            # 2 threads from one minute to the next (likely where the vCPUs ran).
            gbps = bandwidth.measure(threads, mib=128, repeats=3).best
            round_gbps[batch].append(gbps)
            for s in all_sides:
                t = s.steps(args.steps)
                times[s.label].extend(t)
                paired[batch][s.label].append((1000 * statistics.median(t), gbps))
        results[batch] = {label: 1000 * statistics.median(t) for label, t in times.items()}
        forward[batch] = {s.label: 1000 * statistics.median(s.forward_times) for s in all_sides}
        step_bytes[batch] = {s.label: s.step_bytes() for s in sides}
        for s in all_sides:
            s.stop()
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in results[batch].items()), file=sys.stderr)

    breakdown = {}
    for s in sides[:2]:
        for batch in (args.batches[0], args.batches[-1]):
            breakdown[(s.label, batch)] = where_the_time_goes(s, prompts_for(tok, batch, args.context), 2 * args.steps)

    b1: dict[str, list[float]] = defaultdict(list)
    prompt = prompts_for(tok, 1, args.context)[0]
    llm = None
    gguf = ours.config.model
    if gguf is None:
        from preheat.engine.model.loader import default_model_path

        gguf = default_model_path()
    if importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        llama_cpp_tokens_per_s(llm, prompt, 8)  # warm
    for _ in range(3):
        for s in sides[:2]:
            b1[s.label].append(batch1_tokens_per_s(s, prompt, args.b1_tokens))
        if llm is not None:
            b1["llama.cpp (llama-cpp-python)"].append(llama_cpp_tokens_per_s(llm, prompt, args.b1_tokens))

    bw_after = bandwidth.measure_all([1, threads])
    floors = Floors(bw_before, bw_after, threads, step_bytes, paired, dict(round_gbps))
    return render(args, results, forward, breakdown, b1, sides, dense, gguf, ours) + render_floors(floors, results)


def main() -> int:
    args = parse_args()
    text = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def render(args, results, forward, breakdown, b1, sides, dense, gguf, ours) -> str:
    labels = [s.label for s in sides] + [dense.label]
    lines = [
        "## Decode step: Preheat vs a dense-cache forward, and batch-1 decode vs llama.cpp",
        "",
        f"Model: SmolLM2-135M-Instruct ({Path(gguf).name}; bf16 sides read it dequantised; int8 on "
        "the GGUF reads its Q4_1 layer blocks (4 bits a weight) and Q8_0 LM head as they are; int8 with "
        f"8-bit codes quantizes the bf16 checkpoint), {bandwidth.cpu_model()}, {torch.get_num_threads()} threads, contexts of "
        f"{args.context} tokens growing by {args.rounds * args.steps + 2} during the run. Written by "
        "`benchmarks/decode_step.py`: all sides in one process, alternating in rounds of "
        f"{args.steps} steps ({args.rounds} rounds), medians. Preheat's figure is its whole engine step "
        "(scheduling, forward, sampling, detokenizing); transformers' is its forward plus argmax.",
        "",
        "| decode step (ms, median) | " + " | ".join(f"batch {b}" for b in results) + " |",
        "| --- | " + " | ".join("---" for _ in results) + " |",
    ]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{results[b][label]:.1f}" for b in results) + " |")
    lines.append("| of which the forward pass | " + " | ".join(
        " / ".join(f"{forward[b][s.label]:.1f}" for s in sides[:2]) for b in results) + " |")
    lines += ["", "Ratio to the dense-cache forward (goal <= 0.7):", ""]
    for s in sides:
        lines.append(f"- {s.label}: " + ", ".join(
            f"batch {b} {results[b][s.label] / results[b][dense.label]:.2f}" for b in results))
    lines += ["", "### Batch-1 decode against llama.cpp on the same GGUF", ""]
    if "llama.cpp (llama-cpp-python)" not in b1:
        lines.append("llama-cpp-python is not importable in this run (build notes: /work/shared/MACHINE-NOTES.md).")
    lines += ["| engine | decode tok/s (median of 3) | runs |", "| --- | --- | --- |"]
    for label, vals in b1.items():
        lines.append(f"| {label} | {statistics.median(vals):.1f} | {', '.join(f'{v:.1f}' for v in vals)} |")
    lines += [
        "",
        f"{args.b1_tokens} greedy tokens after a {args.context}-token prompt; tokens/s between the first "
        "and the last token as each side streams them (llama.cpp: `create_completion(stream=True)`, "
        f"n_threads={torch.get_num_threads()}).",
        "",
        "### Where the time goes (ms per step, timers around the kernel backend's methods)",
        "",
        "These steps run the layers one call at a time: the decode stack (engine/model/decode_stack.py), "
        "which the steps above use, calls the same kernels from C++ and leaves nothing to time between "
        "them; what it saves is in the Python rows here (benchmarks/results/decode_stack.md).",
        "",
    ]
    keys = list(next(iter(breakdown.values())).keys())
    cols = list(breakdown)
    lines.append("| | " + " | ".join(f"{label}, batch {b}" for label, b in cols) + " |")
    lines.append("| --- | " + " | ".join("---" for _ in cols) + " |")
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{breakdown[c][k]:.1f}" for c in cols) + " |")
    weights = ours.model.step_weight_bytes
    lines += [
        "",
        f"Weights read per step: {weights / 1e6:.0f} MB in bf16, "
        f"{sides[2].engine.model.step_weight_bytes / 1e6:.0f} MB in int8 (8-bit codes), "
        f"{sides[1].engine.model.step_weight_bytes / 1e6:.0f} MB in int8 on the GGUF (Q4_1 layers at 4 bits).",
        f"1-minute load average at the end: {os.getloadavg()[0]:.2f} (2 cores shared with other work; "
        "sides alternate, so drift hits all of them, but absolute times move).",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Floors:
    """Bandwidth measured before and after the sides ran, and what each side's step read."""

    before: dict[int, bandwidth.Bandwidth]
    after: dict[int, bandwidth.Bandwidth]
    threads: int
    step_bytes: dict[int, dict[str, tuple[int, int]]]  # batch -> side -> (weights, KV)
    paired: dict[int, dict[str, list[tuple[float, float]]]]  # batch -> side -> per round (median step ms, GB/s)
    round_gbps: dict[int, list[float]]  # batch -> the rate measured before each round

    @property
    def gbps(self) -> float:
        """The fastest rate seen at no more threads than the steps ran with: the strictest
        floor (a step with N threads can always do what one with fewer does)."""
        return max(bw.best for run in (self.before, self.after) for t, bw in run.items() if t <= self.threads)


def render_floors(f: Floors, results: dict[int, dict[str, float]]) -> str:
    gbps = f.gbps
    lines = [
        "",
        "### Distance to the memory-bandwidth floor",
        "",
        "Bandwidth measured in this run by `benchmarks/bandwidth.py` (STREAM-style, float32 arrays of "
        "128 MiB, best of 5), before the sides were built and after they ran:",
        "",
        "| threads | copy GB/s | triad GB/s | read (sum) GB/s |",
        "| --- | --- | --- | --- |",
    ]
    for t in f.before:
        b, a = f.before[t], f.after[t]
        lines.append(f"| {t} | {b.copy:.1f} / {a.copy:.1f} | {b.triad:.1f} / {a.triad:.1f} | {b.read:.1f} / {a.read:.1f} |")
    lines += [
        "",
        f"Floor of a step = (bytes it reads) / {gbps:.1f} GB/s, the fastest rate above at <= {f.threads} "
        "threads. Bytes = every weight matrix once (the LM head once, also when tied to the embedding) "
        "plus the KV of every sequence's context (all layers, K and V, the pool's dtype), mean over the "
        "measured steps. Multiple = the whole engine step (median, table above) / its floor.",
        "",
        "*Multiple at its round's rate*: each round of steps against the rate measured just before it "
        "(STREAM read / copy / triad, 128 MiB as above, best of 3), the median over rounds. On a shared VM the "
        "rate can move from minute to minute (on the AMD EPYC host, 2 threads between ~50 and ~80 GB/s, 1 "
        "thread ~40 throughout: likely where the hypervisor placed the two vCPUs), so the fastest rate of the "
        "run can belong to other minutes than a side's steps; the paired multiple compares each step with the "
        "machine it ran on. Where a batch's steps took as long at a fast round's rate as at a slow one's, the "
        "step is not bound by memory. "
        "Rates before each batch size's rounds: "
        + "; ".join(f"batch {b}: " + ", ".join(f"{g:.0f}" for g in r) + " GB/s" for b, r in f.round_gbps.items())
        + ".",
        "",
        "| format | side | batch | weights MB | KV MB | floor ms | step ms | multiple | multiple at its round's rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts, paired_verdicts = [], []
    for fmt, label in FORMATS:
        worst = worst_paired = 0.0
        for batch in results:
            if label not in f.step_bytes[batch]:
                continue
            weights, kv = f.step_bytes[batch][label]
            floor = bandwidth.floor_ms(weights + kv, gbps)
            multiple = results[batch][label] / floor
            paired = statistics.median(ms / bandwidth.floor_ms(weights + kv, g) for ms, g in f.paired[batch][label])
            if batch in (1, 8):
                worst = max(worst, multiple)
                worst_paired = max(worst_paired, paired)
            lines.append(f"| {fmt} | {label} | {batch} | {weights / 1e6:.0f} | {kv / 1e6:.1f} | {floor:.2f} | "
                         f"{results[batch][label]:.1f} | {multiple:.1f}x | {paired:.2f}x |")
        if worst:
            verdicts.append(f"{fmt} {worst:.1f}x ({'met' if worst <= FLOOR_GOAL else 'not met'})")
            paired_verdicts.append(f"{fmt} {worst_paired:.2f}x ({'met' if worst_paired <= FLOOR_GOAL else 'not met'})")
    lines += [
        "| 4-bit Q4_0 / Q4_K | (not measured: the embedded GGUF is Q4_1) | - | - | - | - | - | read in place into the same 4-bit codes with float16 scale / offset per 32 (engine/model/gguf_weights.py), so the bytes and kernel of the Q4_1 rows |",
        "",
        f"Goal <= {FLOOR_GOAL}x the floor at batch 1 and 8; worst of the two: " + ", ".join(verdicts) + ".",
        "",
        "The same at each round's rate: " + ", ".join(paired_verdicts) + ".",
        f"1-minute load average after the floors: {os.getloadavg()[0]:.2f}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
