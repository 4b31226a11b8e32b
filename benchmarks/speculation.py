"""Speculation that pays or steps aside: tokens/s with ngram speculation off, on as it was
(`--speculative-gate always`: every n-gram match verified) and on with the gate (`auto`:
drafts only where expected to pay), side by side in one process.

Workloads:
- edits: "rewrite this code" over real source files (functions of this repository), where
  the answer repeats most of the prompt, so prompt-lookup drafts hit;
- rag: retrieval-augmented answers: three passages of this repository's docs/ as numbered
  context and a question asking what one of them says, quoting it (greedy), so the answer
  copies runs of the context (this small model also falls into loops after a sentence or
  two, which drafts hit as well);
- synthetic: prompts of random words (as guidellm's synthetic data), sampled at
  temperature 1 with a seed per request and the end-of-sequence token ignored, so the answer
  is new text of a fixed length where drafts seldom hit. (Greedy, this small model either
  stops at once or loops on a word, and a loop is repetition the drafts do hit.)
Each at batch 1 and at 8 (more with --batches), the same requests for every side.

Rounds alternate the sides (rotating which goes first), so drift in the machine's load hits
all of them alike; each run starts from an empty prefix cache. Tokens/s counts generated
tokens over the wall time of the run (prefill included: the same for every side) and over
the decode part alone (from the step after the last prompt finished prefilling). Writes
benchmarks/results/speculation.md.

    python benchmarks/speculation.py [--batches 1 8] [--rounds 3] [--max-tokens 128] [--threads N]
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preheat.engine import SamplingParams
from preheat.engine.config import EngineConfig
from preheat.engine.engine import Engine

RESULTS = Path(__file__).parent / "results"
SIDES = (("off", {}), ("always", {"speculative_method": "ngram", "speculative_gate": "always"}),
         ("auto (gated)", {"speculative_method": "ngram", "speculative_gate": "auto"}))
EDITS = (
    "Rewrite this Python code with every variable name in snake_case and a docstring on each "
    "function. Reply with the complete code only.",
    "Add type hints to this Python code. Reply with the whole code, unchanged otherwise.",
)


def edit_prompts(tok, n: int) -> list[list[int]]:
    """n chat prompts asking to rewrite a real function of this repository."""
    from preheat.engine.sample import spec_decode
    from preheat.engine.sched import plan, spec_policy, spec_stats

    sources = [inspect.getsource(f) for f in (
        spec_decode.propose_ngram, spec_decode.accept_greedy, spec_decode.accept_sampled, spec_decode.draft_limit,
        spec_policy.plan_draft_lengths, spec_stats.resolve, spec_stats.AcceptanceProfile, plan.plan_step,
    )]
    out = []
    for i in range(n):
        src = sources[i % len(sources)]
        text = f"{EDITS[i % len(EDITS)]}\n\n```python\n{src[:2400]}```"
        out.append(chat(tok, text))
    return out


RAG_INSTRUCTION = (
    "Answer the question using only the context below. Quote the context word for word where it answers."
)


def doc_passages() -> list[str]:
    """Prose paragraphs of this repository's docs/ (300-900 characters; no headings, lists,
    tables or code), in a fixed order."""
    out = []
    for path in sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md")):
        for block in re.split(r"\n\s*\n", path.read_text()):
            text = " ".join(block.split())
            if 300 < len(text) < 900 and not text.startswith(("#", "|", "```", "-", "*", ">", "1.")):
                out.append(text)
    return out


def rag_prompts(tok, n: int) -> list[list[int]]:
    """n chat prompts: three numbered passages as context, then a question on one of them."""
    passages = doc_passages()
    out = []
    for i in range(n):
        context = "\n".join(f"[{j + 1}] {passages[(7 * i + 13 * j) % len(passages)]}" for j in range(3))
        question = f"What does passage [{1 + i % 3}] say? Quote it."
        out.append(chat(tok, f"{RAG_INSTRUCTION}\n\nContext:\n{context}\n\nQuestion: {question}"))
    return out


def synthetic_prompts(tok, n: int, words: int = 200, seed: int = 0) -> list[list[int]]:
    """n chat prompts of `words` random words from the tokenizer's vocabulary."""
    vocab = sorted({t.lstrip("Ġ") for t in tok.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3})
    rng = random.Random(seed)
    return [chat(tok, " ".join(rng.choice(vocab) for _ in range(words))) for _ in range(n)]


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False))


@dataclass
class Run:
    tokens: int
    wall: float
    decode_tokens: int
    decode_wall: float
    drafted: int
    accepted: int
    steps: int
    drafted_steps: int
    cpu: float  # this process's CPU seconds (all threads): the work, whatever else ran
    outputs: list[list[int]] = field(repr=False, default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall

    @property
    def tok_cpu_s(self) -> float:
        return self.tokens / self.cpu

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_wall if self.decode_wall else float("nan")


def params_for(workload: str, max_tokens: int, i: int) -> SamplingParams:
    if workload == "synthetic":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def run_once(engine: Engine, workload: str, prompts: list[list[int]], max_tokens: int) -> Run:
    """Every prompt at once, stepped to the end; counts only this run's work."""
    if engine.radix is not None:
        engine.radix.reset()
    before = engine.stats()
    ids = [engine.add_request(p, params_for(workload, max_tokens, i)) for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    steps = drafted_steps = decode_tokens = 0
    decode_start = None
    cpu = time.process_time()
    start = time.perf_counter()
    while engine.has_unfinished():
        prefilling = bool(engine.waiting) or not engine.inbox.empty() or any(s.num_computed < s.num_tokens - 1 for s in engine.running)
        if decode_start is None and not prefilling:
            decode_start = time.perf_counter()
        drafted = engine.stats().spec_draft_tokens_total
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if decode_start is not None:
                decode_tokens += len(out.new_token_ids)
        steps += 1
        drafted_steps += engine.stats().spec_draft_tokens_total > drafted
    end = time.perf_counter()
    cpu = time.process_time() - cpu
    after = engine.stats()
    return Run(
        tokens=sum(len(o) for o in outputs.values()), wall=end - start,
        decode_tokens=decode_tokens, decode_wall=end - decode_start if decode_start else 0.0,
        drafted=after.spec_draft_tokens_total - before.spec_draft_tokens_total,
        accepted=after.spec_accepted_tokens_total - before.spec_accepted_tokens_total,
        steps=steps, drafted_steps=drafted_steps, cpu=cpu, outputs=[outputs[i] for i in ids],
    )


WORKLOADS = {"edits": edit_prompts, "rag": rag_prompts, "synthetic": synthetic_prompts}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--quantization", default="none", help="none: bf16 weights (the GGUF dequantized)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=str(RESULTS / "speculation.md"))
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.time()
    common = dict(max_total_tokens=65536, max_num_seqs=64, dtype="bfloat16",
                  num_speculative_tokens=args.num_speculative_tokens)
    common["quantization"] = args.quantization
    engines = {label: Engine(EngineConfig(**common, **extra)) for label, extra in SIDES}
    for engine in engines.values():  # the weights in huge pages, as a server has them once it serves; in
        if engine.weight_move is not None:  # 4 KiB pages two identical engines here measured 3-4% apart
            engine.weight_move.finish()
    tok = next(iter(engines.values())).tokenizer
    make = WORKLOADS
    runs: dict[tuple[str, int, str], list[Run]] = {}
    loads: list[float] = []
    for workload in args.workloads:
        for batch in args.batches:
            prompts = make[workload](tok, batch)
            for engine in engines.values():  # warm: this batch's shapes, the gate's first measurements
                run_once(engine, workload, prompts, 8)
            for r in range(args.rounds):
                order = list(engines)[r % len(engines):] + list(engines)[: r % len(engines)]
                for label in order:
                    runs.setdefault((workload, batch, label), []).append(
                        run_once(engines[label], workload, prompts, args.max_tokens))
                loads.append(os.getloadavg()[0])
            line = ", ".join(f"{label} {statistics.median(x.tok_s for x in runs[(workload, batch, label)]):.1f}"
                             for label in engines)
            print(f"{workload} batch {batch}: tok/s {line}", file=sys.stderr, flush=True)
    text = render(args, runs, list(engines), load_before, os.getloadavg(), loads, time.time() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def paired(rs: list[Run], base: list[Run], metric) -> float:
    """Each round's ratio to `off` in the same round, then the median over rounds."""
    return statistics.median(metric(r) / metric(b) for r, b in zip(rs, base))


def render(args, runs, labels, load_before, load_after, loads, seconds) -> str:
    lines = [
        "# Speculation: off, always, gated",
        "",
        f"SmolLM2-135M-Instruct (the embedded GGUF), bf16{', ' + args.quantization if args.quantization != 'none' else ''}, "
        f"CPU, {torch.get_num_threads()} torch threads, ngram drafts of up to {args.num_speculative_tokens} tokens. "
        f"Written by `benchmarks/speculation.py`: three engines in one process, {args.rounds} rounds, the sides "
        f"alternating (first side rotating each round), up to {args.max_tokens} tokens a request (edits, rag: greedy; "
        "synthetic: sampled at temperature 1, seeded, end-of-sequence ignored), "
        "each run from an empty prefix cache; medians over the rounds.",
        "",
        f"Machine: 2 cores shared with other engineers' tests and servers. 1/5/15-minute load average "
        f"before: {' / '.join(f'{x:.1f}' for x in load_before)}, after: "
        f"{' / '.join(f'{x:.1f}' for x in load_after)}; 1-minute load after each round: "
        f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}. "
        f"The run took {seconds / 60:.0f} min.",
        "",
        "| workload | batch | side | tok/s | vs off | decode tok/s | vs off | tok per CPU-s, vs off | "
        "accepted / drafted | steps drafted | tokens | vs off, each round |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = sorted({(w, b) for w, b, _ in runs}, key=lambda k: (args.workloads.index(k[0]), k[1]))
    for workload, batch in keys:
        base = runs[(workload, batch, labels[0])]
        for label in labels:
            rs = runs[(workload, batch, label)]

            drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
            acc = f"{accepted / drafted:.0%} of {drafted // len(rs)}" if drafted else "-"
            steps = f"{sum(r.drafted_steps for r in rs) / max(1, sum(r.steps for r in rs)):.0%}"
            same = "same as off" if all(r.outputs == b.outputs for r, b in zip(rs, base)) else "differ"
            lines.append(
                f"| {workload} | {batch} | {label} | {statistics.median(r.tok_s for r in rs):.1f} | "
                f"{paired(rs, base, lambda r: r.tok_s):.2f}x | {statistics.median(r.decode_tok_s for r in rs):.1f} | "
                f"{paired(rs, base, lambda r: r.decode_tok_s):.2f}x | {paired(rs, base, lambda r: r.tok_cpu_s):.2f}x | {acc} | {steps} | "
                f"{statistics.median(r.tokens for r in rs):.0f} ({same}) | "
                f"{', '.join(f'{r.tok_s / b.tok_s:.2f}' for r, b in zip(rs, base))} |"
            )
    lines += [
        "",
        "tok/s: generated tokens over the run's wall time (median of the rounds); decode tok/s: the same from "
        "the step after the last prompt finished prefilling. vs off: the median over rounds of the ratio to "
        "`off` in the same round (the sides of a round ran back to back, so each ratio sees one load). "
        "tok per CPU-s: generated tokens per CPU second of this process, which waiting for a core others hold "
        "does not inflate (with one torch thread it is the work done). accepted / drafted: the share of "
        "verified draft tokens the model kept, of the drafted tokens per run (preheat_spec_accepted_tokens / "
        "preheat_spec_draft_tokens). steps drafted: the share of engine steps that verified at least one "
        "draft. tokens: generated per run, and whether every side produced the same tokens as `off` (greedy "
        "speculation is exact up to bf16 rounding between the decode and verify paths; speculative sampling "
        "keeps the distribution, not the seeded draw).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
