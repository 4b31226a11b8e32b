"""Issue 13 point 5, the pure parts: whose object is it (never adopt a foreign Service, HPA,
claim or budget), and how the pods get the API key. No cluster: the decisions are
functions of the objects as the API returns them. (Whether the Secret exists is read off
the pods, never the Secret: tests/operator/test_network_policy_and_secrets.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from preheat.operator import render
from preheat.operator.ownership import Ownership, conflict, ownership
from preheat.operator.spec import SecretKeyRef, SpecError, parse_spec

UID = "uid-ours"


def obj(name: str = "chat", refs: list[dict[str, Any]] | None = None,
        labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if refs is not None:
        meta["ownerReferences"] = refs
    if labels is not None:
        meta["labels"] = labels
    return {"metadata": meta}


def ref(uid: str, kind: str = "InferenceService", name: str = "chat",
        controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "x/v1", "kind": kind, "name": name, "uid": uid, "controller": controller}


def test_only_our_owner_reference_makes_an_object_ours():
    assert ownership(None, "chat", UID) is Ownership.ABSENT
    assert ownership(obj(refs=[ref(UID)]), "chat", UID) is Ownership.OURS
    # Ours among others (e.g. a non-controller reference someone added) is still ours.
    assert ownership(obj(refs=[ref("x", "ConfigMap", controller=False), ref(UID)]),
                     "chat", UID) is Ownership.OURS
    # A hand-made object, another controller's, or a previous service's of the same name
    # (a different uid, waiting for the garbage collector): none of them is ours.
    assert ownership(obj(), "chat", UID) is Ownership.FOREIGN
    assert ownership(obj(refs=[ref("other", "Deployment", "web")]), "chat", UID) is Ownership.FOREIGN
    assert ownership(obj(refs=[ref("old-uid")]), "chat", UID) is Ownership.FOREIGN
    # Our label alone does not make a Service, HPA or budget ours: anyone can set labels.
    assert ownership(obj(labels={"preheat.dev/service": "chat"}), "chat", UID) is Ownership.FOREIGN


def test_a_retained_snapshot_claim_is_adoptable_and_nothing_else_is():
    retained = obj("chat-snapshots", labels={"preheat.dev/service": "chat"})
    assert ownership(retained, "chat", UID, adopt_retained=True) is Ownership.ADOPTABLE
    # Without our label (someone's own claim of that name), with another service's label,
    # or with another controller: foreign, even for the claim.
    for claim in (obj("chat-snapshots"),
                  obj("chat-snapshots", labels={"preheat.dev/service": "other"}),
                  obj("chat-snapshots", refs=[ref("other", "StatefulSet", "db")],
                      labels={"preheat.dev/service": "chat"})):
        assert ownership(claim, "chat", UID, adopt_retained=True) is Ownership.FOREIGN
    # A non-controller reference (e.g. a backup tool's) does not stop the adoption.
    kept = obj("chat-snapshots", refs=[ref("b", "Backup", "nightly", controller=False)],
               labels={"preheat.dev/service": "chat"})
    assert ownership(kept, "chat", UID, adopt_retained=True) is Ownership.ADOPTABLE


@pytest.mark.parametrize("kind, reason, blocks", [
    ("Service", "ServiceConflict", False),
    ("PersistentVolumeClaim", "PVCConflict", True),
    ("HorizontalPodAutoscaler", "HPAConflict", False),
    ("PodDisruptionBudget", "PDBConflict", False),
])
def test_a_conflict_names_the_object_and_its_owner(kind, reason, blocks):
    c = conflict(kind, obj("chat", refs=[ref("d", "Deployment", "web")]), "chat")
    assert (c.kind, c.name, c.reason, c.blocks_pods) == (kind, "chat", reason, blocks)
    assert f"{kind} 'chat' already exists and is not owned by InferenceService 'chat'" in c.message
    assert "Deployment 'web'" in c.message and "left untouched" in c.message
    bare = conflict(kind, obj("chat"), "chat")
    assert "it has no owner reference" in bare.message


REF = SecretKeyRef("llm-key", "token")


def spec_with(**engine: Any) -> Any:
    return parse_spec({"engine": {"image": "e:1", **engine}})


def test_the_engines_read_the_key_from_the_secret_never_from_the_pod_spec():
    spec = spec_with(apiKeySecretRef={"name": "llm-key", "key": "token"})
    assert spec.engine.api_key_secret == REF
    pod = render.pod("chat", "ns", UID, spec, "chat-abc", "warm")
    [env] = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PREHEAT_API_KEY"]
    assert env == {"name": "PREHEAT_API_KEY",
                   "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "token"}}}
    # Serving and warm pods are one template (a promotion only relabels): the same env.
    serving = render.pod("chat", "ns", UID, spec, "chat-def", "serving")
    assert serving["spec"] == pod["spec"]
    # The probes and the metrics the operator reads stay unauthenticated engine routes.
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # Without a ref: no key at all (the engine then serves without authentication).
    plain = render.pod("chat", "ns", UID, spec_with(), "chat-abc", "warm")
    assert all(e["name"] != "PREHEAT_API_KEY" for e in plain["spec"]["containers"][0]["env"])
    # A user's own PREHEAT_API_KEY in engine.env wins, like every other engine variable.
    mine = {"name": "PREHEAT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "a", "key": "b"}}}
    both = spec_with(apiKeySecretRef={"name": "llm-key", "key": "token"}, env=[mine])
    env_list = render.pod("chat", "ns", UID, both, "p", "warm")["spec"]["containers"][0]["env"]
    assert [e for e in env_list if e["name"] == "PREHEAT_API_KEY"] == [mine]


@pytest.mark.parametrize("bad", [{"name": "k"}, {"key": "t"}, {"name": "", "key": "t"}, "k"])
def test_an_incomplete_secret_ref_is_a_spec_error(bad):
    with pytest.raises(SpecError) as e:
        spec_with(apiKeySecretRef=bad)
    assert e.value.reason == "InvalidSpec" and "apiKeySecretRef" in e.value.message
