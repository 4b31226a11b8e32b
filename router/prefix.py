"""What a request's prefix is, as a key the routing decision hashes (pure functions).

A chat request's key is its messages up to the end of the first user message: every later
turn of one conversation resends that head, so all of its turns share the key, and two
conversations that only share a system prompt get different keys (they still spread out,
and each pod caches the shared system prompt once). A completion's key is the head of its
prompt. Long heads are cut at `limit` characters: past that the engine's radix cache has
a match long enough that the rest is the same cost anywhere.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def request_key(body: Any, limit: int) -> str | None:
    """The affinity key of a parsed JSON request body; None when it has no prompt (then
    the least-loaded pod serves it)."""
    if not isinstance(body, Mapping):
        return None
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head: list[str] = []
        for m in messages:
            if not isinstance(m, Mapping):
                continue
            head.append(f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e")
            if m.get("role") == "user":
                break
        text = "".join(head)
    else:
        prompt = body.get("prompt", body.get("text"))
        if isinstance(prompt, list):  # a batch or token ids: the first element's head
            prompt = prompt[0] if prompt else None
        if isinstance(prompt, list):
            prompt = json.dumps(prompt)
        if not isinstance(prompt, str) or not prompt:
            return None
        text = prompt
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    return f"{model}\x1d{text[:limit]}" if text else None


def score(key: str, pod: str) -> int:
    """Rendezvous (highest-random-weight) hash of a key on a pod: every router ranks the
    pods the same way for the same key, with no state shared, and a pod joining or leaving
    moves only the keys it wins or held."""
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{pod}".encode(), digest_size=8).digest(), "big")


class SeenKeys:
    """Which keys this router has sent to each pod lately (bounded, least recent first out):
    an estimate of which pod holds a request's prefix, for the metric only."""

    def __init__(self, per_pod: int = 4096) -> None:
        self.per_pod = per_pod
        self._by_pod: dict[str, OrderedDict[str, None]] = {}

    def holds(self, pod: str, key: str) -> bool:
        return key in self._by_pod.get(pod, {})

    def add(self, pod: str, key: str) -> None:
        keys = self._by_pod.setdefault(pod, OrderedDict())
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > self.per_pod:
            keys.popitem(last=False)

    def forget(self, pod: str) -> None:
        self._by_pod.pop(pod, None)
