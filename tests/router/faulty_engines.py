"""TEST PARTS standing in for engines in the failure states the router must handle, each a
real HTTP/1.1 server on loopback: one that answers every request with the engine's 503 of a
draining server, and one that sends its response headers and one chunk, then drops the
connection (an engine killed mid-stream). A refused connection needs no server: a free port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

_BODY = b'{"error": {"message": "the server is draining", "type": "unavailable"}}'
_DRAINING = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BODY), _BODY))
_BREAKS = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"1d\r\ndata: {\"choices\": [\"first\"]}\n\n\r\n")


@contextlib.asynccontextmanager
async def stand_in(kind: str) -> AsyncIterator[tuple[str, list[int]]]:
    """Yields (URL, connections): `kind` "draining" or "breaks"; connections counts them."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_DRAINING if kind == "draining" else _BREAKS)
            await writer.drain()
            if kind == "breaks":
                await asyncio.sleep(0.1)
                writer.transport.abort()  # a reset, no final chunk
                return
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
