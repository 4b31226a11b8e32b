"""`preheat router`: parse the flags, serve the app with uvicorn."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from preheat.router.app import build_app
from preheat.router.config import parse_args
from preheat.router.discovery import api_access

log = logging.getLogger(__name__)


class RouterServer(uvicorn.Server):
    """SIGTERM: stop accepting, let in-flight streams finish (timeout_graceful_shutdown),
    exit 0. uvicorn would re-raise the signal at exit (code 143); a pod's graceful stop is
    not a failure. A second signal stops at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(cfg, api_access(cfg))
    # The pod's preStop sleep has already taken it out of the Service's endpoints by SIGTERM.
    server = RouterServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                         timeout_graceful_shutdown=30, access_log=False))
    server.run()
    log.info("stopped")
    return 0
