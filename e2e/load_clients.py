"""Streaming chat clients as a process of their own, sending through the Service.

    python -m e2e.load_clients --url SERVICE_URL --service NAME --clients N --out FILE

Why a separate process: the local harness runs the API emulator and the kubelet (its
probes!) in the test's event loop. Clients that parse token streams in that same loop
delay both: probes time out and pods look unready, the operator's calls wait — the harness
would measure itself. Here the clients run apart, like users outside the cluster.

They reach the pods only through the Service's URL: on the local harness that is the ONE
Service stand-in, e2e/service_proxy.py (HARNESS code: ready `role=serving` pods only,
balanced per connection like kube-proxy). Each request opens a connection of its own —
many users coming and going, each request a new connection — so the Service spreads
requests over its endpoints as they change (a kept-alive connection would stay on the pod
it first reached, which is how kube-proxy balances, and is what e2e/traffic.py models).

It prints `started <monotonic>` once the clients run. SIGTERM: no new requests, the ones in
flight finish, and the results go to --out as JSON (time.monotonic() is system-wide on
Linux, so the parent can compare times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class Load:
    """What the clients saw: every request counts, none is retried (max_retries=0)."""
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT s)
    started_at: float = 0.0  # monotonic, system-wide
    ended_at: float = 0.0  # the last request finished


async def run_clients(url: str, service: str, clients: int, stop: asyncio.Event,
                      load: Load, max_tokens: int) -> None:
    from openai import AsyncOpenAI

    # No kept-alive connection: each request is a new connection the Service balances.
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                             timeout=120, trust_env=False)
    sdk = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
                      http_client=http)

    async def one_client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            load.sent += 1
            start = time.monotonic()
            first = None
            tokens, finish = 0, None
            try:
                stream = await sdk.chat.completions.create(
                    model=service, max_tokens=max_tokens, temperature=0.7, stream=True,
                    messages=[{"role": "user",
                               "content": f"Customer {i}-{n} asks: where is my parcel?"}])
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens += 1
                        first = first or time.monotonic()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if finish not in ("stop", "length") or tokens == 0:
                    raise RuntimeError(f"incomplete stream: finish={finish} tokens={tokens}")
                load.ok += 1
                load.ttft.append((start, (first or time.monotonic()) - start))
            except Exception as e:  # every failure counts, whatever its kind
                load.failed += 1
                load.errors.append(f"{type(e).__name__}: {e}"[:300])
                await asyncio.sleep(0.2)  # no failure storm (a Service with no endpoints)

    try:
        await asyncio.gather(*(one_client(i) for i in range(clients)))
    finally:
        load.ended_at = time.monotonic()
        await sdk.close()


async def main(a: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    load = Load(started_at=time.monotonic())
    print(f"started {load.started_at}", flush=True)
    try:
        await run_clients(a.url, a.service, a.clients, stop, load, a.max_tokens)
    finally:
        with open(a.out, "w") as f:
            json.dump(asdict(load), f)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the Service's base URL")
    p.add_argument("--service", required=True)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", required=True)
    asyncio.run(main(p.parse_args()))
    sys.exit(0)
