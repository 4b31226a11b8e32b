"""The one place other threads hand work to the stepping thread: new sequences, aborts, calls.

The HTTP server's event loop, the Python API and the warm-start code add requests while the
engine steps on its own thread; the pool, the radix tree and the queues are not thread-safe,
so nothing but this inbox is touched from outside. The stepping thread empties it at the
start of every step (`take`), so a request added now is seen by the next plan.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from preheat.engine.request.sequence import Sequence


@dataclass
class Delivery:
    """What the inbox held when the stepping thread took it."""

    sequences: list[Sequence] = field(default_factory=list)
    aborts: set[str] = field(default_factory=set)
    calls: list[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future]] = field(default_factory=list)


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = Delivery()

    def put(self, seqs: list[Sequence], admit: Callable[[int], None] | None = None) -> None:
        """Adds sequences; `admit(waiting_now)`, when given, is called under the lock with the
        number of sequences already waiting here and may raise to refuse them all (the
        scheduler's queue limit), so the check and the add are one step."""
        with self._lock:
            if admit is not None:
                admit(len(self._pending.sequences))
            self._pending.sequences.extend(seqs)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending.aborts.add(request_id)

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending.calls.append((fn, args, future))
        return future

    def waiting(self) -> int:
        """Sequences handed in and not yet taken."""
        with self._lock:
            return len(self._pending.sequences)

    def empty(self) -> bool:
        with self._lock:
            p = self._pending
            return not (p.sequences or p.aborts or p.calls)

    def take(self) -> Delivery:
        with self._lock:
            taken, self._pending = self._pending, Delivery()
        return taken


def run_calls(calls: list[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future]]) -> None:
    """Runs handed-in calls on this (the stepping) thread; an exception goes to the caller's
    future and never into the step loop."""
    for fn, args, future in calls:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
