"""`preheat operator`: run the kopf operator with Preheat's handlers."""

from __future__ import annotations

import asyncio

import kopf

from preheat.operator.config import OperatorConfig, parse_args, startup_priority


def run(config: OperatorConfig) -> None:
    from preheat.operator import handlers  # registers the handlers with kopf

    kopf.configure(debug=config.log_level == "debug", quiet=config.log_level in ("warning", "error"))
    kopf.run(
        standalone=config.standalone,
        peering_name=None if config.standalone else config.peering,
        priority=None if config.standalone else (
            startup_priority() if config.priority is None else config.priority),
        clusterwide=config.all_namespaces,
        namespaces=() if config.all_namespaces else config.namespaces,
        liveness_endpoint=config.liveness,
        memo=handlers.OperatorState(config=config),
    )


def main(argv: list[str]) -> int:
    config = parse_args(argv)
    try:
        run(config)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0
