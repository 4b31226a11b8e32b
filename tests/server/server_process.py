"""Starting a real `preheat serve` subprocess on a free port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
# Small limits keep CPU runs quick: a short context makes "too long" prompts cheap to send.
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--max-total-tokens", "16384",
                "--page-size", "16", "--max-num-seqs", "16", "--log-level", "info"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(tmp: Path, *flags: str, wait_ready: bool = True, timeout: float = 180) -> Server:
    """Starts `python -m preheat serve` on a free port and waits for /ready to be 200."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "preheat", "serve", "--host", "127.0.0.1", "--port", str(port),
         *SERVER_FLAGS, *flags],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env,
    )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    if wait_ready:
        wait_for(server, lambda r: r.status_code == 200, timeout)
    return server


def wait_for(server: Server, accept, timeout: float = 180) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited {server.proc.returncode}:\n{server.log()}")
        try:
            r = httpx.get(server.url + "/ready", timeout=2)
            if accept(r):
                return r
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"server not as expected in {timeout}s:\n{server.log()}")


