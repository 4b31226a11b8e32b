"""Decode steps with the layers in one call (the decode stack) and one call at a time.

engine/model/decode_stack.py runs a decode-only step's layers from C++: the same kernels,
order and arguments, so the same bits, without the Python between ~9 kernel calls a layer.
This times the engine's whole decode step both ways in one process, on one engine: the
stack is switched on and off between blocks of steps (alternating which goes first), at
batch 1 / 8 / 16 after 256-token prompts, for the configurations users serve: the embedded
GGUF as `preheat serve` runs it (its Q4_1 blocks in place), bfloat16 (`--quantization none`)
and `--quantization int8` on the bf16 checkpoint (8-bit codes, as serving_vs_peers' int8). Medians over all steps of each side.

    python benchmarks/decode_stack.py [--rounds 8] [--steps 6] [--out benchmarks/results/decode_stack.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import EngineSide  # benchmarks/decode_step.py: an engine whose steps it times

RESULTS = Path(__file__).parent / "results"
CONFIGS = {
    "GGUF default (Q4_1 in place)": {},
    "bf16 (--quantization none)": {"quantization": "none"},
    # 8-bit codes: the bf16 checkpoint quantized (on the GGUF, int8 keeps its blocks: the default's row)
    "int8, 8-bit codes (--quantization int8 on the bf16 checkpoint)": {"quantization": "int8", "model": "bf16"},
}
BATCHES = (1, 8, 16)
PROMPT_TOKENS = 256


def measure(
    side: EngineSide, batch: int, rounds: int, steps: int, rng: random.Random
) -> tuple[list[float], list[float]]:
    """(stack step times, one-call-at-a-time step times) of `batch` decoding sequences."""
    model = side.engine.model
    stack = model.decode_stack
    side.start([[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(batch)])
    side.steps(3)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(rounds):
            for use in (True, False) if r % 2 == 0 else (False, True):
                model.decode_stack = stack if use else None
                times[use] += side.steps(steps)
    finally:
        model.decode_stack = stack
        side.stop()
    return times[True], times[False]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(RESULTS / "decode_stack.md"))
    args = ap.parse_args()
    started = time.time()
    rng = random.Random(0)
    rows = []
    bf16_dir = None  # the bf16 engine's Hugging Face directory, written from the GGUF
    for label, config in CONFIGS.items():
        if config.get("model") == "bf16":
            config = config | {"model": bf16_dir}
        side = EngineSide(label, "cpu", **config)
        if config.get("quantization") == "none":
            bf16_dir = side.engine.hf_dir
        if side.engine.model.decode_stack is None:
            rows.append(f"| {label} | - | - | - | (no stack: a layer it does not run) |")
            continue
        for batch in BATCHES:
            on, off = measure(side, batch, args.rounds, args.steps, rng)
            a, b = statistics.median(on) * 1e3, statistics.median(off) * 1e3
            rows.append(f"| {label}, batch {batch} | {a:.2f} | {b:.2f} | {a / b:.3f} | {b - a:.2f} |")
            print(rows[-1], flush=True)
    text = (
        "\n".join(
            [
                "# Decode steps: the layers in one call (decode stack) and one call at a time",
                "",
                f"Written by `benchmarks/decode_stack.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
                f"({(time.time() - started) / 60:.1f} min). SmolLM2-135M-Instruct (embedded GGUF), CPU, "
                f"{torch.get_num_threads()} threads; the engine's whole decode step after {PROMPT_TOKENS}-token prompts, "
                f"one engine per configuration with the stack switched on and off between blocks of {args.steps} steps, "
                f"{args.rounds} rounds alternating which goes first; medians over each side's steps. Both sides give "
                "the same bits (tests/engine/test_decode_stack.py).",
                "",
                "| configuration, batch | stack ms | one call at a time ms | ratio | ms saved |",
                "| --- | ---: | ---: | ---: | ---: |",
                *rows,
            ]
        )
        + "\n"
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
