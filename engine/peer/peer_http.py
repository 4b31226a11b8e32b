"""What every engine-to-engine HTTP call shares (snapshots: engine/warm/snapshot_peer.py; model
files: engine/model/peer_fetch.py): the bearer token that /admin/* asks for (the service's
current peer key, engine/serve/http_auth.py) and the timeouts — a short connect (a peer that is
not there is the first pod of a service, not an error to wait for) under one deadline."""

from __future__ import annotations

import httpx

from preheat.engine.peer.peer_secret import PeerKeys

CONNECT_TIMEOUT_S = 3.0


def peer_headers(keys: PeerKeys | None) -> dict[str, str]:
    """The Authorization header for /admin/* on a peer (none without keys)."""
    return {"Authorization": f"Bearer {keys.current.decode()}"} if keys else {}


def peer_timeout(timeout: float) -> httpx.Timeout:
    """Each read within `timeout`, the connect within a few seconds."""
    return httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
