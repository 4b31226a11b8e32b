"""This machine's memory bandwidth, measured in the benchmark's own run, and the floor it sets
on a decode step.

A decode step at small batch is memory-bound: it reads every weight matrix once (the LM
head once, also when it is the tied embedding) plus the KV cache of every sequence in the
batch, and computes little per byte. So no step can be faster than those bytes divided by
the rate the machine moves bytes: the *floor*. Measuring the rate in the same run as the
step (rather than quoting a data sheet) keeps the ratio honest on a shared machine, where
other work takes bandwidth too.

STREAM-style kernels over arrays far larger than the last-level cache, best of a few
repetitions (STREAM reports the best): copy (b = a: one read, one write), triad
(a = b + s * c: two reads, one write) and read (sum(a): reads only, as a decode step's
weight traffic is), each at 1 thread and at the engine's thread count. The floor uses the
fastest rate seen at the thread count the step ran with: the strictest floor.

    python benchmarks/bandwidth.py [--mib 128] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass

import torch


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as the kernel reports it, for result headers: the same benchmark
    moves with the host (vdpbf16ps, AMX, memory rate). A VM's name may be generic ("AMD
    EPYC"), so the core is named from the family and flags where they tell it (see `core_of`)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown CPU")
    core = core_of(fields.get("vendor_id", ""), fields.get("cpu family", ""), set(fields.get("flags", "").split()))
    return f"{name} ({core})" if core else name


def core_of(vendor: str, family: str, flags: set[str]) -> str:
    """The core generation where family and flags settle it: AMD family 26 is Zen 5, family 25
    with AVX-512 is Zen 4 (Zen 3 has none); Intel with AMX tiles is Sapphire Rapids or later.
    Zen 4 runs 512-bit dot products at half Zen 5's rate (benchmarks/dot_product_rate.py)."""
    if vendor == "AuthenticAMD" and family == "26":
        return "Zen 5"
    if vendor == "AuthenticAMD" and family == "25" and "avx512f" in flags:
        return "Zen 4"
    if vendor == "GenuineIntel" and "amx_bf16" in flags:
        return "AMX-BF16"
    return ""


@dataclass(frozen=True)
class Bandwidth:
    """GB/s (10^9 bytes per second) of each kernel at one thread count."""

    threads: int
    copy: float
    triad: float
    read: float

    @property
    def best(self) -> float:
        return max(self.copy, self.triad, self.read)


@contextlib.contextmanager
def num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # first touch / warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(threads: int, mib: int = 128, repeats: int = 5) -> Bandwidth:
    """copy / triad / read bandwidth at `threads` threads over float32 arrays of `mib` MiB
    each (three of them for triad)."""
    n = mib * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.full((n,), 2.0, dtype=torch.float32)
    c = torch.full((n,), 0.5, dtype=torch.float32)
    size = n * 4
    with num_threads(threads), torch.inference_mode():
        copy = _best_seconds(lambda: b.copy_(a), repeats)
        triad = _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
        read = _best_seconds(lambda: a.sum(), repeats)
    return Bandwidth(threads, 2 * size / copy / 1e9, 3 * size / triad / 1e9, size / read / 1e9)


def measure_all(thread_counts: list[int], mib: int = 128, repeats: int = 5) -> dict[int, Bandwidth]:
    return {t: measure(t, mib, repeats) for t in sorted(set(thread_counts))}


def read_gbps() -> float:
    """Read bandwidth at torch's thread count (what engine_vs_hf's batch-1 limit divides by)."""
    return measure(torch.get_num_threads()).read


def floor_ms(step_bytes: int, gbps: float) -> float:
    """The fastest a step that moves `step_bytes` can be at `gbps`."""
    return step_bytes / (gbps * 1e9) * 1000


def table(results: dict[int, Bandwidth]) -> list[str]:
    lines = ["| threads | copy GB/s | triad GB/s | read (sum) GB/s |", "| --- | --- | --- | --- |"]
    for t, bw in results.items():
        lines.append(f"| {t} | {bw.copy:.1f} | {bw.triad:.1f} | {bw.read:.1f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--mib", type=int, default=128)
    args = ap.parse_args()
    print("\n".join(table(measure_all(args.threads, args.mib))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
