"""Router replicas share their placements (placement.py): each pulls every peer's journal.

Why: a conversation's turns reach the routers in turn (the Service balances connections),
and the bounded-load placement of a new conversation depends on the load a router saw then.
A router that learns of a key only at a later turn would place it by its own counts — on
another pod than its first turn about one time in eight in the benchmark's workload — and
that turn pays a full prefill. With the peers' placements adopted every `--share-interval`,
two routers route like one (benchmarks/routing_sweep.py: the cache share of later turns of
one router, with the spread bounded).

Pull, not push: each router serves `GET /router/placements?after=SEQ&epoch=E` (its journal
since SEQ; everything live when E is not its own epoch — it restarted — or SEQ fell out of
the bounded journal) to its peers only: the request must come from a Ready router pod of
the same service (its pod IP; the puller binds its pod IP). Only key hashes and pod names
travel. A peer that cannot be reached costs nothing but its share: each router still places
by its own counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx

from preheat.router.discovery import Endpoints
from preheat.router.metrics import RouterMetrics
from preheat.router.placement import Placements

log = logging.getLogger(__name__)

PATH = "/router/placements"
EPOCH = secrets.token_hex(8)  # this process's journal; a restarted peer has another


def journal_body(placements: Placements, after: int, epoch: str, now: float) -> dict[str, Any]:
    """The answer to a peer's pull. Pure."""
    seq, full, rows = placements.journal(after if epoch == EPOCH else -1, now)
    return {"epoch": EPOCH, "seq": seq, "full": full,
            "placements": [[k, pod, round(age, 3)] for k, pod, age in rows]}


def merge(placements: Placements, body: dict[str, Any], now: float) -> int:
    """Adopts a peer's journal rows; returns how many placements it changed here."""
    return sum(placements.adopt(str(k), str(pod), now - float(age))
               for k, pod, age in body.get("placements") or [])


@dataclass
class _Cursor:
    epoch: str = ""
    seq: int = 0


async def share_placements(placements: Placements, endpoints: Endpoints,
                           metrics: RouterMetrics, interval: float,
                           client: httpx.AsyncClient) -> None:
    """Pull every peer's journal each `interval` seconds, until cancelled."""
    cursors: dict[str, _Cursor] = {}

    async def pull(name: str, url: str) -> None:
        cursor = cursors.setdefault(name, _Cursor())
        try:
            resp = await client.get(url + PATH, params={"after": cursor.seq,
                                                        "epoch": cursor.epoch})
            resp.raise_for_status()
            body = resp.json()
            metrics.learned.inc(merge(placements, body, time.monotonic()))
            cursor.epoch, cursor.seq = str(body["epoch"]), int(body["seq"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            metrics.peer_errors.labels(peer=name).inc()
            log.debug("placements of peer %s: %s", name, e)

    while True:
        await asyncio.sleep(interval)
        peers = dict(endpoints.peers)
        await asyncio.gather(*(pull(n, u) for n, u in peers.items()))
        for gone in set(cursors) - set(peers):
            del cursors[gone]
            with contextlib.suppress(KeyError):  # no series left behind for a peer gone
                metrics.peer_errors.remove(gone)
