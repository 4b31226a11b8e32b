"""A fresh replica's first load: KV pages faulted on first write vs given memory while idle.

    .venv/bin/python benchmarks/kv_prefault.py            # writes benchmarks/results/kv_prefault.md

Starts `preheat serve` (the embedded GGUF, its defaults, the same KV budget as
serving_vs_peers.py) with `--kv-prefault-mib 0` and with the default, one at a time,
alternating by round; each is warmed with two short requests, left idle 5 s (a replica
between /ready and its traffic), then measured with guidellm: serving_vs_peers.py's plain
workload (256-token prompts, 64 output tokens) at 8 streams, 32 requests, every prompt
writing pages its pool never used before (the radix cache keeps what earlier requests wrote).
The difference is what engine/kv/prefault.py moves out of the prompts: each 4 KiB page's first
touch, which the compute threads otherwise take inside the RoPE + KV write.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_vs_peers as peers

RESULTS = Path(__file__).resolve().parent / "results"
SIDES = {"faulted (--kv-prefault-mib 0)": ["--kv-prefault-mib", "0"], "populated while idle (default)": []}
STREAMS, REQUESTS, IDLE_S = 8, 32, 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "kv_prefault.md"))
    args = parser.parse_args(argv)
    workdir = Path(tempfile.gettempdir()) / "preheat-kv-prefault"
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = peers.prepare_model_dir(Path(tempfile.gettempdir()) / "preheat-serving-vs-peers" / "smollm2-bf16")
    workload = next(w for w in peers.FULL.workloads if w.name == "plain")
    kv_tokens = peers.kv_budget(peers.FULL)
    port = peers.free_port()
    base = peers.servers(model_dir, port, workload.output_tokens, kv_tokens, [peers.GGUF_DEFAULT])[0]
    results: dict[str, list[peers.Result]] = {name: [] for name in SIDES}
    for r in range(args.rounds):
        for name in SIDES if r % 2 == 0 else list(reversed(SIDES)):
            server = peers.Server(name, [*base.argv, *SIDES[name]], base.ready_path, base.body)
            running = peers.Running(server, port, workdir / f"{r}-{'off' if SIDES[name] else 'on'}.log")
            try:
                running.wait_ready()
                running.warm(16)
                time.sleep(IDLE_S)
                report = peers.run_guidellm(server, running.url, model_dir, workload, STREAMS, REQUESTS, workdir)
                results[name].append(peers.parse_report(report, name, workload.name, STREAMS, r))
                res = results[name][-1]
                print(f"[round {r + 1}] {name}: {res.output_tps:.1f} tok/s, TTFT p50 {res.ttft_p50:.0f} ms, "
                      f"ITL p50 {res.itl_p50:.1f} ms", flush=True)
            finally:
                running.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(getattr(x, key) for x in results[name])

    off = next(iter(SIDES))
    lines = [
        "# A fresh replica's first load: KV pages faulted on first write vs given memory while idle",
        "",
        f"Written by `benchmarks/kv_prefault.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"`preheat serve` (the embedded GGUF, defaults, a {kv_tokens:,}-token KV pool), warmed, idle "
        f"{IDLE_S:.0f} s, then guidellm: {workload.prompt_tokens}-token prompts, {workload.output_tokens} "
        f"output tokens, {STREAMS} streams, {REQUESTS} requests (the client of serving_vs_peers.py); "
        f"{args.rounds} rounds alternating, medians.",
        "",
        "| server | output tok/s | x faulted | TTFT p50 ms | ITL p50 ms | ITL p99 ms | per round ITL p50 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name in SIDES:
        tps = med(name, "output_tps")
        rounds = ", ".join(f"{x.itl_p50:.1f}" for x in results[name])
        lines.append(f"| {name} | {tps:.1f} | {tps / med(off, 'output_tps'):.2f} | {med(name, 'ttft_p50'):.0f} | "
                     f"{med(name, 'itl_p50'):.1f} | {med(name, 'itl_p99'):.1f} | {rounds} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
