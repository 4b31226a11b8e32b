"""Prompt (prefill) cost of the engine as served, and where it goes.

At 8 streams the larger part of a stream's time is other streams' prompts (see
serving_vs_peers.md / serving_profile.md): a new request's prompt runs between the decode
steps of everyone else. This measures that work alone, in one process: the engine's whole
step for

- one 256-token prompt, as a chat request of serving_vs_peers' plain workload brings;
- four such prompts in one step;
- 128 new tokens after a cached 640-token prefix (the shared-prefix workload);

on the default configuration (`--quantization auto`: the embedded GGUF's Q4_1 blocks in
place, bfloat16 activations) and on `--quantization none` (bfloat16 weights). Every prompt is
fresh random token ids (the radix cache hits nothing but the warmed prefix); the KV pool is
small (4096 tokens) and cycled through before measuring, so a prompt writes pages that
already have memory (a fresh replica's first prompts also fault them in: kv_prefault.md). Workloads and
configurations alternate in rounds; figures are medians over rounds. Timers around the kernel
backend's methods say where the time goes (the kernels release the GIL and run to the end,
so a call's wall time is its cost).

    python benchmarks/prefill_step.py [--rounds 7] [--out benchmarks/results/prefill_step.md]

To compare two revisions, run it under benchmarks/before_after.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

from preheat.engine import SamplingParams
from preheat.engine.config import EngineConfig
from preheat.engine.engine import Engine

RESULTS = Path(__file__).parent / "results"
POOL_TOKENS = 4096
WORKLOADS = {  # name: (prompts per step, new tokens each, cached prefix tokens)
    "1 x 256-token prompt": (1, 256, 0),
    "4 x 256-token prompts": (4, 256, 0),
    "128 tokens after a cached 640": (1, 128, 640),
}
SIDES = {"GGUF default (Q4_1 in place)": {}, "bf16 (--quantization none)": {"quantization": "none"}}
KINDS = {
    "apply_linear": "matrix multiplies",
    "extend_attention": "attention",
    "rms_norm": "norm / rope + KV write / SiLU",
    "silu_mul": "norm / rope + KV write / SiLU",
    "rope_write_kv": "norm / rope + KV write / SiLU",
}


class Side:
    """One engine and timers around its kernel backend's methods."""

    def __init__(self, **config) -> None:
        self.engine = Engine(EngineConfig(max_total_tokens=POOL_TOKENS, max_num_seqs=16, **config))
        if self.engine.weight_move is not None:  # the weights in huge pages, as a server has them
            self.engine.weight_move.finish()
        self.acc: dict[str, float] = defaultdict(float)
        self.rng = random.Random(0)
        self.prefix = self.fresh(640)
        kernels = self.engine.kernels
        for name, kind in KINDS.items():
            inner = getattr(kernels, name)
            setattr(kernels, name, self._timed(inner, kind))

    def _timed(self, inner, kind: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.acc[kind] += time.perf_counter() - t0

        return timed

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 40000) for _ in range(n)]

    def run(self, prompts: list[list[int]]) -> float:
        """Seconds for the steps that prefill `prompts` (and sample one token each)."""
        eng = self.engine
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        ids = {eng.add_request(p, params) for p in prompts}
        t0 = time.perf_counter()
        done: set[str] = set()
        while done != ids:
            done |= {o.request_id for o in eng.step() if o.finished}
        return time.perf_counter() - t0

    def measure(self, workload: str) -> tuple[float, dict[str, float]]:
        """(ms per new prompt token, ms per token by kind of work) of one run of `workload`."""
        count, new, cached = WORKLOADS[workload]
        prompts = [(self.prefix if cached else []) + self.fresh(new) for _ in range(count)]
        self.acc.clear()
        wall = self.run(prompts)
        tokens = count * new
        parts = {k: 1000 * v / tokens for k, v in self.acc.items()}
        parts["rest (embedding, LM head row, sampling, Python)"] = 1000 * wall / tokens - sum(parts.values())
        return 1000 * wall / tokens, parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS / "prefill_step.md"))
    args = ap.parse_args()
    started = time.time()
    sides = {label: Side(**config) for label, config in SIDES.items()}
    for side in sides.values():  # warm: every page of the pool written once, the prefix cached
        for _ in range(2 * POOL_TOKENS // 1024):
            side.run([side.fresh(1024)])
        side.run([side.prefix + side.fresh(16)])
        for w in WORKLOADS:
            side.measure(w)
    per_token: dict[tuple[str, str], list[float]] = defaultdict(list)
    parts: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for w in WORKLOADS:
            for label, side in sides.items():
                ms, by_kind = side.measure(w)
                per_token[label, w].append(ms)
                for kind, v in by_kind.items():
                    parts[label, w][kind].append(v)
    lines = [
        "# Prefill: the engine's prompt steps and where their time goes",
        "",
        f"Written by `benchmarks/prefill_step.py` ({args.rounds} rounds, medians; "
        f"{(time.time() - started) / 60:.1f} min). SmolLM2-135M-Instruct (embedded GGUF), CPU, "
        "the engine's whole steps for fresh random prompts (sampling one token each).",
        "",
        "| side, workload | ms per prompt token | prompt tokens/s |",
        "| --- | --- | --- |",
    ]
    for (label, w), values in per_token.items():
        ms = statistics.median(values)
        lines.append(f"| {label}, {w} | {ms:.3f} | {1000 / ms:.0f} |")
    lines += ["", "## Where the time goes (ms per prompt token)", ""]
    kinds = list(dict.fromkeys(k for p in parts.values() for k in p))
    lines.append("| side, workload | " + " | ".join(kinds) + " |")
    lines.append("| --- |" + " --- |" * len(kinds))
    for (label, w), by_kind in parts.items():
        cells = [f"{statistics.median(by_kind[k]):.4f}" if k in by_kind else "-" for k in kinds]
        lines.append(f"| {label}, {w} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
