"""Client traffic for the chaos scenario: `clients` concurrent users, each with its own
`openai` SDK client (its own kept-alive connections, as a real client has), sending
streamed chat completions one after the other through the Service.

A request that fails before its first token (connection refused or reset, a 503 from a
draining engine, no first token within FIRST_TOKEN_TIMEOUT_S) is retried, up to
MAX_ATTEMPTS attempts RETRY_BACKOFF_S, then twice as long, apart — what the openai SDK's own
retries and a gateway's per-try timeout do. A request that fails after tokens arrived cannot
be retried unseen: it is a failure the user saw.

It runs as a process of its own (TrafficProcess; `python -m e2e.traffic`), writing one JSON
line per finished request; times are time.monotonic(), which is one clock for every process
on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

FIRST_TOKEN_TIMEOUT_S = 8.0
TOTAL_TIMEOUT_S = 30.0
MAX_ATTEMPTS = 4
RETRY_BACKOFF_S = 0.5
SYSTEM = "You are a concise support assistant for an online store."
QUESTIONS = ["Where is my order?", "Can I return shoes?", "Do you ship abroad?",
             "How long does delivery take?", "Is there a discount for students?"]


@dataclass
class RequestRecord:
    client: int
    start: float
    end: float
    ttft: float | None  # from the request's start (retries included) to its first token
    attempts: int
    ok: bool
    error: str = ""
    # The response (its headers) reached the client: through the router, which holds the
    # headers until the engine's first body chunk, that means bytes did.
    responded: bool = False


async def one_request(client: Any, model: str, i: int, question: str,
                      max_tokens: int, attempts: int = MAX_ATTEMPTS) -> RequestRecord:
    """attempts 1: the client's own retries off (the router retries for it)."""
    start = time.monotonic()
    error = ""
    responded = False
    for attempt in range(1, attempts + 1):
        got_token = False
        ttft: float | None = None
        stream = None
        attempt_start = time.monotonic()
        try:
            stream = await asyncio.wait_for(client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0, stream=True,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}]), FIRST_TOKEN_TIMEOUT_S)
            responded = True
            it = stream.__aiter__()
            while True:
                wait = FIRST_TOKEN_TIMEOUT_S if not got_token else \
                    max(0.1, attempt_start + TOTAL_TIMEOUT_S - time.monotonic())
                try:
                    chunk = await asyncio.wait_for(it.__anext__(), wait)
                except StopAsyncIteration:
                    break
                if not got_token and any(c.delta.content for c in chunk.choices):
                    got_token, ttft = True, time.monotonic() - start
            if not got_token:
                raise RuntimeError("stream ended without a token")
            return RequestRecord(i, start, time.monotonic(), ttft, attempt, True, responded=True)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:200]
            if got_token:  # tokens reached the user: no unseen retry is possible
                return RequestRecord(i, start, time.monotonic(), ttft, attempt, False, error, True)
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.close()
        if attempt < attempts:
            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
    return RequestRecord(i, start, time.monotonic(), None, attempts, False, error, responded)


async def run_clients(base_url: str, model: str, clients: int, max_tokens: int,
                      out: TextIO, stop: asyncio.Event, attempts: int = MAX_ATTEMPTS) -> None:
    from openai import AsyncOpenAI, Timeout

    async def user(i: int) -> None:
        # openai's own Timeout: the client's HTTP library (httpx, httpx2 from openai 3.x) refuses another's.
        client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=Timeout(TOTAL_TIMEOUT_S, connect=2.0))
        n = 0
        try:
            while not stop.is_set():
                n += 1
                rec = await one_request(client, model, i, QUESTIONS[(i + n) % len(QUESTIONS)],
                                        max_tokens, attempts)
                out.write(json.dumps(asdict(rec)) + "\n")
                out.flush()
                await asyncio.sleep(0.05)
        finally:
            await client.close()

    await asyncio.gather(*(user(i) for i in range(clients)))


class TrafficProcess:
    """Runs the clients in a child process; records() reads what has finished so far."""

    def __init__(self, base_url: str, model: str, clients: int, path: Path,
                 max_tokens: int = 8, attempts: int = MAX_ATTEMPTS) -> None:
        self.args = ["--url", base_url, "--model", model, "--clients", str(clients),
                     "--max-tokens", str(max_tokens), "--out", str(path),
                     "--attempts", str(attempts)]
        self.path = path
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> TrafficProcess:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "e2e.traffic", *self.args,
            cwd=str(Path(__file__).resolve().parents[1]), stdin=asyncio.subprocess.DEVNULL)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)  # finish what is in flight, then exit
            try:
                await asyncio.wait_for(self.proc.wait(), TOTAL_TIMEOUT_S * 2)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def records(self) -> list[RequestRecord]:
        out = []
        for line in self.path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(RequestRecord(**json.loads(line)))
        return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.traffic")
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--attempts", type=int, default=MAX_ATTEMPTS,
                   help="1: no retries of the client's own (behind the router)")
    a = p.parse_args(argv)

    async def go() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        with open(a.out, "a") as out:
            await run_clients(a.url, a.model, a.clients, a.max_tokens, out, stop, a.attempts)
    asyncio.run(go())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
