"""One build's engine, kept alive and timed on request, for benchmarks/before_after_steps.py.

Runs under the PYTHONPATH of one build (a worktree, see before_after.py's `checkout`) and
uses only what every build since the engine's layout refactor offers: `from preheat.engine
import LLM, SamplingParams`, and the engine's `build_sequence` / `enqueue` / `step` that
`LLM.generate` drives. It reads one JSON command per line on stdin and answers one JSON line
on stdout, so two builds can take turns every second in one sitting, each idle while the
other runs:

- `{"op": "decode", "batch": B, "context": T, "steps": N, "salt": s}`: B prompts of T
  token ids (drawn from `salt`, the same on both builds), greedy, N + 1 tokens each, eos
  ignored; the prefill steps run untimed, then each of the N decode steps is timed alone.
  Answers `{"step_ms": [...]}`.
- `{"op": "chat", "conversations": C, "turns": U, "system": S, "tokens": N, "salt": s}`:
  engine_vs_hf's workload in miniature: C conversations with one shared system prompt of S
  token ids, U turns of N generated tokens each (the next turn's prompt is the history, so
  the prefix cache serves it). Answers `{"seconds": wall, "generated": tokens}`.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any


def prompt_ids(vocab: int, length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


def run_all(engine: Any, seqs: list[Any], timed_after_first: bool) -> list[float]:
    """Steps until every sequence finished; with `timed_after_first`, the durations (ms) of
    the steps after every sequence has its first token (the decode steps)."""
    ids = [engine.enqueue(s) for s in seqs]
    started: set[str] = set()
    done: set[str] = set()
    times: list[float] = []
    while len(done) < len(ids):
        decoding = timed_after_first and len(started) == len(ids)
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            times.append((time.perf_counter() - t) * 1e3)
        for out in outs:
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                done.add(out.request_id)
    return times


def decode(llm: Any, sp: Any, cmd: dict) -> dict:
    rng = random.Random(cmd["salt"])
    vocab = len(llm.tokenizer)
    params = sp(max_tokens=cmd["steps"] + 1, temperature=0.0, ignore_eos=True)
    seqs = [llm.engine.build_sequence(prompt_ids(vocab, cmd["context"], rng), params) for _ in range(cmd["batch"])]
    return {"step_ms": run_all(llm.engine, seqs, timed_after_first=True)}


def chat(llm: Any, sp: Any, cmd: dict) -> dict:
    rng = random.Random(cmd["salt"])
    vocab = len(llm.tokenizer)
    system = prompt_ids(vocab, cmd["system"], rng)
    histories = [system + prompt_ids(vocab, 24, rng) for _ in range(cmd["conversations"])]
    params = sp(max_tokens=cmd["tokens"], temperature=0.0, ignore_eos=True)
    generated = 0
    t = time.perf_counter()
    for _ in range(cmd["turns"]):
        results = llm.generate(histories, params)
        generated += sum(len(r.token_ids) for r in results)
        histories = [h + r.token_ids + prompt_ids(vocab, 16, rng) for h, r in zip(histories, results)]
    return {"seconds": time.perf_counter() - t, "generated": generated}


def prompts(llm: Any, sp: Any, cmd: dict) -> dict:
    rng = random.Random(f"prompts:{cmd['salt']}")  # not the decode op's prompts, which the cache holds
    vocab = len(llm.tokenizer)
    batch = [prompt_ids(vocab, cmd["context"], rng) for _ in range(cmd["batch"])]
    params = sp(max_tokens=1, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(batch, params)
    return {"seconds": time.perf_counter() - t, "prompt_tokens": cmd["batch"] * cmd["context"]}


def main() -> None:
    settings = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(settings.get("threads", 2))
    from preheat.engine import LLM, SamplingParams

    kwargs = settings.get("llm", {})
    try:
        llm = LLM(**kwargs)
    except ValueError as e:
        # Builds before `--quantization auto` (a GGUF served in its own blocks by default)
        # refuse "none"; there the unset default is what "none" asks for: --dtype.
        if kwargs.get("quantization") != "none" or "'none'" not in str(e):
            raise
        llm = LLM(**{k: v for k, v in kwargs.items() if k != "quantization"})
    print(json.dumps({"ready": True}), flush=True)
    ops = {"decode": decode, "chat": chat, "prompts": prompts}
    for line in sys.stdin:
        cmd = json.loads(line)
        print(json.dumps(ops[cmd["op"]](llm, SamplingParams, cmd)), flush=True)


if __name__ == "__main__":
    main()
