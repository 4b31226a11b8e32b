"""The pod's termination message: why the engine could not start, where Kubernetes looks.

The kubelet mounts a file at the container's `terminationMessagePath` (default
`/dev/termination-log`) and copies what the process wrote there (at most 4096 bytes) into
`status.containerStatuses[].state.terminated.message` (and `lastState` after a restart),
where the operator reads it. PREHEAT_TERMINATION_MESSAGE_PATH names another file (a
container that sets a different terminationMessagePath, or a test). The file is written only
when it exists or was named: outside a pod there is nothing to write to.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_PATH = "/dev/termination-log"
ENV = "PREHEAT_TERMINATION_MESSAGE_PATH"
LIMIT = 4096  # the kubelet keeps no more than this
# A start-up that failed because the model is missing or its credentials were refused:
# the message starts with this, and the operator sets its ModelUnavailable condition.
MODEL_UNAVAILABLE = "ModelUnavailable"


def write(message: str) -> bool:
    named = os.environ.get(ENV)
    path = named or DEFAULT_PATH
    if not named and not os.path.exists(path):
        return False
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message.encode("utf-8")[:LIMIT].decode("utf-8", "ignore"))
        return True
    except OSError as e:
        log.warning("could not write the termination message to %s: %s", path, e)
        return False
