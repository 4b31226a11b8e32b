"""The NetworkPolicies the operator renders per InferenceService, configured by the chart
(networkPolicy.* -> the operator Deployment's env -> operator/config.py): valid Kubernetes
objects, and — read with NetworkPolicy's own semantics — admitting to a service's engine
pods exactly its routers, its own peers, the operator and the scrapers, and to its routers
the configured clients, on the engine port only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes_validate
import pytest
from helm_tools import ensure_tools
from test_helm_chart import K8S, rendered

from preheat.operator import render
from preheat.operator.config import parse_args
from preheat.operator.network_policy import network_policies

OPERATOR_LABELS = {"app.kubernetes.io/name": "preheat", "app.kubernetes.io/instance": "preheat",
                   "app.kubernetes.io/component": "operator"}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
           "podSelector": {"matchLabels": {"app": "gateway"}}}
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchExpressions": [
                  {"key": "app.kubernetes.io/name", "operator": "In", "values": ["prometheus"]}]}}
VALUES = {"watch": {"namespaces": ["llm-prod", "llm-staging"]},
          "networkPolicy": {"enabled": True, "clients": [GATEWAY], "metricsScrapers": [PROMETHEUS]}}


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Mapping[str, str]


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector (an empty one selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []),
              "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _peer_admits(peer: Mapping[str, Any], policy_ns: str, src: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # these tests use pods only
    if "namespaceSelector" in peer:
        ns_labels = {"kubernetes.io/metadata.name": src.namespace}  # set by the API server
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif src.namespace != policy_ns:
        return False  # a podSelector alone means the policy's own namespace
    return selects(peer.get("podSelector") or {}, src.labels)


def admits(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    """Whether ingress from src to dst:port is allowed, as a NetworkPolicy plugin decides:
    a pod no policy selects admits everything; a selected one what any rule allows."""
    applicable = [p for p in policies if p["metadata"]["namespace"] == dst.namespace
                  and "Ingress" in p["spec"]["policyTypes"]
                  and selects(p["spec"]["podSelector"], dst.labels)]
    if not applicable:
        return True
    for p in applicable:
        for rule in p["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(pp.get("port") == port for pp in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_admits(peer, p["metadata"]["namespace"], src) for peer in peers):
                return True
    return False


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_tools()["helm"])


def operator_settings(helm, tmp_path, values):
    """The operator's PolicySettings as its Deployment's env (from the chart) gives them."""
    objects = rendered(helm, tmp_path, values)
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]  # the operator renders them
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    env["POD_NAMESPACE"] = "preheat-system"  # the downward API's value
    saved = dict(os.environ)
    try:
        os.environ.update({k: v for k, v in env.items() if v is not None})
        return parse_args(["--standalone"]).network
    finally:
        os.environ.clear()
        os.environ.update(saved)


def policies(helm, tmp_path, values, service="chat", ns="llm-prod", raw_spec=None) -> list[dict[str, Any]]:
    settings = operator_settings(helm, tmp_path, values)
    out = network_policies(service, ns, render.child_metadata(service, ns, "uid-1"), raw_spec or {}, settings)
    for p in out:
        kubernetes_validate.validate(p, K8S, strict=True)
    return out


def engine(ns: str, service: str = "chat", role: str = "serving") -> Pod:
    return Pod(ns, {"preheat.dev/service": service, "preheat.dev/role": role})


def test_policies_are_on_by_default_and_can_be_turned_off(helm, tmp_path):
    assert [p["metadata"]["name"] for p in policies(helm, tmp_path, None)] == ["chat-engines", "chat-router"]
    assert policies(helm, tmp_path, {"networkPolicy": {"enabled": False}}) == []


def test_engines_admit_exactly_their_routers_peers_the_operator_and_scrapers(helm, tmp_path):
    found = policies(helm, tmp_path, VALUES)
    dst = engine("llm-prod")
    allowed = {
        "the operator": Pod("preheat-system", OPERATOR_LABELS),
        "its router": engine("llm-prod", role="router"),
        "a serving peer": engine("llm-prod"),
        "a warm pod of the same service": engine("llm-prod", role="warm"),
        "Prometheus": Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    }
    refused = {
        "an engine of another service": engine("llm-prod", "other"),
        "another service's router": engine("llm-prod", "other", role="router"),
        "an operator look-alike elsewhere": Pod("llm-prod", OPERATOR_LABELS),
        "an engine of another namespace": engine("llm-staging"),
        "a gateway client (clients go through the router)": Pod("gateway", {"app": "gateway"}),
        "a pod of the engine's namespace": Pod("llm-prod", {"app": "notebook"}),
        "another pod of the monitoring namespace": Pod("monitoring", {"app": "grafana"}),
    }
    for who, src in allowed.items():
        assert admits(found, src, dst, 8000), who
        assert not admits(found, src, dst, 9000), f"{who}, another port"
    for who, src in refused.items():
        assert not admits(found, src, dst, 8000), who
    # Only the service's pods are guarded: the namespace's other pods keep their own rules.
    assert admits(found, Pod("anywhere", {}), Pod("llm-prod", {"app": "notebook"}), 8000)


def test_clients_reach_the_router_and_with_the_router_off_the_engines(helm, tmp_path):
    found = policies(helm, tmp_path, VALUES)
    router = engine("llm-prod", role="router")
    assert admits(found, Pod("gateway", {"app": "gateway"}), router, 8000)
    assert not admits(found, Pod("gateway", {"app": "batch"}), router, 8000)
    # The service's other routers (they pull each other's placements), no one else's.
    assert admits(found, engine("llm-prod", role="router"), router, 8000)
    assert not admits(found, engine("llm-prod", "other", role="router"), router, 8000)
    assert not admits(found, engine("llm-prod"), router, 8000)
    direct = policies(helm, tmp_path, VALUES, raw_spec={"router": {"enabled": False}})
    assert admits(direct, Pod("gateway", {"app": "gateway"}), engine("llm-prod"), 8000)
    assert not admits(direct, Pod("llm-prod", {"app": "notebook"}), engine("llm-prod"), 8000)


def test_the_default_clients_are_the_services_own_namespace(helm, tmp_path):
    found = policies(helm, tmp_path, None, ns="preheat-system")
    dst = engine("preheat-system", role="router")
    assert admits(found, Pod("preheat-system", {"app": "web"}), dst, 8000)
    assert not admits(found, Pod("elsewhere", {"app": "web"}), dst, 8000)
    assert not admits(found, Pod("preheat-system", {"app": "web"}), engine("preheat-system"), 8000)


def test_the_evaluator_can_refuse_and_admit():
    """The semantics above, checked on hand-made policies, so the chart tests can fail."""
    open_ns = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                                                        "ingress": [{}]}}
    closed = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert admits([open_ns], Pod("b", {}), Pod("a", {}), 1)
    assert not admits([closed], Pod("a", {}), Pod("a", {}), 1)
    assert admits([open_ns, closed], Pod("b", {}), Pod("a", {}), 1)  # policies add up
