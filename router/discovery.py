"""Which engines the router may send to: the Ready `role=serving` pods of one service,
followed from the Kubernetes API with a list + watch (no blind polling).

A pod is an endpoint while it is labelled role=serving, its Ready condition is True (which
includes the operator's warm gate: a warm pod never qualifies), it is not being deleted and
it has a pod IP — the same rule the EndpointSlice controller applies to the `<name>-engines`
Service. A pod leaves the set on the first event that says otherwise (relabelled to warm or
draining, unready, deleted), not after a resync.

Credentials are a pod's: the service account token (re-read on every connect: the kubelet
rotates it) and CA under --service-account-dir, the API at KUBERNETES_SERVICE_HOST/PORT.
Without a ca.crt there (a plain-HTTP API server, as the test harness's emulator is) the API
is reached over http.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from preheat.router.config import RouterConfig

log = logging.getLogger(__name__)

LABEL_SERVICE = "preheat.dev/service"  # DESIGN.md pod labels (operator/resources.py)
LABEL_ROLE = "preheat.dev/role"
ROLE_SERVING = "serving"
ROLE_ROUTER = "router"


def engine_url(pod: Mapping[str, Any], service: str, port: int) -> str | None:
    """The pod's engine URL if it may get traffic now, else None. Pure."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_SERVICE) != service or labels.get(LABEL_ROLE) != ROLE_SERVING:
        return None
    if meta.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    ip = status.get("podIP")
    return f"http://{ip}:{port}" if ready and ip else None


def router_url(pod: Mapping[str, Any], service: str, port: int, own: str | None) -> str | None:
    """A peer router's URL (another Ready router pod of the service), else None. Pure."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_SERVICE) != service or labels.get(LABEL_ROLE) != ROLE_ROUTER:
        return None
    if meta.get("deletionTimestamp") or meta.get("name") == own:
        return None
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    ip = status.get("podIP")
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                port = int(p["containerPort"])
    return f"http://{ip}:{port}" if ready and ip else None


@dataclass(frozen=True)
class ApiAccess:
    base_url: str
    token_path: str | None
    verify: str | bool

    def headers(self) -> dict[str, str]:
        if self.token_path and os.path.exists(self.token_path):
            with open(self.token_path) as f:
                return {"Authorization": f"Bearer {f.read().strip()}"}
        return {}


def api_access(cfg: RouterConfig) -> ApiAccess:
    token = os.path.join(cfg.service_account_dir, "token")
    ca = os.path.join(cfg.service_account_dir, "ca.crt")
    if cfg.api_server:
        return ApiAccess(cfg.api_server.rstrip("/"), token, ca if os.path.exists(ca) else True)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise RuntimeError("not in a cluster (no KUBERNETES_SERVICE_HOST/PORT): pass --api-server")
    host = f"[{host}]" if ":" in host else host
    if os.path.exists(ca):
        return ApiAccess(f"https://{host}:{port}", token, ca)
    return ApiAccess(f"http://{host}:{port}", token, False)


class Endpoints:
    """The current engine set (pod name -> URL), kept by watch(); `wait_change` lets a
    request with no pod left wait for one instead of failing at once. `peers`: the other
    Ready router pods of the service (name -> URL), whose placements this one pulls."""

    def __init__(self) -> None:
        self.ready: dict[str, str] = {}
        self.peers: dict[str, str] = {}
        self.synced = False  # the first list has been read
        self._changed = asyncio.Event()

    def replace(self, ready: dict[str, str]) -> None:
        if ready != self.ready:
            log.info("engines: %s", ", ".join(sorted(ready)) or "none")
            self.ready = ready
            self._changed.set()
            self._changed = asyncio.Event()
        self.synced = True

    def update(self, name: str, url: str | None) -> None:
        ready = dict(self.ready)
        if url is None:
            ready.pop(name, None)
        else:
            ready[name] = url
        self.replace(ready)

    def update_peer(self, name: str, url: str | None) -> None:
        if url is None:
            self.peers.pop(name, None)
        elif self.peers.get(name) != url:
            log.info("peer router %s at %s", name, url)
            self.peers[name] = url

    def peer_hosts(self) -> set[str]:
        return {httpx.URL(u).host for u in self.peers.values()}

    async def wait_change(self, timeout: float) -> bool:
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


async def watch_engines(cfg: RouterConfig, endpoints: Endpoints, access: ApiAccess,
                        retry_s: float = 1.0) -> None:
    """List, then watch from the list's resourceVersion; on any error (410 Gone included)
    list again. Runs until cancelled."""
    path = f"/api/v1/namespaces/{cfg.namespace}/pods"
    params = {"labelSelector": f"{LABEL_SERVICE}={cfg.service}"}
    async with httpx.AsyncClient(base_url=access.base_url, verify=access.verify,
                                 trust_env=False, timeout=httpx.Timeout(30, read=None)) as api:
        while True:
            try:
                resp = await api.get(path, params=params, headers=access.headers())
                resp.raise_for_status()
                listed = resp.json()
                items = listed.get("items") or []
                endpoints.replace({
                    p["metadata"]["name"]: url for p in items
                    if (url := engine_url(p, cfg.service, cfg.engine_port)) is not None})
                endpoints.peers = {
                    p["metadata"]["name"]: url for p in items
                    if (url := router_url(p, cfg.service, cfg.port, cfg.pod_name)) is not None}
                rv = (listed.get("metadata") or {}).get("resourceVersion")
                watch = {**params, "watch": "true", "allowWatchBookmarks": "true",
                         **({"resourceVersion": rv} if rv else {})}
                async with api.stream("GET", path, params=watch, headers=access.headers()) as w:
                    w.raise_for_status()
                    async for line in w.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":  # e.g. 410 Gone: the resourceVersion is too old
                            raise RuntimeError(f"watch error: {obj.get('message')}")
                        if kind == "BOOKMARK":
                            continue
                        name = (obj.get("metadata") or {}).get("name")
                        if not name:
                            continue
                        endpoints.update(name, None if kind == "DELETED" else
                                         engine_url(obj, cfg.service, cfg.engine_port))
                        endpoints.update_peer(name, None if kind == "DELETED" else
                                              router_url(obj, cfg.service, cfg.port, cfg.pod_name))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dropped stream, a restarting API server: list again
                log.warning("pod watch: %s; listing again in %.0f s", e, retry_s)
            await asyncio.sleep(retry_s)
