"""The CPU kernels' matrices in 2 MiB pages (engine/model/weight_arena.py) or in 4 KiB pages,
side by side in one process: for each weight format, two engines built the same way but
for PREHEAT_HUGE_PAGES (1 / 0), their decode steps alternating in rounds, medians over all
rounds. Writes benchmarks/results/weight_huge_pages.md.

    python benchmarks/weight_huge_pages.py [--batches 1 8] [--rounds 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bandwidth import cpu_model
from decode_step import EngineSide, prompts_for

RESULTS = Path(__file__).parent / "results"
FORMATS = {
    "bf16 (the GGUF dequantized)": {"quantization": "none"},
    "4-bit (the GGUF's Q4_1 layers, Q8_0 head: the default)": {"quantization": "int8"},
}


def side(label: str, huge: bool, config: dict) -> EngineSide:
    os.environ["PREHEAT_HUGE_PAGES"] = "1" if huge else "0"
    try:
        s = EngineSide(label, "cpu", dtype="bfloat16", **config)
    finally:
        os.environ.pop("PREHEAT_HUGE_PAGES", None)
    move = s.engine.weight_move  # the background copy (weight_arena.WeightMove), swapped in at a step
    if (move is not None and move.moving and move.wait(120)) != huge:
        raise SystemExit(f"{label}: weights {'not ' if huge else ''}moving into huge pages (THP off? memory short?)")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=240)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS / "weight_huge_pages.md"))
    args = ap.parse_args(argv)
    rows = []
    for fmt, config in FORMATS.items():
        pair = [side(f"{fmt}, 4 KiB pages", False, config), side(f"{fmt}, 2 MiB pages", True, config)]
        for batch in args.batches:
            times: dict[str, list[float]] = {s.label: [] for s in pair}
            for s in pair:
                s.start(prompts_for(s.engine.tokenizer, batch, args.context))
                s.steps(3)
                if (s.engine.model.weight_arena is not None) != (s is pair[1]):
                    raise SystemExit(f"{s.label}: the matrices are not where this side needs them")
            for r in range(args.rounds):
                for s in pair if r % 2 == 0 else pair[::-1]:
                    times[s.label] += s.steps(args.steps)
            small, huge = (statistics.median(times[s.label]) * 1e3 for s in pair)
            rows.append((fmt, batch, small, huge))
            print(f"{fmt} batch {batch}: 4 KiB {small:.2f} ms, 2 MiB {huge:.2f} ms ({huge / small:.3f}x)", flush=True)
            for s in pair:
                s.stop()
        del pair
    lines = [
        "## Decode steps with the matrices in 2 MiB pages vs 4 KiB pages",
        "",
        f"Written by `benchmarks/weight_huge_pages.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{cpu_model()}, {os.cpu_count()} CPUs. SmolLM2-135M-Instruct (the embedded GGUF). For each format two "
        "engines in one process, built alike but for PREHEAT_HUGE_PAGES (0: each matrix in its own 4 KiB pages, "
        "as before; 1, the default: all of them copied into one mapping advised MADV_HUGEPAGE in the background "
        "and swapped in at a step, engine/model/weight_arena.py); their "
        f"whole engine steps alternate in {args.rounds} rounds of {args.steps}, after prompts of {args.context} "
        "tokens; medians over all rounds.",
        "",
        "| format | batch | step, 4 KiB pages (ms) | step, 2 MiB pages (ms) | 2 MiB / 4 KiB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {fmt} | {b} | {s:.2f} | {h:.2f} | {h / s:.3f}x |" for fmt, b, s, h in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
