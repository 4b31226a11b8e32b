"""The server tests' `preheat serve`: small limits keep CPU runs quick, and a short
context makes "too long" prompts cheap to send."""

from __future__ import annotations

from pathlib import Path

import httpx
from serve_process import Server, free_port  # noqa: F401  (re-exported for the tests)
from serve_process import start as _start

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
SERVER_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--max-total-tokens", "16384",
                "--page-size", "16", "--max-num-seqs", "16", "--log-level", "info"]

# The tiny-model server (conftest.tiny_server): a random-weight model, small limits.
TINY = "tiny"
TINY_FLAGS = ["--served-model-name", TINY, "--dtype", "float32", "--max-model-len", "64",
              "--max-total-tokens", "8192", "--page-size", "16", "--max-num-seqs", "16",
              "--max-queue-len", "32", "--max-request-prompt-tokens", "1024",
              "--grammar-compile-timeout", "2", "--api-key", API_KEY]


def start_server(tmp: Path, *flags: str, wait_ready: bool = True, timeout: float = 180) -> Server:
    """Starts the server and, unless told not to, waits for /ready to be 200."""
    server = _start(tmp, [*SERVER_FLAGS, *flags])
    if wait_ready:
        server.wait_ready(timeout)
    return server


def wait_for(server: Server, accept, timeout: float = 180) -> httpx.Response:
    return server.wait_for(accept, timeout)
