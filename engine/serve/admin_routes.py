"""The operator's routes under /admin/* (only the per-service peer secret may call them:
engine/serve/http_auth.py): POST /admin/snapshot saves a hot-prefix snapshot now, and the
snapshot peer route (engine/warm/snapshot_peer.py) streams the newest one to a starting pod.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from preheat.engine.engine_client import EngineClient
from preheat.engine.request.api_errors import APIError

if TYPE_CHECKING:
    from preheat.engine.warm.snapshotter import Snapshotter

log = logging.getLogger(__name__)


def add_admin_routes(app: FastAPI, aengine: EngineClient, snapshotter: Snapshotter | None) -> None:
    """`snapshotter`: None without --snapshot-dir (the routes then answer 404)."""

    @app.post("/admin/snapshot")
    async def snapshot(request: Request) -> JSONResponse:
        """Saves a hot-prefix snapshot now (e.g. before a planned rollout). One at a time:
        409 while a save (this route's, the periodic one or the shutdown one) runs; 429
        within MIN_SAVE_INTERVAL_S of the last one saved on request."""
        if snapshotter is None:
            raise APIError(404, "snapshots are off: start the server with --snapshot-dir",
                           code="snapshots_disabled")
        if aengine.engine is None or aengine.error is not None:
            raise APIError(503, f"engine is not serving (phase: {aengine.phase})", code="not_ready")
        from preheat.engine.warm.snapshot_peer import MIN_SAVE_INTERVAL_S
        from preheat.engine.warm.snapshotter import SnapshotInProgress, SnapshotTooSoon

        try:
            saved = await asyncio.to_thread(snapshotter.save_forced, aengine, MIN_SAVE_INTERVAL_S)
        except SnapshotInProgress:
            raise APIError(409, "a snapshot is already being saved; wait for it to finish",
                           code="snapshot_in_progress") from None
        except SnapshotTooSoon as e:
            raise APIError(429, str(e), code="snapshot_too_soon", retry_after=e.retry_after) from None
        except Exception as e:
            log.error("snapshot on request failed: %s: %s", type(e).__name__, e)
            raise APIError(500, f"snapshot failed: {type(e).__name__}", code="snapshot_failed") from None
        return JSONResponse({"path": saved.path, "tokens": saved.tokens,
                             "prefixes": saved.prefixes, "seconds": round(saved.seconds, 3)})
