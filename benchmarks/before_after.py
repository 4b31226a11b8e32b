"""One benchmark, two builds, alternating in one run: did a change move its figures?

Each build is a git revision checked out into a worktree of its own (outside the repo); its
packages are reached through a folder of symlinks (`preheat` -> cli/, `preheat.engine` ->
engine/, ...) put first on PYTHONPATH, so each side runs its own code and its own copy of
the benchmark script, in a fresh process, with this checkout's virtual environment. Sides
alternate before, after, after, before, ... so drift of the machine (other work, thermal)
hits both alike; every figure is the median over a side's runs.

Figures are read from the markdown tables the benchmark writes: every numeric cell, keyed
by (section heading, row label, column header). Only cells both builds report are compared.

    python benchmarks/before_after.py --before 61b47be --after 55dde60 \
        --bench "benchmarks/engine_vs_hf.py --repeats 1" --rounds 2 \
        --out benchmarks/results/layout_refactor_before_after.md
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = {"engine": "engine", "operator": "operator", "router": "router"}  # setup.py's PROGRAM_DIRS, less cli
Key = tuple[str, str, str]


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str, root: Path) -> Path:
    """A worktree of `rev` under root, and a package folder that maps `preheat` onto it."""
    tree = root / f"tree-{rev}"
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if not tree.exists():
        git("worktree", "add", "--detach", str(tree), commit)
    elif git("rev-parse", "HEAD", cwd=tree) != commit:
        # A name like HEAD or a branch moves: a tree left by an earlier run under the same
        # name would otherwise measure whatever it pointed at then.
        git("checkout", "--detach", "--force", "-q", commit, cwd=tree)
    pkg = root / f"pkg-{rev}" / "preheat"
    pkg.mkdir(parents=True, exist_ok=True)
    for f in (tree / "cli").iterdir():
        if f.suffix == ".py" and not (pkg / f.name).exists():
            (pkg / f.name).symlink_to(f)
    for name, folder in PROGRAMS.items():
        if (tree / folder).is_dir() and not (pkg / name).exists():
            (pkg / name).symlink_to(tree / folder)
    return tree


def numbers(markdown: str) -> dict[Key, float]:
    """Every numeric table cell: (heading, row label, column) -> value."""
    out: dict[Key, float] = {}
    heading, header = "", []
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading, header = line.lstrip("# ").strip(), []
            continue
        if not line.startswith("|"):
            header = [] if not line.strip() else header
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        for column, cell in zip(header[1:], cells[1:]):
            m = re.fullmatch(r"\*{0,2}(-?\d+(?:\.\d+)?)\*{0,2}x?", cell)
            if m:
                out[(heading, cells[0], column)] = float(m.group(1))
    return out


def run_side(rev: str, tree: Path, root: Path, bench: list[str], out: Path) -> dict[Key, float]:
    env = dict(os.environ, PYTHONPATH=str(root / f"pkg-{rev}"))
    cmd = [sys.executable, str(tree / bench[0]), *bench[1:], "--out", str(out)]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{rev}: {shlex.join(cmd)} exited {done.returncode}\n{done.stderr[-3000:]}")
    print(f"  {rev}: {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    return numbers(out.read_text())


def report(args: argparse.Namespace, runs: dict[str, list[dict[Key, float]]], loads: list[float]) -> str:
    before, after = runs[args.before], runs[args.after]
    keys = [k for k in before[0] if all(k in r for r in before + after)]
    rows, ratios = [], []
    for key in keys:
        b = statistics.median(r[key] for r in before)
        a = statistics.median(r[key] for r in after)
        ratio = a / b if b else float("nan")
        if b:
            ratios.append(ratio)
        heading, label, column = key
        rows.append(f"| {heading[:48]} | {label} | {column} | {b:g} | {a:g} | {ratio:.3f} |")
    within = sum(1 for r in ratios if abs(r - 1) <= args.tolerance)
    return f"""# Before / after: `{args.bench}`

Built by `benchmarks/before_after.py`: **before** = {args.before}, **after** = {args.after}, each
its own worktree and its own copy of the benchmark, {args.rounds} runs each in one sitting,
alternating (before, after, after, before, ...); every figure the median of a side's runs.
1-minute load average after each run: {", ".join(f"{x:.2f}" for x in loads)} (2 cores).
{args.note}

Within ±{args.tolerance:.0%}: **{within} of {len(ratios)}** figures. Ratios are after / before
(for a time lower is better, for a rate higher is better).

| section | row | column | before | after | after / before |
| --- | --- | --- | ---: | ---: | ---: |
{chr(10).join(rows)}
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision of the before build")
    ap.add_argument("--after", required=True, help="git revision of the after build")
    ap.add_argument("--bench", required=True, help="benchmark script (repo-relative) and its arguments; --out is added")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--note", default="", help="a line for the report (what the revisions are)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "preheat-before-after")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    bench = shlex.split(args.bench)
    trees = {rev: checkout(rev, args.workdir) for rev in (args.before, args.after)}
    order = [args.before, args.after, args.after, args.before] * ((args.rounds + 1) // 2)
    order = order[: 2 * args.rounds]
    runs: dict[str, list[dict[Key, float]]] = defaultdict(list)
    loads: list[float] = []
    for i, rev in enumerate(order):
        print(f"run {i + 1}/{len(order)}", flush=True)
        runs[rev].append(run_side(rev, trees[rev], args.workdir, bench, args.workdir / f"out-{rev}-{i}.md"))
        loads.append(os.getloadavg()[0])
    text = report(args, runs, loads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
