"""Two builds' decode steps and chat throughput, taking turns every second in one sitting.

benchmarks/before_after.py alternates whole benchmark runs (a fresh process each, minutes
apart); on a shared 2-core machine the runs of one build spread by 16-22%, so a change
within ±5% cannot be told from noise that way. Here each build runs in one long-lived
process (benchmarks/step_worker.py, under that build's worktree) and the two take turns
on the same work every round — a batch of decode steps, or a small multi-turn chat — each
idle while the other runs. A round's ratio (after / before) compares work done seconds
apart, so the machine's drift cancels. Which process started first matters too (up to 9%
here in a memory-bound step, whichever build it held), so every configuration runs in two
sessions, each build's process started first once, and the report combines the sessions'
median ratios by their geometric mean, with a bootstrap 95% interval.

    python benchmarks/before_after_steps.py --before 61b47be --after 55dde60 \\
        --out benchmarks/results/layout_refactor_steps.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before_after import checkout

WORKER = Path(__file__).resolve().parent / "step_worker.py"


@dataclass
class Config:
    name: str
    llm: dict
    op: dict
    # per round: one figure per side (lower is better for "ms", higher for "tok/s" and "prompt tok/s")
    unit: str


@dataclass
class Result:
    """Per session (0: the before build's process started first, 1: the after build's), the
    rounds' figures of each side."""

    config: Config
    before: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    after: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))

    def ratios(self, session: int) -> list[float]:
        return [a / b for a, b in zip(self.after[session], self.before[session])]

    def estimate(self) -> float:
        return balanced(self.ratios(0), self.ratios(1))


class Worker:
    """One build's step_worker.py, started once; `ask` sends a command and waits."""

    def __init__(self, rev: str, workdir: Path, llm: dict, threads: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(workdir / f"pkg-{rev}"))
        self.rev = rev
        self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps({"llm": llm, "threads": threads})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=workdir / f"tree-{rev}")
        self._read()  # {"ready": true}

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"{self.rev}: worker exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def figure(config: Config, answer: dict) -> float:
    if config.unit == "ms":
        return statistics.median(answer["step_ms"])
    if config.unit == "prompt tok/s":
        return answer["prompt_tokens"] / answer["seconds"]
    return answer["generated"] / answer["seconds"]


def balanced(first: list[float], second: list[float]) -> float:
    """The after/before ratio with the start order cancelled: the geometric mean of the two
    sessions' median ratios. A process started first ran up to 9% slower or faster here in
    a memory-bound configuration whichever build it held (where its memory lies), a factor
    that multiplies one session's ratio and divides the other's."""
    return math.sqrt(statistics.median(first) * statistics.median(second))


def interval(first: list[float], second: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% interval of `balanced`, resampling the rounds of each session."""
    rng = random.Random(seed)
    values = sorted(balanced(rng.choices(first, k=len(first)), rng.choices(second, k=len(second)))
                    for _ in range(draws))
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def run_session(configs: list[Config], results: dict[str, Result], session: int, args: argparse.Namespace) -> None:
    """One pair of worker processes, started in the session's order, through every config."""
    first, second = (args.before, args.after) if session == 0 else (args.after, args.before)
    workers = {rev: Worker(rev, args.workdir, configs[0].llm, args.threads) for rev in (first, second)}
    try:
        for config in configs:
            res = results[config.name]
            for w in workers.values():  # first-time costs (kernels, caches, shapes) on both, untimed
                w.ask({**config.op, "salt": -1})
            for r in range(args.rounds):
                for rev in ((first, second) if r % 2 == 0 else (second, first)):
                    value = figure(config, workers[rev].ask({**config.op, "salt": r}))
                    (res.before if rev == args.before else res.after)[session].append(value)
    finally:
        for w in workers.values():
            w.close()


def measure(configs: list[Config], args: argparse.Namespace) -> list[Result]:
    """Configurations that share one engine setting, in two sessions: the before build's
    process started first, then the after build's."""
    results = {c.name: Result(c) for c in configs}
    for session in (0, 1):
        run_session(configs, results, session, args)
    for res in results.values():
        lo, hi = interval(res.ratios(0), res.ratios(1))
        print(f"{res.config.name}: after/before {res.estimate():.3f} [{lo:.3f}, {hi:.3f}] (sessions "
              f"{statistics.median(res.ratios(0)):.3f}, {statistics.median(res.ratios(1)):.3f})", flush=True)
    return list(results.values())


# The engine settings a run can compare, on the embedded model (a Q4_1 GGUF). "bf16" asks for
# `quantization="none"` (the GGUF dequantised: the bf16 kernels); builds from before
# `--quantization auto` refuse "none" and serve --dtype when it is unset (step_worker.py
# falls back), while since then an unset quantization reads the GGUF's blocks in place, so
# "bf16" must say "none". "int8" is `quantization="int8"`: on a GGUF, its Q4_1 / Q8_0 blocks
# in place on every build (today's default for a GGUF).
SETTINGS: dict[str, tuple[str, dict]] = {
    "bf16": ("bf16", {"dtype": "bfloat16", "quantization": "none"}),
    "int8": ("int8 (the GGUF's blocks in place)", {"dtype": "bfloat16", "quantization": "int8"}),
    "bf16-fp8-kv": ("bf16, fp8 KV cache", {"dtype": "bfloat16", "quantization": "none", "kv_cache_dtype": "fp8"}),
}


def configs(args: argparse.Namespace) -> list[list[Config]]:
    """Per engine setting (SETTINGS), its configurations."""
    out = []
    for key in args.settings:
        label, llm = SETTINGS[key]
        group = [Config(f"decode step, {label}, batch {batch}", llm,
                        {"op": "decode", "batch": batch, "context": args.context, "steps": args.steps}, "ms")
                 for batch in args.batches]
        if args.prompts:
            group.append(Config(f"prompts, {label}, {args.prompts} x {args.context} tokens", llm,
                                {"op": "prompts", "batch": args.prompts, "context": args.context}, "prompt tok/s"))
        if args.chat:
            group.append(Config(f"multi-turn chat, {label}", llm,
                                {"op": "chat", "conversations": 8, "turns": 3, "system": 300, "tokens": 32}, "tok/s"))
        out.append(group)
    return out


def report(results: list[Result], args: argparse.Namespace, loads: list[float], wall: float) -> str:
    rows = []
    met = 0
    for res in results:
        med = res.estimate()
        lo, hi = interval(res.ratios(0), res.ratios(1))
        inside = 1 - args.tolerance <= lo and hi <= 1 + args.tolerance
        met += inside
        both = [x for session in (0, 1) for x in res.before[session]], [x for session in (0, 1) for x in res.after[session]]
        rows.append(f"| {res.config.name} | {res.config.unit} | {statistics.median(both[0]):.2f} | "
                    f"{statistics.median(both[1]):.2f} | {statistics.median(res.ratios(0)):.3f} | "
                    f"{statistics.median(res.ratios(1)):.3f} | **{med:.3f}** | [{lo:.3f}, {hi:.3f}] | "
                    f"{'yes' if inside else 'no'} |")
    return f"""# Before / after, turn by turn: `{args.before}` vs `{args.after}`

Written by `benchmarks/before_after_steps.py` on {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
({wall / 60:.1f} min). **before** = {args.before}, **after** = {args.after}{args.note}. Each build runs in one
long-lived process of its own worktree (`benchmarks/step_worker.py`: the public `LLM` and the
engine's `step()`), and the two take turns on the same work every round, alternating which
goes first, each idle while the other runs; {args.rounds} rounds per configuration after one
untimed round each, in two sessions: the before build's process started first, then (new
processes) the after build's. Embedded SmolLM2-135M-Instruct, {args.threads} torch threads, 2-core CPU.

- **decode step**: a batch of prompts of {args.context} random token ids (the same on both
  sides), {args.steps} greedy decode steps each timed alone (prefill untimed); the round's
  figure is the median step (ms; lower is better).
- **multi-turn chat**: engine_vs_hf's workload in miniature: 8 conversations, one shared
  300-token system prompt, 3 turns of 32 generated tokens, each turn's prompt the history
  (served from the prefix cache); the figure is generated tokens/s (higher is better).
- **prompts** (with `--prompts B`): B prompts of {args.context} fresh random token ids at once
  (nothing cached), one token each, as a serving workload's arrivals; the figure is prompt
  tokens/s (higher is better).

Ratio = after / before per round (work done seconds apart), its median per session, and the
two sessions combined by their geometric mean, which cancels the start order: in a
memory-bound configuration the process started first ran up to 9% slower here whichever
build it held (the session columns show it), a factor that multiplies one session's ratio
and divides the other's. Bootstrap 95% interval over the rounds of each session. Goal (issue 26 item 6): within ±{args.tolerance:.0%}, i.e. the interval inside
[{1 - args.tolerance:.2f}, {1 + args.tolerance:.2f}]: **{met} of {len(results)}** configurations.
1-minute load average after each engine setting: {", ".join(f"{x:.2f}" for x in loads)}.

| configuration | unit | before (median) | after (median) | after / before, before started first | after started first | after / before | 95% interval | within ±{args.tolerance:.0%} |
| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |
{chr(10).join(rows)}
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per configuration and session")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["bf16", "int8"])
    ap.add_argument("--no-chat", dest="chat", action="store_false", help="decode steps only")
    ap.add_argument("--prompts", type=int, default=0, metavar="B",
                    help="also B fresh prompts of --context tokens at once, one token each (prompt tokens/s)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per round and side")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--note", default="", help="appended to the line naming the revisions")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "preheat-before-after")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    for rev in (args.before, args.after):
        checkout(rev, args.workdir)
    started = time.monotonic()
    results, loads = [], []
    for group in configs(args):
        results += measure(group, args)
        loads.append(os.getloadavg()[0])
    text = report(results, args, loads, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
