"""The router's settings: one dataclass, parsed from `preheat router` flags and env.

Every flag also reads PREHEAT_ROUTER_<FLAG>. The address it binds reads PREHEAT_HOST /
PREHEAT_PORT as a fallback, like the engine's, so one pod spec convention serves both.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from preheat.router.policy import Balance

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class RouterConfig:
    service: str  # the InferenceService whose engines this router fronts
    namespace: str = "default"
    host: str = "0.0.0.0"
    port: int = 8000
    engine_port: int = 8000  # DESIGN.md contract: the engines listen here on their pod IP
    # The API server: None = in-cluster (KUBERNETES_SERVICE_HOST/PORT + the service account).
    api_server: str | None = None
    service_account_dir: str = SA_DIR
    # Affinity vs load (policy.py, placement.py): a request goes to its key's pod unless that
    # pod would carry more than balance_factor x the mean load plus balance_slack, the load
    # being requests in flight plus the conversations placed there between turns. Defaults:
    # the measured trade-off (benchmarks/routing_sweep.py, benchmarks/results/routing.md).
    balance_factor: float = Balance.factor
    balance_slack: int = Balance.slack
    # A conversation keeps its seat on its pod this long after its last request (a user's
    # think time); later it is placed afresh (by the same ranking: usually the same pod).
    affinity_window: float = 300.0
    # Router replicas pull each other's placements this often (router/peers.py); 0: never.
    share_interval: float = 0.5
    # This pod's name and IP (the operator sets POD_NAME / POD_IP from the downward API): a
    # router does not pull from itself, and pulls from its pod IP, which its peers check.
    pod_name: str | None = None
    pod_ip: str | None = None
    # The affinity key: the request's text up to the end of its first user message (a
    # conversation keeps its key over turns), at most this many characters.
    affinity_chars: int = 4096
    # Retries (proxy.py): a request that failed before any byte reached the client goes to
    # another Ready pod, up to max_attempts pods, while retry_deadline seconds last.
    max_attempts: int = 4
    retry_deadline: float = 30.0
    connect_timeout: float = 2.0
    # Upstream read timeout between two chunks (a long generation streams; a non-streamed one
    # sends its body at the end).
    read_timeout: float = 600.0
    log_level: str = "info"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"PREHEAT_ROUTER_{name}", default)


def _own_namespace(sa_dir: str) -> str:
    own = os.environ.get("POD_NAMESPACE")
    path = os.path.join(sa_dir, "namespace")
    if not own and os.path.exists(path):
        with open(path) as f:
            own = f.read().strip()
    return own or "default"


def parse_args(argv: list[str]) -> RouterConfig:
    p = argparse.ArgumentParser(
        prog="preheat router",
        description="Run the cache-aware router in front of one InferenceService's Ready "
                    "serving engines. Every flag also reads PREHEAT_ROUTER_<FLAG>.")
    d = RouterConfig(service="")
    p.add_argument("--service", default=_env("SERVICE"),
                   help="The InferenceService whose engines to route to (required).")
    p.add_argument("-n", "--namespace", default=_env("NAMESPACE"),
                   help="Its namespace (default: the pod's own).")
    p.add_argument("--host", default=_env("HOST", os.environ.get("PREHEAT_HOST", d.host)))
    p.add_argument("--port", type=int,
                   default=int(_env("PORT", os.environ.get("PREHEAT_PORT", str(d.port)))))
    p.add_argument("--engine-port", type=int, default=int(_env("ENGINE_PORT", str(d.engine_port))))
    p.add_argument("--api-server", default=_env("API_SERVER"),
                   help="Kubernetes API URL (default: in-cluster, from the service account).")
    p.add_argument("--service-account-dir",
                   default=_env("SERVICE_ACCOUNT_DIR", d.service_account_dir))
    p.add_argument("--balance-factor", type=float,
                   default=float(_env("BALANCE_FACTOR", str(d.balance_factor))),
                   help="A request leaves its prefix's pod when that pod would carry more than "
                        "this times the mean load (plus --balance-slack); the load is the "
                        "requests in flight plus the conversations placed there between turns. "
                        f"Default {d.balance_factor}: measured (benchmarks/routing_sweep.py).")
    p.add_argument("--balance-slack", type=int,
                   default=int(_env("BALANCE_SLACK", str(d.balance_slack))),
                   help=f"Requests or conversations a pod may carry above the bar (default "
                        f"{d.balance_slack}: measured with --balance-factor).")
    p.add_argument("--affinity-window", type=float,
                   default=float(_env("AFFINITY_WINDOW", str(d.affinity_window))),
                   help="Seconds a conversation keeps its seat on its pod after its last request.")
    p.add_argument("--share-interval", type=float,
                   default=float(_env("SHARE_INTERVAL", str(d.share_interval))),
                   help="Seconds between pulls of the peer routers' placements (0: do not share).")
    p.add_argument("--pod-name", default=_env("POD_NAME", os.environ.get("POD_NAME")),
                   help="This router's pod (default: POD_NAME): not a peer of itself.")
    p.add_argument("--pod-ip", default=_env("POD_IP", os.environ.get("POD_IP")),
                   help="This router's pod IP (default: POD_IP): the address it pulls from.")
    p.add_argument("--affinity-chars", type=int,
                   default=int(_env("AFFINITY_CHARS", str(d.affinity_chars))))
    p.add_argument("--max-attempts", type=int, default=int(_env("MAX_ATTEMPTS", str(d.max_attempts))))
    p.add_argument("--retry-deadline", type=float,
                   default=float(_env("RETRY_DEADLINE", str(d.retry_deadline))))
    p.add_argument("--connect-timeout", type=float,
                   default=float(_env("CONNECT_TIMEOUT", str(d.connect_timeout))))
    p.add_argument("--read-timeout", type=float,
                   default=float(_env("READ_TIMEOUT", str(d.read_timeout))))
    p.add_argument("--log-level", default=_env("LOG_LEVEL", d.log_level),
                   choices=("debug", "info", "warning", "error"))
    a = p.parse_args(argv)
    if not a.service:
        p.error("--service (or PREHEAT_ROUTER_SERVICE) is required")
    if a.balance_factor < 1 or a.balance_slack < 0:
        p.error("--balance-factor must be >= 1 and --balance-slack >= 0")
    if a.max_attempts < 1 or a.retry_deadline <= 0 or a.affinity_chars < 1:
        p.error("--max-attempts, --retry-deadline and --affinity-chars must be positive")
    if a.affinity_window < 0 or a.share_interval < 0:
        p.error("--affinity-window and --share-interval must be >= 0")
    return RouterConfig(
        service=a.service, namespace=a.namespace or _own_namespace(a.service_account_dir),
        host=a.host, port=a.port, engine_port=a.engine_port, api_server=a.api_server,
        service_account_dir=a.service_account_dir, balance_factor=a.balance_factor,
        balance_slack=a.balance_slack, affinity_chars=a.affinity_chars,
        affinity_window=a.affinity_window, share_interval=a.share_interval,
        pod_name=a.pod_name or None, pod_ip=a.pod_ip or None,
        max_attempts=a.max_attempts, retry_deadline=a.retry_deadline,
        connect_timeout=a.connect_timeout, read_timeout=a.read_timeout, log_level=a.log_level)
