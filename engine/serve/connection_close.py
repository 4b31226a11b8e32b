"""While the engine drains, every response closes its connection.

A Service balances connections, not requests (kube-proxy is layer 4): a client that keeps
its connection alive keeps reaching a pod that already left the endpoints. Once that pod
drains, it answers new requests with 503 — and `Connection: close`, so the client's retry
opens a new connection, which the Service sends to a pod still serving.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from preheat.engine.engine_client import EngineClient


class CloseWhileDraining:
    def __init__(self, app: ASGIApp, aengine: EngineClient) -> None:
        self.app = app
        self.aengine = aengine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.aengine.phase == "draining":
                headers = [(k, v) for k, v in message.get("headers") or []
                           if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)
