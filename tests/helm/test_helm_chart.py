"""The Helm chart: lints, renders valid 1.30 objects, refuses bad values, least-privilege RBAC."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "operator"))
import crd_schema
from helm_tools import ensure_tools
from operator_api_usage import kopf_peering_verbs, router_rules, used_rules

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "preheat"
K8S = "1.30.0"

RICH_VALUES = {
    "image": {"repository": "registry.example.com/preheat/operator", "tag": "0.1.0-rc1"},
    "operator": {"replicas": 2, "logLevel": "debug", "resyncSeconds": 15,
                 "autoscaleIntervalSeconds": 5, "metricsTimeoutSeconds": 1.5,
                 "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops",
                                  "effect": "NoSchedule"}]},
    "watch": {"namespaces": ["llm-prod", "llm-staging"]},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
    "metrics": {"podMonitor": {"enabled": True, "interval": "15s",
                               "labels": {"release": "prometheus"}}},
    "example": {"enabled": True, "name": "demo", "replicas": 2, "warmPoolSize": 1,
                "snapshots": "SharedVolume", "retainSnapshotsOnDelete": True,
                "failover": {"unreadySeconds": 3},
                "rollout": {"maxSurge": "50%", "maxUnavailable": 1, "progressDeadlineSeconds": 900},
                "disruptionBudget": {"maxUnavailable": "25%"},
                "endpointDelaySeconds": 8,
                "engine": {"imagePullSecrets": [{"name": "registry"}], "priorityClassName": "llm",
                           "runtimeClassName": "nvidia", "serviceAccountName": "engine",
                           "topologySpreadConstraints": [],
                           "apiKeySecretRef": {"name": "llm-key", "key": "token"}}},
    "networkPolicy": {"enabled": True, "clients": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
         "podSelector": {"matchLabels": {"app": "gateway"}}}],
        "metricsScrapers": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]},
    "inferencePools": [{"name": "demo", "endpointPicker": {"name": "demo-epp"}}],
    "router": {"image": "registry.example.com/preheat/router:1"},
    "autoscaling": {"prometheusAdapter": {"enabled": True},
                    "keda": {"scaledObjects": [{"name": "demo", "maxReplicas": 4,
                                                "metric": "preheat_num_requests_waiting",
                                                "targetAverageValue": "4"}]}},
}


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_tools()["helm"])


def template(helm: str, tmp_path: pathlib.Path, values: dict | None = None,
             sets: list[str] = ()) -> subprocess.CompletedProcess:
    cmd = [helm, "template", "preheat", str(CHART), "--namespace", "preheat-system",
           "--include-crds"]
    if values is not None:
        f = tmp_path / "values.yaml"
        f.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(f)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def rendered(helm: str, tmp_path: pathlib.Path, values: dict | None = None) -> list[dict]:
    out = template(helm, tmp_path, values)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_chart_lints_strictly(helm, tmp_path):
    for values in (None, RICH_VALUES):
        cmd = [helm, "lint", "--strict", str(CHART)]
        if values:
            (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
            cmd += ["-f", str(tmp_path / "v.yaml")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", [None, RICH_VALUES], ids=["default", "rich"])
def test_every_rendered_object_is_valid(helm, tmp_path, values):
    objects = rendered(helm, tmp_path, values)
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ConfigMap",
            "ClusterRole", "ClusterRoleBinding"} <= kinds
    assert "NetworkPolicy" not in kinds  # the operator renders one per InferenceService
    # Custom kinds the chart itself defines (InferenceService, kopf's peerings): the
    # CRD's own schema (and CEL rules), as the API server would check them.
    crds = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c
            for c in objects if c["kind"] == "CustomResourceDefinition"}
    for obj in objects:
        crd = crds.get((obj["apiVersion"].split("/")[0], obj["kind"]))
        if crd is not None:
            schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            assert crd_schema.errors(obj, schema) == []
            assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced")
        elif obj["kind"] == "ScaledObject":
            # KEDA's kind: its own published CRD schema (tests/helm/test_autoscaling_chart.py).
            from test_autoscaling_chart import keda_schema
            assert crd_schema.errors(obj, keda_schema()) == []
        elif obj["kind"] == "InferencePool":
            # The Gateway API Inference Extension's kind: its published CRD schema.
            from test_inference_pool import pool_schema
            assert crd_schema.errors(obj, pool_schema()) == []
        elif obj["kind"] == "PodMonitor":
            # Prometheus Operator kind, not in the Kubernetes schemas: check what we rely on.
            ep = obj["spec"]["podMetricsEndpoints"][0]
            assert (ep["port"], ep["path"]) == ("http", "/metrics")
        else:
            kubernetes_validate.validate(obj, K8S, strict=True)


def test_example_values_reach_the_inference_service(helm, tmp_path):
    [cr] = [o for o in rendered(helm, tmp_path, RICH_VALUES) if o["kind"] == "InferenceService"]
    spec = cr["spec"]
    assert spec["snapshot"] == {"enabled": True, "storage": "SharedVolume", "retainOnDelete": True}
    assert spec["failover"] == {"unreadySeconds": 3}
    assert spec["rollout"] == {"maxSurge": "50%", "maxUnavailable": 1, "progressDeadlineSeconds": 900}
    assert spec["disruptionBudget"] == {"enabled": True, "maxUnavailable": "25%"}
    assert spec["readiness"] == {"endpointDelaySeconds": 8}
    assert spec["engine"]["runtimeClassName"] == "nvidia" and spec["engine"]["image"]
    assert spec["engine"]["apiKeySecretRef"] == {"name": "llm-key", "key": "token"}
    # The defaults render the product's defaults.
    [cr] = [o for o in rendered(helm, tmp_path, {"example": {"enabled": True}})
            if o["kind"] == "InferenceService"]
    assert cr["spec"]["snapshot"]["storage"] == "PodLocal"
    assert cr["spec"]["rollout"]["maxUnavailable"] == 0


def test_rich_values_reach_the_deployment(helm, tmp_path):
    [dep] = [o for o in rendered(helm, tmp_path, RICH_VALUES) if o["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.example.com/preheat/operator:0.1.0-rc1"
    assert "--namespace=llm-prod" in c["args"] and "--namespace=llm-staging" in c["args"]
    assert "--peering=preheat" in c["args"] and dep["spec"]["replicas"] == 2
    assert "--log-level=debug" in c["args"]
    assert "--autoscale-interval=5" in c["args"] and "--metrics-timeout=1.5" in c["args"]


@pytest.mark.parametrize("crd", ["inferenceservices.yaml", "kopf-peerings.yaml"])
def test_the_charts_crds_are_the_repositorys_crds(crd):
    assert (CHART / "crds" / crd).read_bytes() == (ROOT / "crds" / crd).read_bytes()


def test_the_chart_ships_exactly_the_repositorys_crds():
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == \
        sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))


def _peerings(objects: list[dict]) -> set[tuple[str, str, str | None]]:
    return {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))
            for o in objects if o["apiVersion"] == "kopf.dev/v1"}


def _peering_arg(objects: list[dict]) -> str | None:
    [dep] = [o for o in objects if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return next((a.split("=", 1)[1] for a in args if a.startswith("--peering=")), None)


def test_one_replica_runs_standalone_without_a_peering_object(helm, tmp_path):
    objects = rendered(helm, tmp_path)
    assert _peering_arg(objects) is None and _peerings(objects) == set()


def test_replicas_meet_in_a_peering_object_in_every_watched_namespace(helm, tmp_path):
    # kopf keeps one keep-alive per served namespace, so each needs the object.
    objects = rendered(helm, tmp_path, RICH_VALUES)
    assert _peering_arg(objects) == "preheat"
    assert _peerings(objects) == {("KopfPeering", "preheat", "llm-prod"),
                                  ("KopfPeering", "preheat", "llm-staging")}
    objects = rendered(helm, tmp_path, {"operator": {"replicas": 2}})
    assert _peerings(objects) == {("KopfPeering", "preheat", "preheat-system")}


def test_cluster_wide_replicas_meet_in_a_cluster_peering_object(helm, tmp_path):
    objects = rendered(helm, tmp_path, {"operator": {"replicas": 3},
                                        "watch": {"allNamespaces": True}})
    assert _peering_arg(objects) == "preheat"
    assert _peerings(objects) == {("ClusterKopfPeering", "preheat", None)}


def test_each_replica_names_itself_in_the_peering_object(helm, tmp_path):
    [dep] = [o for o in rendered(helm, tmp_path, RICH_VALUES) if o["kind"] == "Deployment"]
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env


def test_the_warmup_configmap_carries_every_shipped_template(helm, tmp_path):
    shipped = {p.name: p.read_text() for p in (ROOT / "warmup_templates").glob("*.yaml")}
    copies = {p.name: p.read_text() for p in (CHART / "files" / "warmup-templates").glob("*.yaml")}
    assert copies == shipped and shipped
    [cm] = [o for o in rendered(helm, tmp_path) if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["name"] == "preheat-warmup-templates"
    assert {k: v.strip() for k, v in cm["data"].items()} == \
        {k: v.strip() for k, v in shipped.items()}


BAD_VALUES = {
    "negative replicas": (["operator.replicas=-1"],
                          "at '/operator/replicas': minimum: got -1, want 0"),
    "unknown key": (["operatr.replicas=1"], "additional properties 'operatr' not allowed"),
    "bad log level": (["operator.logLevel=verbose"],
                      "at '/operator/logLevel': value must be one of 'debug', 'info'"),
    "bad namespace": (["watch.namespaces[0]=Not_A_Namespace"],
                      "at '/watch/namespaces/0': 'Not_A_Namespace' does not match pattern"),
    "bad surge": (["example.rollout.maxSurge=lots"], "/example/rollout/maxSurge"),
    "bad snapshot storage": (["example.snapshots=Somewhere"], "/example/snapshots"),
    "secret ref without key": (["example.engine.apiKeySecretRef.name=k"],
                               "at '/example/engine/apiKeySecretRef': missing property 'key'"),
    "bad client selector": (["networkPolicy.clients[0].podSelector.matchExpressions[0].key=a",
                             "networkPolicy.clients[0].podSelector.matchExpressions[0].operator=Is"],
                            "/networkPolicy/clients/0/podSelector/matchExpressions/0/operator"),
}


@pytest.mark.parametrize("case", BAD_VALUES, ids=list(BAD_VALUES))
def test_bad_values_fail_with_a_clear_message(helm, tmp_path, case):
    sets, expected = BAD_VALUES[case]
    out = template(helm, tmp_path, sets=sets)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr
    assert expected in out.stderr, out.stderr


ROUTER_ACCOUNT = "preheat-router"  # values.yaml router.serviceAccountName


def _granted(objects: list[dict], kinds: set[str], router: bool = False) -> set[tuple[str, str, str]]:
    """The grants of the operator's roles, or (router) of the router pods' roles."""
    granted = set()
    for obj in objects:
        if obj["kind"] in kinds and (obj["metadata"]["name"] == ROUTER_ACCOUNT) == router:
            for rule in obj["rules"]:
                for g in rule["apiGroups"]:
                    for r in rule["resources"]:
                        for v in rule["verbs"]:
                            granted.add((g, r, v))
    return granted


@pytest.mark.parametrize("values,peering,namespaced", [
    (None, False, True),
    ({"operator": {"replicas": 3}}, True, True),
    ({"watch": {"allNamespaces": True}, "router": {"rbac": {"namespaces": ["llm"]}}}, False, False),
    ({"watch": {"allNamespaces": True}, "operator": {"replicas": 2},
      "router": {"rbac": {"namespaces": ["llm"]}}}, True, False),
], ids=["namespaced", "namespaced-peering", "cluster", "cluster-peering"])
def test_rbac_grants_exactly_what_the_operator_code_uses(helm, tmp_path, values, peering,
                                                         namespaced):
    objects = rendered(helm, tmp_path, values)
    granted = _granted(objects, {"Role", "ClusterRole"})
    needed = used_rules(peering=peering, namespaced=namespaced)
    assert granted - needed == set(), "granted but never used"
    assert needed - granted == set(), "used but not granted"
    # The router pods' account: exactly what router/ does with the API, in every namespace.
    assert _granted(objects, {"Role", "ClusterRole"}, router=True) == router_rules() == \
        {("", "pods", "list"), ("", "pods", "watch")}
    router_roles = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == ROUTER_ACCOUNT]
    bindings = [o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == ROUTER_ACCOUNT]
    accounts = [o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == ROUTER_ACCOUNT]
    assert {o["metadata"]["namespace"] for o in router_roles} == \
        {o["metadata"]["namespace"] for o in bindings} == {o["metadata"]["namespace"] for o in accounts}
    if namespaced:  # namespace-scoped grants except kopf's read-only namespace scan
        cluster = _granted(objects, {"ClusterRole"})
        assert cluster == {("", "namespaces", "list"), ("", "namespaces", "watch")}


def test_peering_grants_follow_kopfs_own_peering_calls():
    # kopf watches the peering object and merge-patches its keep-alive into it; it never
    # reads it by name, creates or deletes it (the chart creates it).
    assert kopf_peering_verbs() == {"list", "watch", "patch"}
    assert {r for r in used_rules(peering=True) if r[0] == "kopf.dev"} == \
        {("kopf.dev", "kopfpeerings", v) for v in ("list", "watch", "patch")}
    assert {r for r in used_rules(peering=True, namespaced=False) if r[0] == "kopf.dev"} == \
        {("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")}


def test_the_rbac_check_notices_a_missing_peering_grant(helm, tmp_path):
    objects = rendered(helm, tmp_path, {"operator": {"replicas": 2}})
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"] = [r for r in role["rules"] if r["apiGroups"] != ["kopf.dev"]]
    assert used_rules(peering=True) - _granted(objects, {"Role", "ClusterRole"}) == \
        {("kopf.dev", "kopfpeerings", v) for v in ("list", "watch", "patch")}


def test_the_rbac_check_notices_an_extra_grant(helm, tmp_path):
    # The check above must be able to fail: a chart granting one verb more is caught.
    objects = rendered(helm, tmp_path)
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]})
    assert ("", "secrets", "list") in _granted(objects, {"Role"}) - used_rules(peering=False)
