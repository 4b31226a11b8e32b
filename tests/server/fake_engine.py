"""A tiny stand-in for engine.Engine with the documented API, for tests of the layers above
it that need no model: one token per request per step, 'abc...' as text."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

# The real output type, so the fake cannot drift from what the server reads.
from preheat.engine.sequence import RequestOutput


class FakeEngine:
    max_model_len = 64
    served_model_name = "fake"

    def __init__(self, fail_on_step: bool = False) -> None:
        self.tokenizer = SimpleNamespace(decode=lambda ids: "".join(chr(97 + i % 26) for i in ids))
        self.model_config = SimpleNamespace(vocab_size=100)
        self.fail_on_step = fail_on_step
        self._lock = threading.Lock()
        self.live: dict[str, dict] = {}
        self.aborted: list[str] = []
        self._aborts: set[str] = set()

    def add_request(self, prompt, params, request_id=None) -> str:
        if len(prompt) >= self.max_model_len:
            raise ValueError("prompt too long")
        with self._lock:
            self.live[request_id] = {"prompt": list(prompt), "out": [], "max": params.max_tokens}
        return request_id

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.live or self._aborts)

    def step(self) -> list[RequestOutput]:
        if self.fail_on_step:
            raise RuntimeError("boom")
        time.sleep(0.002)  # a step takes time, so a client can leave mid-request
        outs = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                if self.live.pop(rid, None) is not None:
                    self.aborted.append(rid)
            for rid, r in list(self.live.items()):
                tok = len(r["out"])
                r["out"].append(tok)
                done = len(r["out"]) >= r["max"]
                if done:
                    del self.live[rid]
                outs.append(RequestOutput(rid, r["prompt"], list(r["out"]), [tok],
                                          self.tokenizer.decode(r["out"]), self.tokenizer.decode([tok]),
                                          done, "length" if done else None, cached_tokens=0))
        return outs

    def stats(self):
        with self._lock:
            n = len(self.live)
        return SimpleNamespace(num_running=n, num_waiting=0, kv_usage=n / 10,
                               kv_used_pages=n, kv_cached_pages=0)
