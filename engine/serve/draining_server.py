"""uvicorn.Server that drains before it stops (the SIGTERM contract in DESIGN.md)."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from preheat.engine.lifecycle import Lifecycle

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn closes its socket on the first SIGTERM; we first drain with the socket open,
    so probes see 503 "draining" and in-flight streams finish, then let uvicorn stop."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.draining: asyncio.Task | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining is None:
            log.info("received %s: draining", signal.Signals(sig).name)
            self.draining = asyncio.get_event_loop().create_task(self._drain_then_exit())
            return
        # A second signal: stop now. Not recorded in _captured_signals on purpose, so uvicorn
        # does not re-raise it at exit and the process still exits with our code.
        log.warning("second %s: exiting without waiting", signal.Signals(sig).name)
        self.should_exit = True
        self.force_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self.lifecycle.shutdown()
        finally:
            self.should_exit = True
