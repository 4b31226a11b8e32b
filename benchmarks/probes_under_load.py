"""/health and /ready latency while heavy requests run, probed from a process of its own.

    .venv/bin/python benchmarks/probes_under_load.py   # -> benchmarks/results/probes_under_load.md

Issue 13 point 3 asks that the probes answer within 100 ms under any request mix. The test
(tests/server/test_robustness.py) checks they keep answering 200 while the heavy requests
run, but it probes from the same Python process whose threads are JSON-encoding and sending
the 3.5 MB bodies, so its timings carry the client's own GIL contention. A kubelet probes from
outside: here a separate process probes every 20 ms while the main process sends, at once, a
regex that compiles past the 2 s limit, a 3.5 MB prompt and 50,000 prompts x n=16 to the
tiny-model server the tests use (same flags). Three rounds; all probes are reported."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "server"), str(ROOT / "tests")]

from conftest import embedded_model_path  # noqa: E402
from server_process import API_KEY, TINY, TINY_FLAGS, start_server  # noqa: E402
from slow_grammar import SLOW_REGEX  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

PROBER = r"""
import httpx, json, sys, time
url, seconds = sys.argv[1], float(sys.argv[2])
out, end = [], time.monotonic() + seconds
with httpx.Client() as c:
    while time.monotonic() < end:
        for path in ("/health", "/ready"):
            t0 = time.monotonic()
            status = c.get(url + path, timeout=60).status_code
            out.append((t0, time.monotonic() - t0, path, status))
        time.sleep(0.02)
print(json.dumps(out))
"""

GOOD = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HEAVY = [
    ("slow regex", "/v1/chat/completions", {**GOOD, "regex": SLOW_REGEX}),
    ("3.5 MB prompt", "/v1/completions", {"model": TINY, "prompt": "word " * 700_000, "max_tokens": 1}),
    ("50,000 prompts x n=16", "/v1/completions", {"model": TINY, "prompt": ["hello world"] * 50_000, "n": 16}),
]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1000


def one_round(url: str, probe_seconds: float) -> dict:
    prober = subprocess.Popen([sys.executable, "-c", PROBER, url, str(probe_seconds)],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(2)  # idle probes first, for comparison
    started, ends = time.monotonic(), {}

    def send(name: str, path: str, body: dict) -> None:
        r = httpx.post(url + path, json=body, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"})
        ends[name] = (time.monotonic(), r.status_code)

    threads = [threading.Thread(target=send, args=h) for h in HEAVY]
    [t.start() for t in threads]
    [t.join() for t in threads]
    finished = max(t for t, _ in ends.values())
    probes = json.loads(prober.communicate()[0])
    idle = [d for t0, d, _, _ in probes if t0 < started]
    during = [(d, s) for t0, d, _, s in probes if started <= t0 <= finished]
    return {"statuses": {k: s for k, (_, s) in ends.items()}, "heavy_s": finished - started,
            "idle": idle, "during": [d for d, _ in during], "non_200": sum(s != 200 for _, s in during)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "probes_under_load.md")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "model").mkdir()
    (tmp / "server").mkdir()
    model = build_tiny_model(tmp / "model", "llama", tok)
    srv = start_server(tmp / "server", "--model", str(model), *TINY_FLAGS)
    load_before = os.getloadavg()[0]
    try:
        rounds = [one_round(srv.url, 12.0) for _ in range(args.rounds)]
    finally:
        srv.stop()
    rows = []
    for i, r in enumerate(rounds):
        d, idle = r["during"], r["idle"]
        rows.append(f"| {i + 1} | {', '.join(f'{k}: {s}' for k, s in r['statuses'].items())} | {r['heavy_s']:.1f} | "
                    f"{len(d)} | {r['non_200']} | {pct(d, .5):.0f} | {pct(d, .9):.0f} | {pct(d, .99):.0f} | "
                    f"{max(d) * 1000:.0f} | {pct(idle, .5):.0f} / {max(idle) * 1000:.0f} |")
    worst = max(max(r["during"]) for r in rounds) * 1000
    text = "\n".join([
        "# /health and /ready under heavy requests, probed from another process",
        "",
        f"Written by `benchmarks/probes_under_load.py` on {datetime.now():%Y-%m-%d %H:%M} "
        f"({platform.machine()}, {os.cpu_count()} CPUs, no GPU; 1-min load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after). Server: the tests' tiny-model server (`TINY_FLAGS`: 2 s grammar "
        "compile limit, 1024 prompt tokens per request, queue 32). Each round sends the three heavy requests "
        "at once while a separate process probes `/health` and `/ready` every 20 ms.",
        "",
        "| round | heavy requests (status) | heavy s | probes during | non-200 | p50 ms | p90 ms | p99 ms | max ms | idle p50 / max ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Goal (issue 13 point 3): every probe within 100 ms — **{'met' if worst < 100 else 'NOT met'}** "
        f"(slowest {worst:.0f} ms over {sum(len(r['during']) for r in rounds)} probes).",
        "",
        "The same mix probed from inside the sending process (the test's printout) shows slower "
        "probes: those timings include the client's own threads holding its GIL while they encode "
        "and send the large bodies, which a kubelet's probe does not share.",
        "",
    ])
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
