"""The API emulator on a real port, in a thread of its own, for tests that drive it with the
real kubectl and helm binaries (subprocesses: the test itself stays synchronous)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys
import threading
from collections.abc import Iterator

import kmock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "operator"))
from kmock_apiserver import KubeAPIServer, write_kubeconfig


@contextlib.contextmanager
def emulator(directory: pathlib.Path, crds: tuple[pathlib.Path, ...] = ()) -> Iterator[pathlib.Path]:
    """Yields a kubeconfig for an emulator that serves the given CRDs from the start (none
    by default: a client installs them, as on a new cluster). Stopped on the way out."""
    ready = threading.Event()
    holder: dict[str, object] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        holder["stop"], holder["loop"] = stop, asyncio.get_running_loop()
        async with KubeAPIServer(crds=crds) as api, kmock.Server(api) as server:
            holder["kubeconfig"] = write_kubeconfig(directory, server.url)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), name="kube-emulator", daemon=True)
    thread.start()
    if not ready.wait(60):
        raise RuntimeError("the API emulator did not start")
    try:
        yield holder["kubeconfig"]  # type: ignore[misc]
    finally:
        loop, stop = holder["loop"], holder["stop"]
        loop.call_soon_threadsafe(stop.set)  # type: ignore[attr-defined]
        thread.join(30)
