"""The chart's HPA route: prometheus-adapter rules and KEDA ScaledObjects for engine gauges.

Neither kind is in the Kubernetes schemas, so each is checked against the closest
faithful source there is:
- prometheus-adapter's config.yaml: a JSON schema transcribed from its Go config types
  (kubernetes-sigs/prometheus-adapter pkg/config/config.go, loaded with yaml.UnmarshalStrict,
  so unknown keys are errors there too), plus what those rules do with our series: which
  metric names the series query selects and what the HPA will call them;
- KEDA's ScaledObject: KEDA's own published CRD schema (v2.20.2, vendored unmodified in
  fixtures/) with its CEL rule, plus the Prometheus trigger's metadata fields from KEDA's
  scaler (pkg/scalers/prometheus_scaler.go, v2.20.2).
"""

from __future__ import annotations

import pathlib
import re
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "operator"))
import crd_schema
from helm_tools import ensure_tools
from test_helm_chart import K8S, rendered, template

from preheat.engine.metrics import Metrics
from preheat.operator import render
from preheat.operator.scale_decide import ENGINE_METRICS
from preheat.operator.spec import parse_spec

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
KEDA_CRD = FIXTURES / "keda.sh_scaledobjects.yaml"

_GROUP_RESOURCE = {"type": "object", "additionalProperties": False, "required": ["resource"],
                   "properties": {"group": {"type": "string"}, "resource": {"type": "string"}}}
_RULE = {
    "type": "object", "additionalProperties": False, "required": ["seriesQuery"],
    "properties": {
        "seriesQuery": {"type": "string", "minLength": 1},
        "seriesFilters": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "maxProperties": 1,
            "properties": {"is": {"type": "string"}, "isNot": {"type": "string"}}}},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "template": {"type": "string"},
            "overrides": {"type": "object", "additionalProperties": _GROUP_RESOURCE}}},
        "name": {"type": "object", "additionalProperties": False, "properties": {
            "matches": {"type": "string"}, "as": {"type": "string"}}},
        "metricsQuery": {"type": "string"},
        "labelValueReplacements": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"find": {"type": "string"}, "replace": {"type": "string"}}}},
    },
}
# MetricsDiscoveryConfig (resourceRules is not used here and left out: an unknown key).
ADAPTER_CONFIG_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {"rules": {"type": "array", "items": _RULE},
                   "externalRules": {"type": "array", "items": _RULE}},
}
# prometheusMetadata in KEDA v2.20.2 (keda:"name=..."); the first three are not optional.
KEDA_PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
KEDA_PROMETHEUS_FIELDS = KEDA_PROMETHEUS_REQUIRED | {
    "queryParameters", "activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
    "unsafeSsl", "awsRegion", "timeout", "identityOwner"}

VALUES = {
    "metrics": {"podMonitor": {"enabled": True}},
    "autoscaling": {
        "prometheusAdapter": {"enabled": True, "namespace": "monitoring"},
        "keda": {"scaledObjects": [
            {"name": "chat", "metric": "preheat_num_requests_waiting", "targetAverageValue": "4",
             "maxReplicas": 8},
            {"name": "rag", "namespace": "llm", "metric": "preheat_kv_cache_usage_ratio",
             "targetAverageValue": 0.8, "minReplicas": 2, "maxReplicas": 4,
             "scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600},
        ]},
    },
}


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_tools()["helm"])


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def keda_schema() -> dict:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert crd["metadata"]["name"] == "scaledobjects.keda.sh"
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def engine_metric_names() -> set[str]:
    """Every metric family name in the engine's real /metrics output."""
    from prometheus_client.parser import text_string_to_metric_families
    text, _ = Metrics().render()
    return {f.name for f in text_string_to_metric_families(text.decode())} | {
        s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def sanitized_pod_target_labels(objects: list[dict]) -> set[str]:
    [pm] = _of_kind(objects, "PodMonitor")
    # prometheus-operator's sanitizeLabelName: anything outside [a-zA-Z0-9_] becomes "_".
    return {re.sub(r"[^a-zA-Z0-9_]", "_", label) for label in pm["spec"]["podTargetLabels"]}


def test_nothing_for_the_hpa_route_is_rendered_by_default(helm, tmp_path):
    kinds = {o["kind"] for o in rendered(helm, tmp_path)}
    assert "ScaledObject" not in kinds
    assert not [o for o in rendered(helm, tmp_path) if o["kind"] == "ConfigMap"
                and "config.yaml" in o.get("data", {})]


def test_the_adapter_rules_serve_exactly_the_engine_gauges_under_their_own_names(helm, tmp_path):
    objects = rendered(helm, tmp_path, VALUES)
    [cm] = [o for o in _of_kind(objects, "ConfigMap") if "config.yaml" in o["data"]]
    kubernetes_validate.validate(cm, K8S, strict=True)
    assert (cm["metadata"]["name"], cm["metadata"]["namespace"]) == \
        ("preheat-prometheus-adapter", "monitoring")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    jsonschema.validate(config, ADAPTER_CONFIG_SCHEMA)

    names = engine_metric_names()
    assert set(ENGINE_METRICS) <= names  # the contract names exist in the engine
    labels = sanitized_pod_target_labels(objects)
    for kind, rule in (("Pods", config["rules"][0]), ("External", config["externalRules"][0])):
        # The series query's name regex picks exactly the gauges, nothing else the engine has.
        [name_re] = re.findall(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        assert {n for n in names if re.fullmatch(name_re, n)} == set(ENGINE_METRICS), kind
        # Name mapping: each gauge is served under its own name, which the HPA asks for.
        for metric in ENGINE_METRICS:
            m = re.fullmatch(rule["name"]["matches"], metric)
            assert m and rule["name"]["as"].replace("${1}", m.group(1)) == metric
        # The adapter's template fills only these three.
        assert set(re.findall(r"<<(.*?)>>", rule["metricsQuery"])) == \
            {".Series", ".LabelMatchers", ".GroupBy"}
        spec = parse_spec({"model": {}, "engine": {"image": "x"}, "autoscaling": {
            "maxReplicas": 3, "metric": {"type": kind, "name": ENGINE_METRICS[0],
                                         "targetAverageValue": 2}}})
        hpa = render.autoscaler("chat", "llm", "uid", spec)
        asked = hpa["spec"]["metrics"][0][kind.lower()]["metric"]
        assert asked["name"] == ENGINE_METRICS[0]
        if kind == "External":
            # The HPA's selector only names labels the PodMonitor puts on the series, and
            # the external rule requires one of them.
            assert set(asked["selector"]["matchLabels"]) <= labels
            required = set(re.findall(r'(\w+)!=""', rule["seriesQuery"])) - {"namespace"}
            assert required and required <= labels
        else:
            assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_the_adapter_schema_check_can_fail():
    bad = {"rules": [{"seriesQuery": "{}", "name": {"matches": "x", "as": "y", "to": "z"}}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, ADAPTER_CONFIG_SCHEMA)


def test_keda_scaled_objects_pass_kedas_own_schema_and_target_the_scale_subresource(helm, tmp_path):
    objects = rendered(helm, tmp_path, VALUES)
    scaled = {o["metadata"]["name"]: o for o in _of_kind(objects, "ScaledObject")}
    assert set(scaled) == {"chat", "rag"}
    schema = keda_schema()
    ours = yaml.safe_load((pathlib.Path(render.__file__).resolve().parents[1] / "crds"
                           / "inferenceservices.yaml").read_text())
    labels = sanitized_pod_target_labels(objects)
    for name, so in scaled.items():
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert crd_schema.errors(so, schema) == [], name
        ref = so["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
            f"{ours['spec']['group']}/{ours['spec']['versions'][0]['name']}",
            ours["spec"]["names"]["kind"], name)
        assert "scale" in ours["spec"]["versions"][0]["subresources"]
        [trigger] = so["spec"]["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        meta = trigger["metadata"]
        assert KEDA_PROMETHEUS_REQUIRED <= set(meta) <= KEDA_PROMETHEUS_FIELDS
        float(meta["threshold"])  # KEDA parses it as a float64
        # The query sums the gauge over this service's serving pods, by PodMonitor labels.
        selectors = dict(re.findall(r'(\w+)="([^"]*)"', meta["query"]))
        assert selectors == {"namespace": so["metadata"]["namespace"],
                             "preheat_dev_service": name, "preheat_dev_role": "serving"}
        assert set(selectors) - {"namespace"} <= labels
    rag = scaled["rag"]["spec"]
    assert (rag["minReplicaCount"], rag["maxReplicaCount"]) == (2, 4)
    assert rag["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 30},
        "scaleDown": {"stabilizationWindowSeconds": 600}}
    assert scaled["rag"]["metadata"]["namespace"] == "llm"
    assert scaled["rag"]["spec"]["triggers"][0]["metadata"]["threshold"] == "0.8"
    chat = scaled["chat"]["spec"]
    assert chat["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == \
        {"stabilizationWindowSeconds": 300}  # the HPA's default, as in Engine mode


def test_the_keda_schema_check_can_fail():
    schema = keda_schema()
    so = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
          "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [],
                   "minReplicaCount": 5, "maxReplicaCount": 2}}
    errors = crd_schema.errors(so, schema)
    assert any("triggers" in e for e in errors), errors
    so["spec"]["triggers"] = [{"type": "prometheus", "metadata": {"threshold": 4}}]
    assert any("threshold" in e for e in crd_schema.errors(so, schema))
    so["spec"]["triggers"][0]["metadata"]["threshold"] = "4"
    assert crd_schema.errors(so, schema) == [
        ".spec: minReplicaCount must be less than or equal to maxReplicaCount"]


@pytest.mark.parametrize("sets,expected", [
    (["autoscaling.keda.scaledObjects[0].name=chat",
      "autoscaling.keda.scaledObjects[0].metric=cpu",
      "autoscaling.keda.scaledObjects[0].targetAverageValue=4",
      "autoscaling.keda.scaledObjects[0].maxReplicas=3"], "scaledObjects/0/metric"),
    (["autoscaling.prometheusAdapter.metrics[0]=preheat_requests"], "prometheusAdapter/metrics/0"),
], ids=["keda-unknown-gauge", "adapter-unknown-gauge"])
def test_a_gauge_the_engine_does_not_have_is_refused(helm, tmp_path, sets, expected):
    out = template(helm, tmp_path, sets=sets)
    assert out.returncode != 0 and expected in out.stderr, out.stderr
