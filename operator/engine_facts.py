"""What an engine of the current pod template publishes about its snapshots' size (the
gauges snapshot_storage.py needs), read from one of the service's pods: a thin async shell.

The facts are the same for every pod of one template (same model, same flags), so a few
pods are asked at once with a short timeout (as scrape.py does for the autoscaler; the
operator reaches pods at podIP:port, inside the cluster network), Ready ones first, and
the first that published them wins. Reconcile asks only while status.snapshotStorage holds
nothing for the current template.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from preheat.operator.resources import LABEL_TEMPLATE_HASH
from preheat.operator.scrape import metrics_url, parse_gauges, read_capped
from preheat.operator.snapshot_storage import (
    BYTES_PER_TOKEN,
    MAX_TOKENS,
    POOL_TOKENS,
    WEIGHT_CACHE_BYTES,
    EngineFacts,
)

log = logging.getLogger(__name__)
TIMEOUT_S = 1.0
MAX_ASKED = 3  # pods asked per pass: one answer is enough


def candidates(pods: Sequence[Mapping[str, Any]], template_hash: str) -> list[str]:
    """/metrics URLs of running engine pods of this template, Ready ones first."""
    ranked = []
    for p in pods:
        meta, st = p.get("metadata") or {}, p.get("status") or {}
        url = metrics_url(p)
        if (meta.get("labels") or {}).get(LABEL_TEMPLATE_HASH) != template_hash or not url or \
                st.get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        ready = any(c.get("type") == "ContainersReady" and c.get("status") == "True"
                    for c in st.get("conditions") or [])
        ranked.append((not ready, meta.get("name", ""), url))
    return [url for *_, url in sorted(ranked)][:MAX_ASKED]


GAUGES = (BYTES_PER_TOKEN, MAX_TOKENS, POOL_TOKENS, WEIGHT_CACHE_BYTES)


def facts_from(values: Mapping[str, float | None]) -> EngineFacts | None:
    """None until the engine has loaded its model (the gauge is 0 before) or when it is an
    engine that does not publish them. A snapshot holds at most what the KV pool does."""
    per_token, max_tokens = values.get(BYTES_PER_TOKEN), values.get(MAX_TOKENS)
    if not per_token or per_token <= 0 or max_tokens is None or max_tokens < 0:
        return None
    pool = values.get(POOL_TOKENS)
    tokens = min(max_tokens, pool) if pool and pool > 0 else max_tokens
    return EngineFacts(int(per_token), int(tokens), int(values.get(WEIGHT_CACHE_BYTES) or 0))


async def _one(client: httpx.AsyncClient, url: str) -> EngineFacts | None:
    try:
        text = await read_capped(client, url, TIMEOUT_S)  # 1 MiB at most, within the timeout
        return facts_from(parse_gauges(text, GAUGES))
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as e:  # ValueError: not Prometheus text
        log.debug("reading %s failed: %s", url, type(e).__name__ if not str(e) else e)
        return None


async def read(client: httpx.AsyncClient, pods: Sequence[Mapping[str, Any]],
               template_hash: str) -> EngineFacts | None:
    urls = candidates(pods, template_hash)
    answers = await asyncio.gather(*(_one(client, u) for u in urls))
    return next((a for a in answers if a is not None), None)
