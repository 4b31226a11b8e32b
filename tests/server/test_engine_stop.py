"""AsyncEngine.stop waits a bounded time for the step in flight and says whether the step
thread ended: when it did not (a step longer than the wait), server_main leaves with
os._exit instead of finalizing the interpreter under a thread inside torch, which aborts
the process (exit 134; engine/idle_priority.py)."""

from __future__ import annotations

import asyncio
import threading

from fake_engine import FakeEngine

from preheat.engine.async_engine import AsyncEngine
from preheat.engine.metrics import Metrics


class SlowStepEngine(FakeEngine):
    """Always has work; each step waits until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.in_step = threading.Event()

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list:
        self.in_step.set()
        self.release.wait(30)
        return []


def test_stop_says_whether_the_step_thread_ended() -> None:
    engine = SlowStepEngine()
    aengine = AsyncEngine(Metrics(), engine)
    loop = asyncio.new_event_loop()
    try:
        aengine.start(loop)
        assert engine.in_step.wait(10) and aengine.stepping
        assert aengine.stop(timeout=0.2) is False  # the step in flight outlives the wait
        assert aengine.stepping
        engine.release.set()  # the step ends; the thread sees the stop and returns
        assert aengine.stop(timeout=10) is True
        assert not aengine.stepping
    finally:
        engine.release.set()
        loop.close()


def test_an_engine_that_never_started_is_not_stepping() -> None:
    aengine = AsyncEngine(Metrics(), FakeEngine())
    assert not aengine.stepping
    assert aengine.stop(timeout=0.1) is True
