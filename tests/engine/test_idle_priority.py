"""Background threads go to SCHED_IDLE (engine/idle_priority.py), the calling thread only."""

from __future__ import annotations

import os
import threading

import pytest

from preheat.engine.idle_priority import lower_this_thread


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_only_the_calling_thread_goes_idle():
    seen = {}

    def background():
        lower_this_thread("test", "waiting")
        seen["policy"] = os.sched_getscheduler(0)

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE
