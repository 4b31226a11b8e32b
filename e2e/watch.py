"""A watch loop over one resource collection, reconnecting on any error."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], Awaitable[None]]


async def watch(client: httpx.AsyncClient, path: str, handle: Handler,
                retry_s: float = 0.5) -> None:
    """Calls handle(type, object) for every event, forever. A watch without a
    resourceVersion starts with a synthetic ADDED per existing object (on a real server and
    on the emulator alike), so after a dropped stream it simply starts again and nothing is
    missed (the handler must be idempotent, like a kubelet's sync)."""
    while True:
        try:
            params = {"watch": "true"}
            async with client.stream("GET", path, params=params, timeout=None) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.strip():
                        event = json.loads(line)
                        await handle(event["type"], event["object"])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dropped stream or a restarting server: list again
            log.debug("watch %s: %s; relisting", path, e)
        await asyncio.sleep(retry_s)
