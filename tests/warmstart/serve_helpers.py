"""Real `preheat serve` subprocesses for the warm-start integration tests, and the small
things those tests read from them (phases over time, metric values, streamed usage)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

API_KEY = "warm-key"
MODEL = "SmolLM2-135M-Instruct"
# float32 uses the weight cache the server tests already fill; a small pool allocates fast;
# a small snapshot budget keeps each snapshot ~35 MB (float32 KV is 46 KB per token).
FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-total-tokens", "4096",
         "--page-size", "16", "--max-num-seqs", "8", "--log-level", "info",
         "--snapshot-max-tokens", "768", "--snapshot-interval", "0", "--api-key", API_KEY]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path
    started: float
    phases: list[tuple[float, int, str]] = field(default_factory=list)  # (t, status, phase)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def wait_ready(self, timeout: float = 240) -> None:
        """Polls /ready until 200, recording every (status, phase) change on the way."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                seen = (r.status_code, r.json().get("phase"))
                if not self.phases or self.phases[-1][1:] != seen:
                    self.phases.append((time.monotonic() - self.started, *seen))
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log()}")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


def start(tmp: Path, *flags: str, name: str = "server", env: dict[str, str] | None = None) -> Server:
    """Starts `python -m preheat serve` on a free port; does not wait for ready."""
    port = free_port()
    log_path = tmp / f"{name}-{port}.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    clean.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "preheat", "serve", "--host", "127.0.0.1", "--port", str(port),
         *FLAGS, *flags],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=clean,
    )
    return Server(proc, f"http://127.0.0.1:{port}", log_path, time.monotonic())


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text, or None when absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else None


def chat(server: Server, system: str, question: str, max_tokens: int = 4) -> dict:
    """A plain chat completion; returns the JSON body (usage has cached_tokens)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.auth(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()
