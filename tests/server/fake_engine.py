"""A tiny stand-in for engine.Engine with the documented API, for tests of the layers above
it that need no model: one token per request per step, 'abc...' as text."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

# The real output type, so the fake cannot drift from what the server reads.
from preheat.engine.request.sequence import RequestOutput


class FakeEngine:
    max_model_len = 64
    served_model_name = "fake"

    def __init__(self, fail_on_step: bool = False, fail_token: int | None = None) -> None:
        self.fail_token = fail_token  # a request whose prompt holds it fails on its own
        self.tokenizer = SimpleNamespace(decode=lambda ids: "".join(chr(97 + i % 26) for i in ids))
        self.model_config = SimpleNamespace(vocab_size=100)
        self.fail_on_step = fail_on_step
        self._lock = threading.Lock()
        self.live: dict[str, dict] = {}
        self.aborted: list[str] = []
        self._aborts: set[str] = set()

    max_queue_len = 1000
    step_seconds = 0.002

    def add_request(self, prompt, params, request_id=None) -> str:
        return self.enqueue_all([self.build_sequence(prompt, params, request_id)])[0]

    def build_sequence(self, prompt, params, request_id=None):
        if len(prompt) >= self.max_model_len:
            raise ValueError("prompt too long")
        return SimpleNamespace(request_id=request_id, prompt=list(prompt), params=params)

    def check_request_budget(self, prompt_tokens: int, param: str = "prompt") -> None:
        pass

    def enqueue(self, seq) -> str:
        with self._lock:
            self.live[seq.request_id] = {"prompt": seq.prompt, "out": [], "max": seq.params.max_tokens or 16}
        return seq.request_id

    def enqueue_all(self, seqs) -> list[str]:
        from preheat.engine.request.errors import QueueFull

        with self._lock:
            if len(self.live) + len(seqs) > self.max_queue_len:
                raise QueueFull("queue_full", "the fake's line is full", retry_after=1.0)
            for s in seqs:
                self.live[s.request_id] = {"prompt": s.prompt, "out": [], "max": s.params.max_tokens or 16}
        return [s.request_id for s in seqs]

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.live or self._aborts)

    def step(self) -> list[RequestOutput]:
        if self.fail_on_step:
            raise RuntimeError("boom")
        time.sleep(self.step_seconds)  # a step takes time, so a client can leave mid-request
        outs = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                if self.live.pop(rid, None) is not None:
                    self.aborted.append(rid)
            for rid, r in list(self.live.items()):
                if self.fail_token is not None and self.fail_token in r["prompt"]:
                    del self.live[rid]
                    outs.append(RequestOutput(rid, r["prompt"], [], [], "", "", True, "error", cached_tokens=0,
                                              error="the request failed while sampling: RuntimeError: injected"))
                    continue
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
