"""The emulator's admission of custom resources (kmock_admission.py) against the real CRD:
each check worded as the API server words it (k8s.io/apimachinery field errors)."""

from __future__ import annotations

import copy

import pytest
import yaml
from kmock_admission import Refusal, prune, resource_types
from kmock_apiserver import CRD_PATH

CRD = yaml.safe_load(CRD_PATH.read_text())
TYPE = resource_types(CRD)["v1alpha1"]
BASE = {"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {"model": {}, "engine": {"image": "engine:1"}}}


def admit(spec: dict, mode: str = "Strict"):
    body = copy.deepcopy(BASE)
    body["spec"].update(spec)
    return TYPE.admit(body, mode)


def refusal(spec: dict, mode: str = "Strict") -> Refusal:
    with pytest.raises(Refusal) as caught:
        admit(spec, mode)
    return caught.value


@pytest.mark.parametrize(("spec", "reason", "field", "message"), [
    ({"replicas": -4}, "FieldValueInvalid", "spec.replicas",
     "Invalid value: -4: spec.replicas in body should be greater than or equal to 0"),
    ({"replicas": "two"}, "FieldValueTypeInvalid", "spec.replicas",
     'Invalid value: "two": spec.replicas in body must be of type integer: "string"'),
    ({"snapshot": {"storage": "Nfs"}}, "FieldValueNotSupported", "spec.snapshot.storage",
     'Unsupported value: "Nfs": supported values: "PodLocal", "SharedVolume"'),
    ({"engine": {}}, "FieldValueRequired", "spec.engine.image", "Required value"),
    ({"snapshot": {"size": "ten"}}, "FieldValueInvalid", "spec.snapshot.size",
     "Invalid value: \"ten\": spec.snapshot.size in body should match '^[0-9]+(\\.[0-9]+)?([KMGTPE]i?)?$'"),
    ({"rollout": {"maxSurge": True}}, "FieldValueTypeInvalid", "spec.rollout.maxSurge",
     'Invalid value: true: spec.rollout.maxSurge in body must be of type integer,string: "boolean"'),
    ({"model": {"path": "/m", "uri": "hf://a/b"}}, "FieldValueInvalid", "spec.model",
     'Invalid value: "object": model: set at most one of path, pvc or uri'),
])
def test_a_field_error_is_a_422_invalid_with_its_cause(spec, reason, field, message) -> None:
    status = refusal(spec).status()
    assert (status["code"], status["reason"]) == (422, "Invalid")
    assert status["details"]["causes"] == [{"reason": reason, "field": field, "message": message}]
    assert status["message"] == f'InferenceService.serving.preheat.dev "chat" is invalid: {field}: {message}'
    assert status["details"]["kind"] == "InferenceService" and status["details"]["name"] == "chat"


def test_several_errors_are_listed_in_brackets() -> None:
    status = refusal({"replicas": -1, "snapshot": {"storage": "Nfs"}}).status()
    assert len(status["details"]["causes"]) == 2
    assert status["message"].startswith('InferenceService.serving.preheat.dev "chat" is invalid: [spec.replicas: ')


def test_unknown_fields_refused_under_strict_pruned_otherwise() -> None:
    status = refusal({"bogus": 1, "engine": {"image": "e", "colour": "red"}}).status()
    assert (status["code"], status["reason"]) == (400, "BadRequest")
    assert status["message"] == ('InferenceService in version "v1alpha1" cannot be handled as a InferenceService: '
                                 'strict decoding error: unknown field "spec.bogus", unknown field '
                                 '"spec.engine.colour"')
    warned = admit({"bogus": 1}, "Warn")
    assert "bogus" not in warned.body["spec"] and warned.warnings == ['unknown field "spec.bogus"']
    ignored = admit({"bogus": 1}, "Ignore")
    assert "bogus" not in ignored.body["spec"] and ignored.warnings == []


def test_defaults_fill_what_exists_and_nulls_are_pruned() -> None:
    body = admit({"snapshot": {"enabled": True, "size": None}}).body
    snapshot_schema = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["snapshot"]["properties"]
    assert body["spec"]["snapshot"]["size"] == snapshot_schema["size"]["default"]  # null dropped, then defaulted
    assert body["spec"]["replicas"] == 1
    assert "autoscaling" not in body["spec"]  # a default never creates its parent object


def test_preserve_unknown_fields_keeps_what_is_below() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                               "b": {"type": "object", "properties": {"c": {"type": "string"}}}}}
    body = {"a": {"anything": {"deep": 1}}, "b": {"c": "x", "d": 2}}
    assert prune(body, schema) == ["b.d"]
    assert body == {"a": {"anything": {"deep": 1}}, "b": {"c": "x"}}


def test_a_list_map_refuses_duplicate_keys() -> None:
    body = copy.deepcopy(BASE)
    body["status"] = {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Ready", "status": "False"}]}
    with pytest.raises(Refusal) as caught:
        TYPE.admit(body, "Strict")
    assert caught.value.status()["details"]["causes"] == [
        {"reason": "FieldValueDuplicate", "field": "status.conditions[1]", "message": 'Duplicate value: {"type":"Ready"}'}]
