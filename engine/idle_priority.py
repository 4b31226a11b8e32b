"""Background threads that may run only while nothing else wants a core (the KV pool's prefaulter,
the weights' move into huge pages): Linux's SCHED_IDLE for the calling thread
(`lower_this_thread`), and daemon threads that are done before the interpreter finalizes
(`start_thread`).

Python 3.11 ends a daemon thread that tries to take the GIL back once finalization has begun by
unwinding its stack with pthread_exit. A torch call that released the GIL takes it back in a
destructor (pybind11's gil_scoped_release), which is noexcept: a thread coming back from one at
that moment (the weight move makes torch calls between its copies, weight_arena.py) has its
forced unwinding stopped there, and the whole process dies in std::terminate: "terminate called
without an active exception", SIGABRT, exit status 134 instead of 0. It was seen at the end of
benchmark processes whose engine's idle-priority threads (the weight move into huge pages, the
KV pool's prefault) were still at work, starved by the steps; an `LLM(...)` whose threads two
busy cores starve for 3 s and that then returns ended so in 1 of 10 runs before `start_thread`
and in none of 10 after it (a plain daemon thread copying tensors in a loop: every time,
tests/engine/test_idle_threads_at_exit.py). A replica stopped soon after /ready (a scale-down,
a rollout) could end the same way. (Python 3.14 makes such a thread hang instead.)

`start_thread` runs `work(stop)` on a daemon thread; `work` looks at `stop` between units of
work (a tensor's copy, a slice of pages) and returns once it is set. At exit (atexit runs
before finalization) every such thread still running is told to stop and joined, for at most
`JOIN_SECONDS` in all: the thread finishes the unit it is in, so the process exits cleanly.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def lower_this_thread(name: str, work: str) -> None:
    """Puts the calling thread at SCHED_IDLE; where that is unavailable (not Linux, a
    sandbox refusing it) it logs at debug that `name` does its `work` at normal priority."""
    try:  # this thread only: on Linux pid 0 is the calling thread
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        log.debug("%s: SCHED_IDLE unavailable; %s at normal priority", name, work)


JOIN_SECONDS = 10.0  # in all, at exit: a unit of work is milliseconds, even at idle priority

_running: dict[threading.Thread, threading.Event] = {}
_lock = threading.Lock()


def start_thread(work: Callable[[threading.Event], None], name: str) -> threading.Thread:
    """`work(stop)` on a daemon thread named `name`, stopped and joined before exit."""
    stop = threading.Event()

    def run() -> None:
        try:
            work(stop)
        finally:
            with _lock:
                _running.pop(thread, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        _running[thread] = stop
    thread.start()
    return thread


def stop_all(timeout: float = JOIN_SECONDS) -> list[str]:
    """Tells every running thread of `start_thread`'s to stop and joins them, `timeout`
    seconds in all; the names of those still running after it (logged)."""
    with _lock:
        running = list(_running.items())
    for _thread, stop in running:
        stop.set()
    deadline = time.monotonic() + timeout
    for thread, _stop in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t, _s in running if t.is_alive()]
    if left:
        log.warning("background threads still running at exit: %s", ", ".join(left))
    return left


atexit.register(stop_all)
