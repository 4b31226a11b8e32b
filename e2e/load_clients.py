"""Streaming chat clients as a process of their own, sending through a Service stand-in.

    python -m e2e.load_clients --api URL --namespace NS --service NAME --clients N --out FILE

Why a separate process: the local harness runs the API emulator and the kubelet (its
probes!) in the test's event loop. Clients that parse token streams in that same loop
delay both: probes time out and pods look unready, the operator's calls wait — the harness
would measure itself. Here the clients run apart, like users outside the cluster.

Router (HARNESS code, a stand-in for the Service and kube-proxy, which the local harness
does not have): it lists the service's pods from the API every 0.2 s and sends each new
request to a random pod whose Ready condition is True and whose role is serving — the
Service's endpoints rule — at podIP:port, as kube-proxy would.

It prints `started <monotonic>` once the clients run. SIGTERM: no new requests, the ones in
flight finish, and the results go to --out as JSON (time.monotonic() is system-wide on
Linux, so the parent can compare times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


def endpoints(pods: list[dict[str, Any]]) -> list[str]:
    """http://podIP:port of the Service's endpoints: Ready, role=serving, not leaving."""
    out = []
    for p in pods:
        meta, status = p.get("metadata") or {}, p.get("status") or {}
        if meta.get("deletionTimestamp") or (meta.get("labels") or {}).get(
                "preheat.dev/role") != "serving" or not status.get("podIP"):
            continue
        if not any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in status.get("conditions") or []):
            continue
        port = 8000
        for c in (p.get("spec") or {}).get("containers") or []:
            for cp in c.get("ports") or []:
                if cp.get("name") == "http":
                    port = int(cp["containerPort"])
        out.append(f"http://{status['podIP']}:{port}")
    return sorted(out)


class Router:
    def __init__(self, api: str, namespace: str, service: str) -> None:
        self._client = httpx.AsyncClient(base_url=api, timeout=10, trust_env=False)
        self._path = f"/api/v1/namespaces/{namespace}/pods"
        self._selector = {"labelSelector": f"preheat.dev/service={service}"}
        self.endpoints: list[str] = []

    async def refresh(self) -> None:
        resp = await self._client.get(self._path, params=self._selector)
        resp.raise_for_status()
        self.endpoints = endpoints(resp.json().get("items") or [])

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                await self.refresh()
            except httpx.HTTPError:
                pass  # keep the last endpoints, as kube-proxy does

    def pick(self) -> str | None:
        return random.choice(self.endpoints) if self.endpoints else None

    async def close(self) -> None:
        await self._client.aclose()


@dataclass
class Load:
    """What the clients saw: every request counts, none is retried (max_retries=0)."""
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT s)
    by_endpoint: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0  # monotonic, system-wide
    ended_at: float = 0.0  # the last request finished


async def run_clients(router: Router, service: str, clients: int, stop: asyncio.Event,
                      load: Load, max_tokens: int) -> None:
    from openai import AsyncOpenAI

    sdk: dict[str, AsyncOpenAI] = {}

    def client_for(url: str) -> AsyncOpenAI:
        if url not in sdk:
            sdk[url] = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                   timeout=120)
        return sdk[url]

    async def one_client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            url = router.pick()
            load.sent += 1
            if url is None:
                load.failed += 1
                load.errors.append("no Ready serving pod (the Service has no endpoints)")
                await asyncio.sleep(0.2)
                continue
            load.by_endpoint[url] = load.by_endpoint.get(url, 0) + 1
            start = time.monotonic()
            first = None
            tokens, finish = 0, None
            try:
                stream = await client_for(url).chat.completions.create(
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
                load.errors.append(f"{url}: {type(e).__name__}: {e}"[:300])

    try:
        await asyncio.gather(*(one_client(i) for i in range(clients)))
    finally:
        load.ended_at = time.monotonic()
        for c in sdk.values():
            await c.close()


async def main(a: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    router = Router(a.api, a.namespace, a.service)
    await router.refresh()
    refresher = asyncio.create_task(router.run())
    load = Load(started_at=time.monotonic())
    print(f"started {load.started_at}", flush=True)
    try:
        await run_clients(router, a.service, a.clients, stop, load, a.max_tokens)
    finally:
        refresher.cancel()
        await router.close()
        with open(a.out, "w") as f:
            json.dump(asdict(load), f)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api", required=True)
    p.add_argument("--namespace", default="default")
    p.add_argument("--service", required=True)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", required=True)
    asyncio.run(main(p.parse_args()))
    sys.exit(0)
