"""Load test: N concurrent clients stream chat completions until a fixed count is done.

    python benchmarks/load_test.py                       # starts its own `preheat serve`
    python benchmarks/load_test.py --url http://host:8000 --model NAME

Reports requests/s, output tokens/s, TTFT / TPOT / end-to-end percentiles and errors (a
non-200, a broken stream, a missing `data: [DONE]` or usage) into benchmarks/results/.
Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in one paragraph.",
    "Write a haiku about autumn.",
    "What is 17 times 23?",
    "Name a few uses of Kubernetes.",
    "Summarise the plot of Romeo and Juliet.",
    "How do I make a cup of tea?",
]
SYSTEM = "You are a concise, helpful assistant."


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0


async def one_request(client: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage = None
    done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"]))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                    ttft = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Result(False, error=repr(e))
    e2e = time.perf_counter() - start
    if not done or usage is None:
        return Result(False, error="stream ended without usage or [DONE]")
    return Result(True, ttft if ttft is not None else e2e, e2e, usage["completion_tokens"])


async def run_load(url: str, model: str, api_key: str | None, clients: int, total: int,
                   max_tokens: int) -> Run:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    run = Run()
    counter = iter(range(total))
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600.0)) as client:

        async def worker() -> None:
            for i in counter:  # a shared iterator: the clients together send exactly `total`
                run.results.append(await one_request(client, model, i, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        run.wall = time.perf_counter() - start
    return run


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def report(run: Run, args: argparse.Namespace, server_flags: list[str]) -> str:
    ok = [r for r in run.results if r.ok]
    errors = [r for r in run.results if not r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    e2e = [r.e2e for r in ok]
    tokens = sum(r.output_tokens for r in ok)

    def row(name: str, vals: list[float], scale: float = 1000.0) -> str:
        cells = [pct(vals, p) * scale for p in (50, 90, 99)]
        mean = statistics.fmean(vals) * scale if vals else float("nan")
        return f"| {name} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.1f} | {mean:.1f} |"

    lines = [
        "# Load test: `preheat serve`",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        f"- server: {args.url or 'started by this script'}"
        + (f" (`preheat serve {' '.join(server_flags)}`)" if server_flags else ""),
        f"- load: {args.clients} concurrent clients, {args.requests} streamed chat completions, "
        f"max_tokens {args.max_tokens}, temperature 0.7",
        f"- command: `python benchmarks/load_test.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        "| result | value |",
        "| --- | --- |",
        f"| requests completed | {len(ok)} |",
        f"| errors | {len(errors)} |",
        f"| wall time | {run.wall:.1f} s |",
        f"| requests/s | {len(ok) / run.wall:.2f} |",
        f"| output tokens/s | {tokens / run.wall:.1f} |",
        f"| mean output tokens / request | {tokens / max(1, len(ok)):.1f} |",
        "",
        "| latency (ms) | p50 | p90 | p99 | mean |",
        "| --- | --- | --- | --- | --- |",
        row("time to first token", ttft),
        row("time per output token", tpot),
        row("end to end", e2e),
    ]
    if errors:
        lines += ["", "Errors (first 5):", ""] + [f"- {r.error}" for r in errors[:5]]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "preheat", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *flags], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    poller = httpx.Client(timeout=2)  # one client: httpx.get costs ~20 ms of CPU a call
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if poller.get(url + "/ready").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 300 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server; default: start `preheat serve` here")
    ap.add_argument("--model", help="model name (default: the first of /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--server-flags", default="--max-num-seqs 64 --max-model-len 1024",
                    help="flags for the server this script starts")
    ap.add_argument("--out", type=Path, default=RESULTS / "load_test.md")
    args = ap.parse_args(argv)

    proc = None
    server_flags: list[str] = []
    url = args.url
    if url is None:
        server_flags = args.server_flags.split()
        proc, url = start_server(server_flags)
    try:
        model = args.model
        if model is None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        run = asyncio.run(run_load(url, model, args.api_key, args.clients, args.requests,
                                   args.max_tokens))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    text = report(run, args, server_flags)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0 if all(r.ok for r in run.results) and len(run.results) == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
