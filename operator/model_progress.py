"""Download progress of a service's starting pods, for its status (status.model).

A pod whose engine is downloading a hub or S3 model says so on /ready: `{"phase":
"downloading", "bytes_done", "bytes_total"}`. The operator asks the pods that run but are
not ready yet, all at once with a short timeout (as scrape.py asks for gauges; the operator
reaches pods at podIP:port, inside the cluster network), and reports them. Only for a
service whose model is downloaded (spec.model.uri hub or S3): no HTTP otherwise.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from preheat.operator.scrape import metrics_url, read_capped

TIMEOUT_S = 1.0
RECHECK_S = 3.0  # how often the status follows a download in progress


def candidates(pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """pod name -> its /ready URL, for running pods whose containers are not ready."""
    out = {}
    for p in pods:
        st = p.get("status") or {}
        conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
        url = metrics_url(p)
        if st.get("phase") == "Running" and conds.get("ContainersReady") != "True" and url and \
                not (p.get("metadata") or {}).get("deletionTimestamp"):
            out[p["metadata"]["name"]] = url.removesuffix("/metrics") + "/ready"
    return out


async def _one(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        # Streamed, at most 1 MiB within the timeout (scrape.read_capped): the pod's image
        # is the CR author's choice, and the operator serves every service.
        # /ready is 503 until the pod serves: the progress is in that 503's body.
        body = json.loads(await read_capped(client, url, TIMEOUT_S, also_ok=(503,)))
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError):
        return None
    return body if isinstance(body, dict) and body.get("phase") == "downloading" else None


async def downloading(client: httpx.AsyncClient, pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """status.model.downloading: one entry per pod downloading now, by name."""
    urls = candidates(pods)
    bodies = await asyncio.gather(*(_one(client, u) for u in urls.values()))
    return [{"pod": name, "bytesDone": int(b.get("bytes_done") or 0), "bytesTotal": int(b.get("bytes_total") or 0)}
            for name, b in sorted(zip(urls, bodies)) if b is not None]
