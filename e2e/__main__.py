"""`python -m e2e`: run the local end-to-end scenario and print its timings.

    python -m e2e                  # local: API emulator + operator + local kubelet
    python -m e2e --real-cluster   # the same scenario on the cluster of $KUBECONFIG
    python -m e2e --autoscale      # local: built-in autoscaling under streaming load

Extra arguments go to pytest (e.g. -x, --timeout=900). The scenario itself lives in the
tests, so the command and CI run exactly the same steps and assertions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    target = HERE / "test_local_scenario.py"
    if "--real-cluster" in argv:
        argv = [a for a in argv if a != "--real-cluster"]
        target = HERE / "real_cluster" / "test_real_cluster.py"
    elif "--autoscale" in argv:
        argv = [a for a in argv if a != "--autoscale"]
        target = HERE / "test_autoscale_scenario.py"
    # -s: the timings and, on failure, the operator and engine logs are printed.
    return int(pytest.main(["-s", "-q", "-rs", "-p", "no:cacheprovider",
                            "--rootdir", str(HERE.parent), str(target), *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
