"""The chart's NetworkPolicy (issue 13 point 5): valid Kubernetes objects, and — read with
NetworkPolicy's own semantics — admitting to engine pods exactly the configured clients,
the operator and engine peers, on the engine port only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes_validate
import pytest
from helm_tools import ensure_tools
from test_helm_chart import K8S, rendered, template

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


def policies(helm, tmp_path, values) -> list[dict[str, Any]]:
    return [o for o in rendered(helm, tmp_path, values) if o["kind"] == "NetworkPolicy"]


def engine(ns: str, service: str = "chat", role: str = "serving") -> Pod:
    return Pod(ns, {"preheat.dev/service": service, "preheat.dev/role": role})


def test_no_network_policy_unless_asked_for(helm, tmp_path):
    assert policies(helm, tmp_path, None) == []


def test_one_valid_policy_per_served_namespace(helm, tmp_path):
    found = policies(helm, tmp_path, VALUES)
    assert sorted(p["metadata"]["namespace"] for p in found) == ["llm-prod", "llm-staging"]
    for p in found:
        kubernetes_validate.validate(p, K8S, strict=True)
    # Without watch.namespaces: the release namespace, where the operator serves.
    [own] = policies(helm, tmp_path, {"networkPolicy": {"enabled": True}})
    assert own["metadata"]["namespace"] == "preheat-system"


def test_engines_admit_exactly_clients_operator_peers_and_scrapers(helm, tmp_path):
    found = policies(helm, tmp_path, VALUES)
    dst = engine("llm-prod")
    allowed = {
        "the operator": Pod("preheat-system", OPERATOR_LABELS),
        "a serving peer": engine("llm-prod", "other"),
        "a warm pod of the same service": engine("llm-prod", role="warm"),
        "a gateway client": Pod("gateway", {"app": "gateway"}),
        "Prometheus": Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    }
    refused = {
        "an operator look-alike elsewhere": Pod("llm-prod", OPERATOR_LABELS),
        "an engine of another namespace": engine("llm-staging"),
        "another pod of the gateway namespace": Pod("gateway", {"app": "batch"}),
        "a pod of the engine's namespace": Pod("llm-prod", {"app": "notebook"}),
        "another pod of the monitoring namespace": Pod("monitoring", {"app": "grafana"}),
    }
    for who, src in allowed.items():
        assert admits(found, src, dst, 8000), who
        assert not admits(found, src, dst, 9000), f"{who}, another port"
    for who, src in refused.items():
        assert not admits(found, src, dst, 8000), who
    # Only engine pods are guarded: the namespace's other pods keep their own rules.
    assert admits(found, Pod("anywhere", {}), Pod("llm-prod", {"app": "notebook"}), 8000)


def test_the_default_clients_are_the_engines_own_namespace(helm, tmp_path):
    found = policies(helm, tmp_path, {"networkPolicy": {"enabled": True}})
    dst = engine("preheat-system")
    assert admits(found, Pod("preheat-system", {"app": "web"}), dst, 8000)
    assert not admits(found, Pod("elsewhere", {"app": "web"}), dst, 8000)


def test_the_evaluator_can_refuse_and_admit():
    """The semantics above, checked on hand-made policies, so the chart tests can fail."""
    open_ns = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                                                        "ingress": [{}]}}
    closed = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert admits([open_ns], Pod("b", {}), Pod("a", {}), 1)
    assert not admits([closed], Pod("a", {}), Pod("a", {}), 1)
    assert admits([open_ns, closed], Pod("b", {}), Pod("a", {}), 1)  # policies add up


def test_cluster_wide_needs_named_namespaces(helm, tmp_path):
    out = template(helm, tmp_path, {"watch": {"allNamespaces": True},
                                    "networkPolicy": {"enabled": True}})
    assert out.returncode != 0
    assert "networkPolicy.namespaces is required with watch.allNamespaces" in out.stderr
    found = policies(helm, tmp_path, {"watch": {"allNamespaces": True},
                                      "networkPolicy": {"enabled": True, "namespaces": ["llm"]}})
    assert [p["metadata"]["namespace"] for p in found] == ["llm"]
