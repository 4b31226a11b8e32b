"""The operator's /metrics scrape against pods that misbehave, over a real local HTTP server:
a body larger than 1 MiB (a CR author's image can serve anything) and a pod that trickles
bytes are a missing value, not an operator out of memory or a scrape round that never ends."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse

from preheat.operator.scrape import MAX_METRICS_BYTES, scrape

GAUGE = "preheat_num_requests_waiting"


@pytest.fixture(scope="module")
def pod_url():
    app = FastAPI()
    produced = {"huge": 0}

    @app.get("/ok")
    async def ok():
        return PlainTextResponse(f"# TYPE {GAUGE} gauge\n{GAUGE} 3.0\n")

    @app.get("/huge")
    async def huge():
        async def body():
            yield f"# TYPE {GAUGE} gauge\n{GAUGE} 3.0\n"
            for _ in range(64):  # 64 MiB of comments, no Content-Length
                await asyncio.sleep(0)
                produced["huge"] += 1 << 20
                yield "#" * ((1 << 20) - 1) + "\n"
        return StreamingResponse(body(), media_type="text/plain")

    @app.get("/declared")
    async def declared():
        return PlainTextResponse("#" * (MAX_METRICS_BYTES + 10))

    @app.get("/trickle")
    async def trickle():
        async def body():
            yield f"# TYPE {GAUGE} gauge\n"
            while True:
                await asyncio.sleep(0.05)
                yield "#"
        return StreamingResponse(body(), media_type="text/plain")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", produced
    server.should_exit = True
    thread.join(10)


async def test_oversized_and_trickling_metrics_are_missing_values_the_rest_is_read(pod_url):
    base, produced = pod_url
    urls = {name: f"{base}/{name}" for name in ("ok", "huge", "declared", "trickle")}
    async with httpx.AsyncClient() as client:
        values = await scrape(client, urls, GAUGE, timeout=1.5)
    assert values == {"ok": 3.0, "huge": None, "declared": None, "trickle": None}
    assert produced["huge"] < 64 << 20  # the operator hung up, it did not read it all
