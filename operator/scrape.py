"""Reading one engine gauge from the pods' /metrics: a thin async shell around httpx.

Every pod is asked at once with a short timeout, so one hung pod delays a scrape round by
at most the timeout and never the others; a pod that does not answer (or answers without
the gauge) is reported as None, which the decision treats as the HPA treats a pod with a
missing metric. The operator reaches pods directly at podIP:port, as Prometheus does; it
must therefore run inside the cluster network (the Helm chart's Deployment does).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)
DEFAULT_PORT = 8000  # the engine port (DESIGN.md), when the container names none


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """http://<podIP>:<the container's port named http>/metrics, or None without an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = DEFAULT_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                port = int(p["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip  # IPv6
    return f"http://{host}:{port}/metrics"


def parse_gauge(text: str, metric: str) -> float | None:
    """The value of an unlabelled gauge in Prometheus text format (None when absent)."""
    return parse_gauges(text, (metric,))[metric]


def parse_gauges(text: str, metrics: tuple[str, ...]) -> dict[str, float | None]:
    """Several unlabelled gauges from one body, in one parse (None: absent or not finite)."""
    found: dict[str, float | None] = dict.fromkeys(metrics)
    for family in text_string_to_metric_families(text):
        if family.name not in found:
            continue
        for sample in family.samples:
            if sample.name == family.name and not sample.labels:
                value = float(sample.value)
                found[family.name] = value if math.isfinite(value) else None
                break
    return found


# The most of one pod's /metrics body read: an engine's is ~20 KiB; a pod running another
# image (the InferenceService's author picks it) must not make the operator, which serves
# every service, read without bound.
MAX_METRICS_BYTES = 1 << 20


class TooLarge(ValueError):
    pass


async def read_capped(client: httpx.AsyncClient, url: str, timeout: float,
                      cap: int = MAX_METRICS_BYTES, also_ok: tuple[int, ...] = ()) -> str:
    """The body of GET url, streamed, at most `cap` bytes, all of it within `timeout`
    seconds (httpx's own timeouts are per read: a pod trickling a byte at a time would hold
    the scrape round forever). `also_ok`: error statuses whose body is still wanted (/ready
    is 503 while it downloads, with the progress in its body)."""

    async def read() -> str:
        async with client.stream("GET", url, timeout=timeout) as resp:
            if resp.status_code not in also_ok:
                resp.raise_for_status()
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise TooLarge(f"/metrics of {declared} bytes is over {cap}")
            body = bytearray()
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > cap:
                    raise TooLarge(f"/metrics is over {cap} bytes")
            return body.decode("utf-8", "replace")

    return await asyncio.wait_for(read(), timeout)


async def _one(client: httpx.AsyncClient, url: str, metric: str, timeout: float) -> float | None:
    try:
        return parse_gauge(await read_capped(client, url, timeout), metric)
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as e:  # ValueError: not Prometheus text
        log.info("scraping %s failed: %s", url, type(e).__name__ if not str(e) else e)
        return None


async def scrape(client: httpx.AsyncClient, urls: Mapping[str, str], metric: str,
                 timeout: float) -> dict[str, float | None]:
    """pod name -> the gauge's value (None: no answer or no such gauge), all pods at once."""
    names = list(urls)
    values = await asyncio.gather(*(_one(client, urls[n], metric, timeout) for n in names))
    return dict(zip(names, values))
