"""The operator's settings: one dataclass, parsed from `preheat operator` flags and env."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

from preheat.operator.network_policy import PolicySettings


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # empty with all_namespaces False = the pod's namespace
    all_namespaces: bool = False
    peering: str | None = None  # kopf peering name: leader election between replicas
    standalone: bool = False
    # kopf peering: the live operator with the highest priority acts, the others pause; equal
    # priorities pause *all* of them, so every replica needs its own (None: startup_priority()).
    priority: int | None = None
    # How long a replica's peering record stays valid without renewal (kopf renews it 5-10 s
    # before expiry). A replica that dies without saying goodbye blocks the standbys this
    # long; kopf's own default is 60 s.
    peering_lifetime: int = 20
    resync_seconds: float = 30.0  # level-triggered: every service is reconciled this often
    # The built-in autoscaler (metric.type Engine): how often it scrapes and decides (the
    # HPA controller's --horizontal-pod-autoscaler-sync-period is 15 s), and how long one
    # pod's /metrics may take before it counts as missing.
    autoscale_interval: float = 15.0
    metrics_timeout: float = 2.0
    autoscale_log: str | None = None  # append every autoscaling pass as a JSON line
    liveness: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    # The router pods' image (the chart passes the operator's own); None: the engine image.
    router_image: str | None = None
    router_service_account: str = "preheat-router"  # the chart's per-namespace account
    log_level: str = "info"
    # Per-service NetworkPolicies (operator/network_policy.py); the chart fills them in.
    network: PolicySettings = field(default_factory=PolicySettings)
    extra: dict[str, str] = field(default_factory=dict)


def startup_priority(now_ns: int | None = None) -> int:
    """A replica's default peering priority: the earlier it started, the higher.

    Replicas of one Deployment share their flags, so a fixed priority would tie, and kopf
    freezes every operator of a tie. Start time (in microseconds) breaks the tie and keeps
    the longest-running replica in charge: a replica added by a rollout or a scale-up does
    not take over from a working one, it waits until that one is gone.
    """
    return -((time.time_ns() if now_ns is None else now_ns) // 1000)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"PREHEAT_OPERATOR_{name}", default)


def parse_args(argv: list[str]) -> OperatorConfig:
    p = argparse.ArgumentParser(
        prog="preheat operator",
        description="Run the Kubernetes operator that reconciles InferenceService resources "
                    "into warm engine pods. Every flag also reads PREHEAT_OPERATOR_<FLAG>.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=None,
                       help="Namespace to watch (repeatable; globs allowed).")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       default=_env("ALL_NAMESPACES", "") in ("1", "true"),
                       help="Watch every namespace (needs the cluster-wide role).")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", default=_env("PEERING"),
                      help="kopf peering name: replicas elect one active operator.")
    peer.add_argument("--standalone", action="store_true",
                      default=_env("STANDALONE", "") in ("1", "true"),
                      help="Run without peering (a single replica).")
    p.add_argument("--priority", type=int,
                   default=int(_env("PRIORITY")) if _env("PRIORITY") else None,
                   help="kopf peering priority (highest live one acts; default: earlier "
                        "start = higher). Replicas must not share one.")
    p.add_argument("--peering-lifetime", type=int, default=int(_env("PEERING_LIFETIME", "20")),
                   help="Seconds a replica's peering record lives without renewal: how long a "
                        "crashed active replica blocks the standbys (at least 15).")
    p.add_argument("--resync-seconds", type=float, default=float(_env("RESYNC_SECONDS", "30")),
                   help="Re-reconcile every service at least this often.")
    p.add_argument("--autoscale-interval", type=float,
                   default=float(_env("AUTOSCALE_INTERVAL", "15")),
                   help="Seconds between decisions of the built-in autoscaler "
                        "(autoscaling.metric.type Engine).")
    p.add_argument("--metrics-timeout", type=float, default=float(_env("METRICS_TIMEOUT", "2")),
                   help="Seconds one pod's /metrics may take before it counts as missing.")
    p.add_argument("--autoscale-log", default=_env("AUTOSCALE_LOG"),
                   help="Append every pass of the built-in autoscaler (the pods' values, the "
                        "decision, its reason) to this file as JSON lines.")
    p.add_argument("--liveness", default=_env("LIVENESS"),
                   help="Liveness endpoint, e.g. http://0.0.0.0:8080/healthz.")
    p.add_argument("--router-image", default=_env("ROUTER_IMAGE"),
                   help="Image of the router pods (default: each service's engine image).")
    p.add_argument("--router-service-account", default=_env("ROUTER_SERVICE_ACCOUNT", "preheat-router"),
                   help="ServiceAccount the router pods run as (get/list/watch of pods).")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error"))
    p.add_argument("--network-policies", choices=("on", "off"),
                   default=_env("NETWORK_POLICIES", "on"),
                   help="Render a NetworkPolicy per InferenceService (engines admit their "
                        "routers, peers and the operator; clients reach the routers).")
    p.add_argument("--network-clients", default=_env("NETWORK_CLIENTS"),
                   help="JSON list of NetworkPolicyPeers that may call the routers (or the "
                        "engines with the router off); default: every pod of the namespace; "
                        "[] = anyone.")
    p.add_argument("--network-metrics-scrapers", default=_env("NETWORK_METRICS_SCRAPERS", "[]"),
                   help="JSON list of NetworkPolicyPeers that may scrape the engines' /metrics.")
    p.add_argument("--pod-labels", default=_env("POD_LABELS", ""),
                   help="This operator's own pod labels (k=v,k=v or a JSON object): engines "
                        "admit pods with them in POD_NAMESPACE (the /metrics scrape).")
    a = p.parse_args(argv)
    namespaces = tuple(a.namespace or ([_env("NAMESPACE")] if _env("NAMESPACE") else []))
    if not namespaces and not a.all_namespaces:
        # In a pod, default to its own namespace (downward API or the service account).
        own = os.environ.get("POD_NAMESPACE")
        sa = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        if not own and os.path.exists(sa):
            own = open(sa).read().strip()
        namespaces = (own or "default",)
    if a.resync_seconds <= 0:
        p.error("--resync-seconds must be positive")
    if a.autoscale_interval <= 0 or a.metrics_timeout <= 0:
        p.error("--autoscale-interval and --metrics-timeout must be positive")
    if a.peering_lifetime < 15:
        # kopf renews 5-10 s before expiry: shorter leaves no margin for a slow API call.
        p.error("--peering-lifetime must be at least 15 seconds")
    try:
        clients = json.loads(a.network_clients) if a.network_clients else None
        scrapers = json.loads(a.network_metrics_scrapers or "[]")
        text = a.pod_labels.strip()
        labels = json.loads(text) if text.startswith("{") else \
            dict(kv.split("=", 1) for kv in text.split(",") if kv.strip())
    except ValueError as e:
        p.error(f"network policy settings: {e}")
    if not isinstance(scrapers, list) or not (clients is None or isinstance(clients, list)):
        p.error("--network-clients and --network-metrics-scrapers must be JSON lists")
    network = PolicySettings(enabled=a.network_policies == "on",
                             operator_namespace=os.environ.get("POD_NAMESPACE"),
                             operator_labels={k.strip(): v.strip() for k, v in labels.items()},
                             clients=tuple(clients) if clients is not None else
                             PolicySettings().clients,
                             metrics_scrapers=tuple(scrapers))
    return OperatorConfig(namespaces=namespaces, all_namespaces=a.all_namespaces,
                          peering=a.peering, standalone=a.standalone or not a.peering,
                          priority=a.priority, peering_lifetime=a.peering_lifetime,
                          resync_seconds=a.resync_seconds,
                          autoscale_interval=a.autoscale_interval,
                          metrics_timeout=a.metrics_timeout, autoscale_log=a.autoscale_log,
                          liveness=a.liveness, router_image=a.router_image,
                          router_service_account=a.router_service_account,
                          log_level=a.log_level, network=network)
