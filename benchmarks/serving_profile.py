"""Where a served stream's time goes: py-spy over `preheat serve` under N concurrent streams.

Starts `preheat serve` (the embedded GGUF, its default configuration, plus any flags after
`--`), warms it, then keeps `--streams` streamed chat completions running (the real `openai`
client, ignore_eos, fixed length) while `py-spy record --threads --idle` samples the server
for `--seconds`. Every sample is one thread's stack at one instant; they are bucketed by
thread (the engine's step thread, the event loop's thread, others) and, within a thread, by
the innermost frame of ours or of a library that says what it was doing (the forward pass,
sampling, scheduling, detokenizing, SSE framing and JSON, the HTTP server, waiting). The
client-side ITL p50 is reported beside it: the step thread's busy share tells how much of
an inter-token gap is the step and how much the path around it.

    python benchmarks/serving_profile.py [--streams 8] [--seconds 15] [-- --quantization int8]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PY_SPY = Path(sys.executable).parent / "py-spy"

# (category, substrings of a frame "function (file)") — the first match from the innermost
# frame outwards names the sample.
CATEGORIES = [
    ("waiting (nothing to run, locks, epoll)", ("select (selectors", "wait (threading", "_worker (concurrent", "epoll",
                                      "acquire", "run_once (asyncio/base_events.py)", "sleep")),
    ("forward pass: model", ("decoder.py", "layers.py", "kernels/", "runner.py")),
    ("sampling", ("sample/",)),
    ("scheduling and KV bookkeeping", ("sched/", "kv/")),
    ("detokenizing", ("detokenizer", "tokenizers", "decode (transformers")),
    ("SSE framing, JSON, pydantic", ("api/", "json", "pydantic", "sse")),
    ("HTTP server (uvicorn, starlette)", ("uvicorn", "starlette", "h11", "httptools")),
    ("engine client and dispatch", ("async_engine.py", "engine.py")),
    ("event loop machinery (asyncio)", ("asyncio",)),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def category(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost last in py-spy's raw format
        for name, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return name
    return "other"


def parse_raw(path: Path) -> dict[str, collections.Counter]:
    """py-spy's raw (collapsed) output -> per thread, samples per category."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text:
            continue
        frames = stack_text.split(";")
        thread = frames[0]
        if "engine-step" in thread:
            thread = "engine-step (the step thread)"
        elif "MainThread" in thread:
            thread = "MainThread (the event loop)"
        else:
            thread = "other threads"
        out[thread][category(frames[1:])] += int(count)
    return out


async def load(url: str, model: str, streams: int, max_tokens: int, stop_at: float, gaps: list[float]) -> int:
    prompt = "Summarize the history of the lighthouse at the harbour, with dates and names. " * 12
    done = 0
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        async def one_stream(i: int) -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"{i}: {prompt}"}], max_tokens=max_tokens,
                    temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
                last = None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                done += 1

        await asyncio.gather(*(one_stream(i) for i in range(streams)))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=RESULTS / "serving_profile.md")
    ap.add_argument("server_flags", nargs="*")
    args = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="serving-profile-"))
    argv_server = [sys.executable, "-m", "preheat", "serve", "--port", str(port), "--host", "127.0.0.1",
                   "--log-level", "warning", *args.server_flags]  # fmt: skip
    log = open(work / "server.log", "w")
    server = subprocess.Popen(argv_server, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        poller = httpx.Client(timeout=2)  # one client: httpx.get costs ~20 ms of CPU a call
        while True:
            try:
                if poller.get(url + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready; see {work / 'server.log'}")
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        warm_gaps: list[float] = []
        asyncio.run(load(url, model, args.streams, args.max_tokens, time.monotonic() + 3, warm_gaps))
        raw = work / "profile.txt"
        spy = subprocess.Popen([str(PY_SPY), "record", "--pid", str(server.pid), "--threads", "--idle",
                                "--format", "raw", "--rate", "200", "--duration", str(int(args.seconds)),
                                "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        gaps: list[float] = []
        requests = asyncio.run(load(url, model, args.streams, args.max_tokens, time.monotonic() + args.seconds, gaps))
        spy.wait(timeout=120)
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
        log.close()
    threads = parse_raw(raw)
    flags = " ".join(args.server_flags) or "(defaults: the embedded Q4_1 GGUF from its blocks)"
    lines = [
        "# Where a served stream's time goes (py-spy over `preheat serve`)",
        "",
        f"Written by `benchmarks/serving_profile.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        f"`preheat serve {flags}`, {args.streams} concurrent streamed chat completions ({args.max_tokens} tokens "
        f"each, ~170-token prompts, greedy, ignore_eos) for {args.seconds:.0f} s, {requests} requests; "
        f"py-spy sampling every thread at 200 Hz, idle included. 1-minute load at the end: "
        f"{os.getloadavg()[0]:.1f} (2 cores; the client runs on the same machine).",
        "",
        f"Client-side inter-token gap: p50 {statistics.median(gaps) * 1e3:.1f} ms, "
        f"p90 {statistics.quantiles(gaps, n=10)[-1] * 1e3:.1f} ms ({len(gaps)} gaps).",
        "",
    ]
    for thread, counts in sorted(threads.items()):
        total = sum(counts.values())
        lines += [f"## {thread}: {total} samples", "", "| what | share |", "| --- | ---: |"]
        lines += [f"| {name} | {n / total:.0%} |" for name, n in counts.most_common()]
        lines.append("")
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
