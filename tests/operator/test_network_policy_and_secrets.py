"""The operator's least-privilege parts, pure: the per-service NetworkPolicies (who reaches
the engines, who the routers), the peer Secret it creates and mounts, and a missing
Secret read off the pods' CreateContainerConfigError (the operator has no get on
Secrets)."""

from __future__ import annotations

import base64

import crd_schema
import kubernetes_validate

from preheat.operator import peer_secret, render
from preheat.operator.network_policy import PolicySettings, network_policies
from preheat.operator.pod_config import config_problems
from preheat.operator.spec import parse_spec

K8S = "1.30.0"
UID = "0b5f7e4e-5d0b-4c59-9d43-1b1f1e0c0a11"
SETTINGS = PolicySettings(operator_namespace="preheat-system", operator_labels={"app": "preheat-op"},
                          clients=({"namespaceSelector": {"matchLabels": {"team": "web"}}},),
                          metrics_scrapers=({"namespaceSelector": {"matchLabels": {"m": "1"}}},))


def policies(raw_spec: dict, settings: PolicySettings = SETTINGS) -> dict[str, dict]:
    out = network_policies("chat", "ml", render.child_metadata("chat", "ml", UID), raw_spec, settings)
    for p in out:
        kubernetes_validate.validate(p, K8S, strict=True)
    return {p["metadata"]["name"]: p for p in out}


def peers(policy: dict) -> list[dict]:
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    return rule["from"]


def test_engines_admit_their_routers_peers_and_the_operator_not_the_clients():
    got = policies({})  # spec.router absent: the router is on by default
    assert set(got) == {"chat-engines", "chat-router"}
    engines = got["chat-engines"]
    assert engines["spec"]["podSelector"] == {"matchExpressions": [
        {"key": "preheat.dev/service", "operator": "In", "values": ["chat"]},
        {"key": "preheat.dev/role", "operator": "NotIn", "values": ["router"]}]}
    assert peers(engines) == [
        {"podSelector": {"matchLabels": {"preheat.dev/service": "chat", "preheat.dev/role": "router"}}},
        {"podSelector": engines["spec"]["podSelector"]},  # same service, any engine role
        {"podSelector": {"matchLabels": {"app": "preheat-op"}},
         "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "preheat-system"}}},
        {"namespaceSelector": {"matchLabels": {"m": "1"}}},
    ]
    # No preheat pod of another service is a peer (the chart's old policy admitted any).
    assert all("Exists" not in str(p) for p in peers(engines))
    router = got["chat-router"]
    assert router["spec"]["podSelector"] == {"matchLabels": {"preheat.dev/service": "chat",
                                                             "preheat.dev/role": "router"}}
    # The clients, and the other routers of the service (they share their placements).
    assert peers(router) == [{"podSelector": router["spec"]["podSelector"]},
                             {"namespaceSelector": {"matchLabels": {"team": "web"}}}]
    assert engines["metadata"]["ownerReferences"][0]["uid"] == UID


def test_with_the_router_off_the_clients_reach_the_engines():
    got = policies({"router": {"enabled": False}})
    assert set(got) == {"chat-engines"}
    assert {"namespaceSelector": {"matchLabels": {"team": "web"}}} in peers(got["chat-engines"])
    assert not any((p.get("podSelector") or {}).get("matchLabels", {}).get("preheat.dev/role") == "router"
                   for p in peers(got["chat-engines"]))


def test_policies_can_be_turned_off():
    assert policies({}, PolicySettings(enabled=False)) == {}


def test_the_peer_secret_is_random_created_under_its_name_and_mounted_read_only():
    a = peer_secret.manifest("chat", "ml", peer_secret.owner("chat", UID, None))
    b = peer_secret.manifest("chat", "ml", peer_secret.owner("chat", UID, None))
    kubernetes_validate.validate(a, K8S, strict=True)
    assert a["metadata"]["name"] == "chat-peer" and a["data"]["current"] != b["data"]["current"]
    assert len(base64.b64decode(a["data"]["current"])) == 64
    # Without a claim the service owns it; with one, the claim does (kept with a retained claim).
    assert a["metadata"]["ownerReferences"][0]["uid"] == UID
    claim = {"metadata": {"name": "chat-snapshots", "uid": "claim-uid"}}
    ref = peer_secret.owner("chat", UID, claim)
    assert (ref["kind"], ref["uid"], ref["blockOwnerDeletion"]) == ("PersistentVolumeClaim", "claim-uid", False)
    cr = crd_schema.apply_defaults({"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
                                    "metadata": {"name": "chat"},
                                    "spec": {"engine": {"image": "x"}, "snapshot": {"enabled": True}}},
                                   crd_schema.load_schema())
    pod = render.pod_spec("chat", parse_spec(cr["spec"]))
    [container] = pod["containers"]
    assert {"name": "PREHEAT_PEER_SECRET_FILE", "value": "/etc/preheat/peer-secret"} in container["env"]
    assert {"name": "peer-secret", "mountPath": "/etc/preheat/peer-secret", "readOnly": True} in \
        container["volumeMounts"]
    assert {"name": "peer-secret", "secret": {"secretName": "chat-peer", "defaultMode": 0o440}} in pod["volumes"]
    assert "chat-peer" not in str(container["env"])  # a file, never an env value


def waiting_pod(name: str, message: str, reason: str = "CreateContainerConfigError") -> dict:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "engine", "ready": False, "state": {"waiting": {"reason": reason, "message": message}}}]}}


SPEC = {"engine": {"apiKeySecretRef": {"name": "llm-key", "key": "token"},
                   "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "misc", "key": "x"}}}]},
        "model": {"credentialsSecretRef": {"name": "hub-token"}}}


def test_a_missing_secret_is_read_off_the_pods_and_named_with_its_field():
    problems = config_problems([waiting_pod("chat-a", 'secret "llm-key" not found'),
                                waiting_pod("chat-b", 'secret "llm-key" not found'),
                                waiting_pod("chat-c", "couldn't find key token in Secret ml/hub-token"),
                                waiting_pod("chat-d", 'secret "misc" not found'),
                                waiting_pod("chat-e", "", reason="ContainerCreating")], SPEC)
    assert [r for r, _ in problems] == ["SecretNotFound", "SecretKeyNotFound", "SecretNotFound"]
    assert problems[0][1] == ("Secret 'llm-key' (spec.engine.apiKeySecretRef) not found in the service's "
                              "namespace: the pods cannot start (CreateContainerConfigError); "
                              "no new pods until they can")
    assert "Secret 'hub-token' (spec.model.credentialsSecretRef) has no key 'token'" in problems[1][1]
    assert "(spec.engine.env[X])" in problems[2][1]


def test_another_config_error_is_reported_in_the_kubelets_words_and_healthy_pods_are_not():
    [(reason, message)] = config_problems([waiting_pod("p", 'configmap "cfg" not found')], {})
    assert reason == "ContainerConfigError" and 'configmap "cfg" not found' in message
    running = {"metadata": {"name": "q"}, "status": {"containerStatuses": [{"state": {"running": {}}}]}}
    gone = {**waiting_pod("r", 'secret "x" not found'), "metadata": {"name": "r", "deletionTimestamp": "t"}}
    assert config_problems([running, gone], SPEC) == []
