"""Background threads that may run only while nothing else wants a core (the KV pool's
prefaulter, the weights' move into huge pages): Linux's SCHED_IDLE for the calling thread."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def lower_this_thread(name: str, work: str) -> None:
    """Puts the calling thread at SCHED_IDLE; where that is unavailable (not Linux, a
    sandbox refusing it) it logs at debug that `name` does its `work` at normal priority."""
    try:  # this thread only: on Linux pid 0 is the calling thread
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        log.debug("%s: SCHED_IDLE unavailable; %s at normal priority", name, work)
