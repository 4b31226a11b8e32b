"""The CRD, the samples and everything the operator renders are valid Kubernetes objects."""

from __future__ import annotations

import copy
import pathlib

import crd_schema
import kubernetes_validate
import pytest
import yaml

from preheat.operator import network_policy, peer_secret, render
from preheat.operator.spec import parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = "1.30.0"
SAMPLES = sorted((ROOT / "examples").glob("inferenceservice-*.yaml"))


def test_the_crd_is_a_valid_1_30_object():
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.yaml").read_text())
    kubernetes_validate.validate(crd, K8S, strict=True)


def test_there_are_samples():
    assert len(SAMPLES) >= 2


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_pass_the_crd_schema(sample):
    assert crd_schema.errors(yaml.safe_load(sample.read_text())) == []


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_every_object_rendered_from_a_sample_is_a_valid_1_30_object(sample):
    cr = crd_schema.apply_defaults(yaml.safe_load(sample.read_text()), crd_schema.load_schema())
    spec = parse_spec(cr["spec"])
    name, ns, uid = cr["metadata"]["name"], "default", "0b5f7e4e-5d0b-4c59-9d43-1b1f1e0c0a11"
    objects = [
        render.pod(name, ns, uid, spec, f"{name}-abc123", "warm"),
        render.service(name, ns, uid),
        render.snapshot_claim(name, ns, uid, spec),
    ]
    if spec.disruption_budget.enabled:
        objects.append(render.disruption_budget(name, ns, uid, spec))
    hpa = render.autoscaler(name, ns, uid, spec)
    assert (hpa is None) == (spec.autoscaling is None or spec.autoscaling.engine_mode)
    if hpa is not None:
        objects.append(hpa)
    objects.append(peer_secret.manifest(name, ns, peer_secret.owner(name, uid, None)))
    settings = network_policy.PolicySettings(operator_namespace="preheat-system",
                                             operator_labels={"app.kubernetes.io/name": "preheat"},
                                             metrics_scrapers=({"namespaceSelector": {}},))
    for router in (True, False):
        objects += network_policy.network_policies(
            name, ns, render.child_metadata(name, ns, uid),
            {**cr["spec"], "router": {"enabled": router}}, settings)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_crd_defaults_and_operator_defaults_agree():
    bare = {"model": {}, "engine": {"image": "x"}, "snapshot": {}, "warmPool": {},
            "readiness": {}}
    defaulted = crd_schema.apply_defaults(
        {"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "x"}, "spec": copy.deepcopy(bare)}, crd_schema.load_schema())
    assert parse_spec(defaulted["spec"]) == parse_spec(bare)


def _cr(**spec):
    base = {"model": {"path": "/m"}, "engine": {"image": "img"}}
    base.update(spec)
    return {"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "svc"}, "spec": base}


BAD = {
    "no engine": ({"engine": None}, "'engine' is a required property"),
    "negative replicas": ({"replicas": -1}, "-1 is less than the minimum of 0"),
    "negative warm pool": ({"warmPool": {"size": -2}}, "-2 is less than the minimum of 0"),
    "two model sources": ({"model": {"path": "/m", "uri": "hf://x"}},
                          "model: set at most one of path, pvc or uri"),
    "min above max": ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2, "metric": {
        "type": "Resource", "name": "cpu", "targetAverageUtilization": 80}}},
        "autoscaling.minReplicas must be <= maxReplicas"),
    "pods metric without target": ({"autoscaling": {"maxReplicas": 3, "metric": {
        "type": "Pods", "name": "preheat_num_requests_running"}}},
        "a Pods metric needs targetAverageValue"),
    "engine metric that is not an engine gauge": ({"autoscaling": {"maxReplicas": 3, "metric": {
        "type": "Engine", "name": "cpu", "targetAverageValue": 2}}},
        "an Engine metric is one of preheat_num_requests_waiting"),
    "engine metric without target": ({"autoscaling": {"maxReplicas": 3, "metric": {
        "type": "Engine", "name": "preheat_num_requests_waiting"}}},
        "an Engine metric needs targetAverageValue"),
    "external metric without target": ({"autoscaling": {"maxReplicas": 3, "metric": {
        "type": "External", "name": "preheat_num_requests_waiting"}}},
        "an External metric needs targetAverageValue"),
    "unknown metric type": ({"autoscaling": {"maxReplicas": 3, "metric": {
        "type": "Object", "name": "x", "targetAverageValue": 1}}}, "is not one of"),
    "stabilization beyond an hour": ({"autoscaling": {
        "maxReplicas": 3, "scaleDownStabilizationSeconds": 7200, "metric": {
            "type": "Engine", "name": "preheat_num_requests_waiting", "targetAverageValue": 2}}},
        "7200 is greater than the maximum of 3600"),
    "bad snapshot size": ({"snapshot": {"size": "lots"}}, "'lots' does not match"),
    "unknown access mode": ({"snapshot": {"accessMode": "ReadMany"}}, "is not one of"),
    "unknown field": ({"replicaz": 3}, ".spec.replicaz: field not declared in schema"),
    "pvc without claim": ({"model": {"pvc": {"path": "x"}}}, "'claimName' is a required property"),
    "unknown snapshot storage": ({"snapshot": {"storage": "Somewhere"}}, "is not one of"),
    "surge not a percentage": ({"rollout": {"maxSurge": "lots"}},
                               "rollout.maxSurge must be a non-negative integer or a percentage"),
    "negative surge": ({"rollout": {"maxSurge": -1}},
                       "rollout.maxSurge must be a non-negative integer or a percentage"),
    "unavailable not a percentage": ({"rollout": {"maxUnavailable": "25 %"}},
                                     "rollout.maxUnavailable must be a non-negative integer"),
    "bad budget": ({"disruptionBudget": {"maxUnavailable": "one"}},
                   "disruptionBudget.maxUnavailable must be a non-negative integer"),
    "negative failover grace": ({"failover": {"unreadySeconds": -1}}, "less than the minimum of 0"),
    "endpoint delay beyond the grace": (
        {"readiness": {"terminationGracePeriodSeconds": 10, "endpointDelaySeconds": 10}},
        "readiness.endpointDelaySeconds must be below terminationGracePeriodSeconds"),
    "zero deadline": ({"rollout": {"progressDeadlineSeconds": 0}}, "less than the minimum of 1"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_resources_are_refused_with_a_clear_message(case):
    patch, expected = BAD[case]
    cr = _cr(**patch)
    cr["spec"] = {k: v for k, v in cr["spec"].items() if v is not None}
    found = crd_schema.errors(cr)
    assert any(expected in e for e in found), found


def test_a_too_long_name_is_refused():
    cr = _cr()
    cr["metadata"]["name"] = "x" * 53
    assert crd_schema.errors(cr) == ["<root>: metadata.name must be at most 52 characters"]


def test_the_1_30_validation_is_strict_and_offline():
    # Guards the checks above from passing vacuously: a stray field must be refused.
    pod = render.pod("x", "default", "uid", parse_spec(_cr()["spec"]), "x-1", "warm")
    pod["spec"]["containers"][0]["bogus"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S, strict=True)


def _auto(metric: dict, **extra) -> dict:
    return _cr(autoscaling={"maxReplicas": 4, "metric": metric, **extra})["spec"]


def test_engine_mode_defaults_the_windows_like_the_hpa_and_renders_no_hpa():
    cr = _cr(autoscaling={"maxReplicas": 4, "metric": {
        "type": "Engine", "name": "preheat_kv_cache_usage_ratio", "targetAverageValue": "0.8"}})
    assert crd_schema.errors(cr) == []
    defaulted = crd_schema.apply_defaults(cr, crd_schema.load_schema())["spec"]["autoscaling"]
    assert (defaulted["scaleUpStabilizationSeconds"], defaulted["scaleDownStabilizationSeconds"],
            defaulted["minReplicas"]) == (0, 300, 1)
    auto = parse_spec(cr["spec"]).autoscaling
    assert auto.engine_mode and (auto.scale_up_stabilization_seconds,
                                 auto.scale_down_stabilization_seconds) == (0, 300)
    assert render.autoscaler("svc", "default", "uid", parse_spec(cr["spec"])) is None


@pytest.mark.parametrize("metric,expected", [
    ({"type": "Pods", "name": "preheat_num_requests_running", "targetAverageValue": 16},
     {"type": "Pods", "pods": {"metric": {"name": "preheat_num_requests_running"},
                               "target": {"type": "AverageValue", "averageValue": "16"}}}),
    ({"type": "External", "name": "preheat_num_requests_waiting", "targetAverageValue": "4"},
     {"type": "External", "external": {
         "metric": {"name": "preheat_num_requests_waiting", "selector": {"matchLabels": {
             "preheat_dev_service": "svc", "preheat_dev_role": "serving"}}},
         "target": {"type": "AverageValue", "averageValue": "4"}}}),
    ({"type": "Resource", "name": "cpu", "targetAverageUtilization": 70},
     {"type": "Resource", "resource": {"name": "cpu", "target": {
         "type": "Utilization", "averageUtilization": 70}}}),
], ids=["Pods", "External", "Resource"])
def test_the_hpa_route_renders_a_valid_hpa_with_the_same_windows(metric, expected):
    spec = parse_spec(_auto(metric, scaleUpStabilizationSeconds=30,
                            scaleDownStabilizationSeconds=120))
    hpa = render.autoscaler("svc", "default", "uid", spec)
    kubernetes_validate.validate(hpa, K8S, strict=True)
    assert hpa["spec"]["metrics"] == [expected]
    assert hpa["spec"]["behavior"] == {"scaleUp": {"stabilizationWindowSeconds": 30},
                                       "scaleDown": {"stabilizationWindowSeconds": 120}}
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "serving.preheat.dev/v1alpha1",
                                             "kind": "InferenceService", "name": "svc"}


@pytest.mark.parametrize("metric,reason", [
    ({"type": "Engine", "name": "preheat_num_requests_waiting", "targetAverageValue": "0"},
     "must be a positive quantity"),
    ({"type": "Engine", "name": "preheat_num_requests_waiting", "targetAverageValue": "lots"},
     "must be a positive quantity"),
    ({"type": "Engine", "name": "preheat_requests"}, "needs targetAverageValue"),
    ({"type": "Engine", "name": "cpu", "targetAverageValue": 1}, "an Engine metric is one of"),
])
def test_what_the_schema_lets_through_the_operator_still_refuses(metric, reason):
    # Quantities are int-or-string in the schema: their value is checked here, and an older
    # CRD without the CEL rules still cannot get a bad metric past the operator.
    from preheat.operator.spec import SpecError
    with pytest.raises(SpecError, match=reason):
        parse_spec(_auto(metric))


def test_an_hpa_as_the_server_returns_it_is_not_patched_again():
    # The API server adds behavior policies and canonicalises quantities ("0.8" -> "800m");
    # the reconciler must see that as already applied, and a real change as a change.
    from preheat.operator.reconcile import _contains
    spec = parse_spec(_auto({"type": "Pods", "name": "preheat_kv_cache_usage_ratio",
                             "targetAverageValue": "0.8"}))
    want = render.autoscaler("svc", "default", "uid", spec)["spec"]
    have = copy.deepcopy(want)
    have["metrics"][0]["pods"]["target"]["averageValue"] = "800m"
    have["behavior"]["scaleDown"].update(selectPolicy="Max", policies=[
        {"type": "Percent", "value": 100, "periodSeconds": 15}])
    assert _contains(have, want)
    have["maxReplicas"] = 9
    assert not _contains(have, want)


RICH = {
    "replicas": 4, "warmPool": {"size": 2},
    "engine": {
        "image": "img",
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "engine",
        "automountServiceAccountToken": True,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
        "topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "DoNotSchedule",
                                       "labelSelector": {"matchLabels": {"x": "y"}}}],
        "priorityClassName": "inference",
        "runtimeClassName": "nvidia",
    },
    "snapshot": {"storage": "SharedVolume", "accessMode": "ReadWriteMany", "retainOnDelete": True},
    "failover": {"unreadySeconds": 3},
    "rollout": {"maxSurge": "50%", "maxUnavailable": 1, "progressDeadlineSeconds": 120},
    "disruptionBudget": {"maxUnavailable": "25%"},
    "readiness": {"terminationGracePeriodSeconds": 90, "endpointDelaySeconds": 10},
}


def test_every_new_field_passes_the_schema_and_renders_valid_objects():
    cr = _cr(**RICH)
    assert crd_schema.errors(cr) == []
    cr = crd_schema.apply_defaults(cr, crd_schema.load_schema())
    spec = parse_spec(cr["spec"])
    assert (spec.rollout.surge(4), spec.rollout.unavailable(4)) == (2, 1)
    pod = render.pod("svc", "default", "uid", spec, "svc-abc123", "warm")
    pdb = render.disruption_budget("svc", "default", "uid", spec)
    claim = render.snapshot_claim("svc", "default", "uid", spec)
    for obj in (pod, pdb, claim):
        kubernetes_validate.validate(obj, K8S, strict=True)
    ps = pod["spec"]
    assert ps["imagePullSecrets"] == [{"name": "registry"}]
    assert ps["serviceAccountName"] == "engine" and ps["automountServiceAccountToken"] is True
    assert ps["affinity"] == RICH["engine"]["affinity"]
    assert ps["topologySpreadConstraints"] == RICH["engine"]["topologySpreadConstraints"]
    assert (ps["priorityClassName"], ps["runtimeClassName"]) == ("inference", "nvidia")
    assert ps["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert pdb["spec"]["maxUnavailable"] == "25%"
    assert claim["metadata"]["ownerReferences"] == []  # retainOnDelete


def test_engine_pods_by_default_spread_carry_no_token_and_split_the_grace_period():
    cr = crd_schema.apply_defaults(_cr(), crd_schema.load_schema())
    spec = parse_spec(cr["spec"])
    pod = render.pod("svc", "default", "uid", spec, "svc-abc123", "warm")
    ps = pod["spec"]
    assert ps["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in ps
    keys = {c["topologyKey"] for c in ps["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" and
               c["labelSelector"] == {"matchLabels": {"preheat.dev/service": "svc"}}
               for c in ps["topologySpreadConstraints"])
    env = {e["name"]: e["value"] for e in ps["containers"][0]["env"]}
    # preStop sleep + drain + snapshot + a second to exit fit in the grace period.
    budget = (int(ps["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"])
              + int(env["PREHEAT_SHUTDOWN_TIMEOUT"]) + int(env["PREHEAT_SHUTDOWN_SNAPSHOT_TIMEOUT"]))
    assert budget < ps["terminationGracePeriodSeconds"]
    # Pod-local snapshots: an emptyDir, and the Service as the peer to fetch from.
    [snap] = [v for v in ps["volumes"] if v["name"] == "snapshots"]
    assert "emptyDir" in snap
    assert env["PREHEAT_SNAPSHOT_PEER_URL"] == "http://svc-engines:8000"  # the headless engines Service
    assert render.disruption_budget("svc", "default", "uid", spec)["spec"]["maxUnavailable"] == 1


def test_no_spread_when_the_user_says_so():
    cr = crd_schema.apply_defaults(_cr(engine={"image": "x", "topologySpreadConstraints": []}),
                                   crd_schema.load_schema())
    pod = render.pod("svc", "default", "uid", parse_spec(cr["spec"]), "svc-abc123", "warm")
    assert "topologySpreadConstraints" not in pod["spec"]
