"""The NetworkPolicies of one InferenceService: pure rendering, one small module (the router
side is another engineer's; spec.router.enabled is read defensively, default true).

- `<name>-engines` selects the service's engine pods (`preheat.dev/service=<name>`, any
  role but `router`) and admits, on the engine port, only: the service's router pods
  (`role=router`), its other engine pods (a starting pod fetches a snapshot from a serving
  peer), the operator's pods (the built-in autoscaler reads /metrics) and the configured
  metrics scrapers. With the router off (spec.router.enabled: false) the engines are the
  clients' entry, so the configured clients are admitted too.
- `<name>-router` selects the router pods and admits the configured clients (default:
  any pod of the namespace, as the chart's networkPolicy.clients says) and the service's
  other router pods, which pull each other's placements (router/peers.py).

What these cannot do: a pod that carries the service's labels is a "peer" to them. That is
why /admin/* also asks for the peer secret (engine/serve/http_auth.py) and snapshots are signed:
the policy narrows who can reach an engine, the secret decides who may take its cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from preheat.operator.resources import LABEL_ROLE, LABEL_SERVICE

ENGINE_PORT = 8000
ROLE_ROUTER = "router"  # DESIGN.md: pod label preheat.dev/role=router


@dataclass(frozen=True)
class PolicySettings:
    """What the chart tells the operator (operator/config.py: PREHEAT_OPERATOR_NETWORK_*)."""
    enabled: bool = True
    operator_namespace: str | None = None  # where the operator pods run
    operator_labels: Mapping[str, str] = field(default_factory=dict)
    clients: Sequence[Mapping[str, Any]] = ({"podSelector": {}},)  # NetworkPolicyPeers
    metrics_scrapers: Sequence[Mapping[str, Any]] = ()


def router_enabled(raw_spec: Mapping[str, Any]) -> bool:
    router = raw_spec.get("router")
    return not (isinstance(router, Mapping) and router.get("enabled") is False)


def _engines_selector(name: str) -> dict[str, Any]:
    return {"matchExpressions": [
        {"key": LABEL_SERVICE, "operator": "In", "values": [name]},
        {"key": LABEL_ROLE, "operator": "NotIn", "values": [ROLE_ROUTER]},
    ]}


def _routers_selector(name: str) -> dict[str, Any]:
    return {"matchLabels": {LABEL_SERVICE: name, LABEL_ROLE: ROLE_ROUTER}}


def _operator_peer(s: PolicySettings) -> list[dict[str, Any]]:
    if not s.operator_labels:
        return []
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(s.operator_labels)}}
    if s.operator_namespace:
        peer["namespaceSelector"] = {"matchLabels": {
            "kubernetes.io/metadata.name": s.operator_namespace}}
    return [peer]


def _policy(name: str, namespace: str, metadata: Mapping[str, Any], selector: dict[str, Any],
            peers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {**metadata, "name": name, "namespace": namespace},
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                 "ingress": [{"ports": [{"port": ENGINE_PORT, "protocol": "TCP"}], "from": peers}]},
    }


def policy_names(name: str) -> tuple[str, str]:
    return f"{name}-engines", f"{name}-router"


def network_policies(name: str, namespace: str, metadata: Mapping[str, Any],
                     raw_spec: Mapping[str, Any], s: PolicySettings) -> list[dict[str, Any]]:
    """The policies to have (empty when turned off). `metadata` carries the child labels
    and owner reference (render.child_metadata)."""
    if not s.enabled:
        return []
    engines_name, router_name = policy_names(name)
    with_router = router_enabled(raw_spec)
    peers = [{"podSelector": _engines_selector(name)}, *_operator_peer(s),
             *(dict(p) for p in s.metrics_scrapers)]
    if with_router:
        peers.insert(0, {"podSelector": _routers_selector(name)})
    else:
        peers.extend(dict(p) for p in s.clients)
    out = [_policy(engines_name, namespace, metadata, _engines_selector(name), peers)]
    if with_router:
        out.append(_policy(router_name, namespace, metadata, _routers_selector(name),
                           [{"podSelector": _routers_selector(name)},
                            *(dict(p) for p in s.clients)]))
    return out
