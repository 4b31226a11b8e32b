"""The Kubernetes API emulator of the operator tests, imported from where it lives.

tests/operator/kmock_apiserver.py is the one copy (its docstring lists what it models);
the e2e harness imports it by path rather than keeping a second copy in step.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_OPERATOR_TESTS = _HERE.parent / "tests" / "operator"
if str(_OPERATOR_TESTS) not in sys.path:
    sys.path.append(str(_OPERATOR_TESTS))

from kmock_apiserver import KubeAPIServer, write_kubeconfig  # noqa: E402

__all__ = ["KubeAPIServer", "write_kubeconfig"]
