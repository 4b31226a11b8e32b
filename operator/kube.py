"""A small async Kubernetes API client on kopf's own credentials.

Why not the `kubernetes` package: it is synchronous (it would block kopf's event loop)
and its models reject objects they do not know. This client speaks raw JSON, and every
call names one constant from resources.py plus a verb method — which is what the Helm
chart's RBAC test reads to derive the permissions the operator needs.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from preheat.operator.resources import Resource

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class Kube:
    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.server = info.server.rstrip("/")
        headers = {"Accept": "application/json", **info.as_http_headers()}
        # kopf's own TLS setup (CA, client certificates, insecure flag) for the same server.
        ssl_ctx: ssl.SSLContext | bool = (
            info.as_ssl_context() if self.server.startswith("https") else False)
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=ssl_ctx),
            timeout=aiohttp.ClientTimeout(total=30))

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, method: str, path: str, *, body: Any = None,
                    params: Mapping[str, str] | None = None, content_type: str | None = None,
                    ) -> dict[str, Any] | None:
        headers = {"Content-Type": content_type or "application/json"}
        data = None if body is None else json.dumps(body)
        async with self._session.request(method, self.server + path, data=data,
                                         params=params, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 404:
                return None
            if resp.status >= 400:
                raise ApiError(resp.status, text)
            return json.loads(text) if text else {}

    async def get(self, res: Resource, namespace: str, name: str,
                  subresource: str | None = None) -> dict[str, Any] | None:
        return await self._call("GET", res.path(namespace, name, subresource))

    async def list(self, res: Resource, namespace: str,
                   labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out = await self._call("GET", res.path(namespace), params={"labelSelector": selector})
        return list((out or {}).get("items") or [])

    async def create(self, res: Resource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        out = await self._call("POST", res.path(namespace), body=body)
        assert out is not None
        return out

    async def patch(self, res: Resource, namespace: str, name: str, patch: Any, *,
                    subresource: str | None = None, content_type: str = MERGE,
                    ) -> dict[str, Any] | None:
        return await self._call("PATCH", res.path(namespace, name, subresource), body=patch,
                                content_type=content_type)

    async def delete(self, res: Resource, namespace: str, name: str) -> None:
        # Background propagation: the garbage collector removes dependents (none for pods).
        await self._call("DELETE", res.path(namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1",
                               "propagationPolicy": "Background"})
