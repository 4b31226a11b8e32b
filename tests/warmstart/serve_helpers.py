"""Real `preheat serve` subprocesses for the warm-start integration tests, and the small
things those tests read from them (phases over time, metric values, streamed usage)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import serve_process
from serve_process import Server

API_KEY = "warm-key"
PEER_SECRET = "warm-peer-secret-0123456789"  # the service's: /admin/* and snapshot signatures
MODEL = "SmolLM2-135M-Instruct"
# float32 uses the weight cache the server tests already fill; a small pool allocates fast;
# a small snapshot budget keeps each snapshot ~35 MB (float32 KV is 46 KB per token).
FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-total-tokens", "4096",
         "--page-size", "16", "--max-num-seqs", "8", "--log-level", "info",
         "--snapshot-max-tokens", "768", "--snapshot-interval", "0", "--api-key", API_KEY]


def start(tmp: Path, *flags: str, name: str = "server", env: dict[str, str] | None = None,
          peer: bool = True) -> Server:
    """Starts `python -m preheat serve` on a free port; does not wait for ready. With
    `peer`, it holds the service's peer secret (as the operator mounts it)."""
    extra: list[str] = []
    if peer:
        secret = tmp / "peer-secret"
        secret.write_text(PEER_SECRET + "\n")
        extra = ["--peer-secret-file", str(secret)]
    server = serve_process.start(tmp, [*FLAGS, *extra, *flags], name=name, env=env, api_key=API_KEY)
    server.peer_secret = PEER_SECRET if peer else None
    return server


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
