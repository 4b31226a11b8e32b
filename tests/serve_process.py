"""A real `preheat serve` subprocess on a free port: the one way tests start a server.

tests/server/server_process.py and tests/warmstart/serve_helpers.py give it their flags.
The child gets this environment minus every PREHEAT_* variable, so a developer's shell
settings never change what a test measures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An ASGI app (a FastAPI app built from the engine's own pieces) served by uvicorn on a
    thread, on 127.0.0.1 and a free port; yields its base URL and stops it after."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    api_key: str | None = None
    peer_secret: str | None = None  # --peer-secret-file's key: what /admin/* asks for
    phases: list[tuple[float, int, str]] = field(default_factory=list)  # (t, status, /ready phase)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def peer_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.peer_secret}"} if self.peer_secret else {}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def wait_for(self, accept: Callable[[httpx.Response], bool], timeout: float = 240) -> httpx.Response:
        """Polls /ready until `accept` says yes, recording every (status, phase) change."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as poller:  # one client: httpx.get costs ~20 ms of CPU a call
            return self._poll(poller, accept, deadline, timeout)

    def _poll(self, poller: httpx.Client, accept: Callable[[httpx.Response], bool], deadline: float,
              timeout: float) -> httpx.Response:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                r = poller.get(self.url + "/ready")
            except httpx.TransportError:
                r = None
            if r is not None:
                try:
                    seen = (r.status_code, r.json().get("phase"))
                except ValueError:
                    seen = (r.status_code, "")
                if not self.phases or self.phases[-1][1:] != seen:
                    self.phases.append((time.monotonic() - self.started, *seen))
                if accept(r):
                    return r
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"server not as expected in {timeout}s:\n{self.log()}")

    def wait_ready(self, timeout: float = 240) -> None:
        self.wait_for(lambda r: r.status_code == 200, timeout)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


def start(
    tmp: Path, flags: list[str], *, name: str = "server", env: dict[str, str] | None = None,
    api_key: str | None = None, command: list[str] | None = None, cwd: Path | None = None,
) -> Server:
    """Starts `python -m preheat serve --host 127.0.0.1 --port <free> <flags>`; does not wait.
    command replaces `python -m preheat` (e.g. an installed `preheat` script)."""
    port = free_port()
    log_path = tmp / f"{name}-{port}.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    clean.update(env or {})
    proc = subprocess.Popen(
        [*(command or [sys.executable, "-m", "preheat"]), "serve", "--host", "127.0.0.1",
         "--port", str(port), *flags],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=clean, cwd=cwd,
    )
    return Server(proc, f"http://127.0.0.1:{port}", log_path, api_key=api_key)
