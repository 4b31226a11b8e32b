"""End-to-end scenarios for Preheat.

The local scenario runs the whole product on one machine: the API server emulator the
operator tests use (tests/operator/kmock_apiserver.py), the real operator (`preheat
operator`, a subprocess), and a *local kubelet* — test-harness code, not a Kubernetes
component — that runs each pod's engine container as a local `preheat serve` process.
See docs/e2e.md. `python -m e2e` runs the scenario; pytest runs it as e2e/test_local_scenario.py.
"""
