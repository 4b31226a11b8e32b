"""`preheat router`: parse the flags, serve the app with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from preheat.router.app import build_app
from preheat.router.config import parse_args
from preheat.router.discovery import api_access


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(cfg, api_access(cfg))
    # SIGTERM: uvicorn stops accepting and lets in-flight streams finish (the pod's preStop
    # sleep has already taken it out of the Service's endpoints).
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                timeout_graceful_shutdown=30, access_log=False)
    return 0
