"""The chart's InferencePools (Gateway API Inference Extension), validated against the
extension's published CRD schema (vendored: fixtures/, with its license)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "operator"))
import crd_schema
from helm_tools import ensure_tools
from test_helm_chart import rendered, template

POOL_CRD = pathlib.Path(__file__).parent / "fixtures" / "inference.networking.k8s.io_inferencepools.yaml"


@pytest.fixture(scope="module")
def helm() -> str:
    return str(ensure_tools()["helm"])


def pool_schema() -> dict:
    [crd] = [d for d in yaml.safe_load_all(POOL_CRD.read_text()) if d]
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return v1["schema"]["openAPIV3Schema"]


VALUES = {"inferencePools": [
    {"name": "chat", "endpointPicker": {"name": "chat-epp"}},
    {"name": "code-pool", "namespace": "llm", "service": "code",
     "endpointPicker": {"name": "epp", "port": 9100, "failureMode": "FailOpen"}}]}


def test_pools_select_the_ready_serving_engines_and_pass_the_published_schema(helm, tmp_path):
    pools = {o["metadata"]["name"]: o for o in rendered(helm, tmp_path, VALUES)
             if o["kind"] == "InferencePool"}
    assert set(pools) == {"chat", "code-pool"}
    for pool in pools.values():
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        assert crd_schema.errors(pool, pool_schema()) == [], pool
    chat, code = pools["chat"]["spec"], pools["code-pool"]["spec"]
    assert chat["selector"]["matchLabels"] == {"preheat.dev/service": "chat", "preheat.dev/role": "serving"}
    assert chat["targetPorts"] == [{"number": 8000}]
    assert chat["endpointPickerRef"] == {"name": "chat-epp", "port": {"number": 9002},
                                         "failureMode": "FailClose"}
    assert code["selector"]["matchLabels"]["preheat.dev/service"] == "code"
    assert pools["code-pool"]["metadata"]["namespace"] == "llm"
    assert not [o for o in rendered(helm, tmp_path) if o["kind"] == "InferencePool"]  # off by default


def test_the_schema_check_can_fail():
    bad = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
           "metadata": {"name": "x"}, "spec": {"selector": {"matchLabels": {"a": "b"}},
                                               "targetPorts": [{"number": 8000}, {"number": 8000}],
                                               "endpointPickerRef": {"name": "e"}}}
    errors = crd_schema.errors(bad, pool_schema())
    assert any("unique" in e for e in errors) and any("port is required" in e for e in errors), errors


@pytest.mark.parametrize("sets,expected", [
    (["inferencePools[0].name=chat"], "missing property 'endpointPicker'"),
    (["inferencePools[0].name=chat", "inferencePools[0].endpointPicker.name=e",
      "inferencePools[0].endpointPicker.failureMode=Maybe"], "failureMode"),
])
def test_bad_pool_values_fail_with_a_clear_message(helm, tmp_path, sets, expected):
    out = template(helm, tmp_path, sets=sets)
    assert out.returncode != 0 and expected in out.stderr, out.stderr
