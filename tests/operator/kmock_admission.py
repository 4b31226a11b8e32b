"""Admission of custom resources as the API server does it, for the API emulator (a test part).

What kube-apiserver does to a custom resource body before it stores it (apiextensions-apiserver,
https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/):

1. decoding: fields the structural schema does not declare are *pruned*; with
   `fieldValidation=Strict` (kubectl's default) they are refused instead, with a 400
   `BadRequest` "... strict decoding error: unknown field "spec.foo"" (a patch: a 422
   "The request is invalid: patch: ..."); with `Warn` (the server's default) each one is a
   `Warning` header; `Ignore` drops them silently. `x-kubernetes-preserve-unknown-fields`
   keeps them below that node; `metadata`, `apiVersion` and `kind` are the server's own.
2. nulls in fields that are not `nullable: true` are pruned, then `default`s are applied.
3. validation against the OpenAPI v3 schema (types, bounds, lengths, enums, patterns,
   required, `x-kubernetes-int-or-string`, `x-kubernetes-list-type: map|set` uniqueness), then
   the CEL `x-kubernetes-validations` rules: a 422 `Invalid` Status whose message is
   `<Kind>.<group> "<name>" is invalid: <field errors>` and whose `details.causes` list each
   field error (reason `FieldValueInvalid`, `FieldValueRequired`, ...), worded as
   k8s.io/apimachinery's field.Error prints them.

jsonschema does the schema walk (a CRD schema is OpenAPI 3.0, i.e. JSON Schema draft 4 plus
the `x-kubernetes-*` keywords added below); celpy evaluates the CEL rules. Not modelled:
validation ratcheting, CEL's oldSelf (transition rules), CEL cost limits, `format` checks.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import celpy
import jsonschema

# --- errors, worded like k8s.io/apimachinery/pkg/util/validation/field ---------------------


@dataclass(frozen=True)
class FieldError:
    reason: str  # FieldValueInvalid, FieldValueRequired, ...
    path: str  # spec.replicas, spec.containers[0].name
    body: str  # what follows "<path>: "

    def __str__(self) -> str:
        return f"{self.path}: {self.body}"

    def cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.body, "field": self.path}


def field_path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def go_value(value: Any) -> str:
    """A value as field.Error prints it: strings quoted, numbers and booleans bare."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if value is None:
        return "null"
    return json.dumps(type_name(value))


def go_format(value: Any) -> str:
    """A decoded JSON value as Go's %v prints it (the API server quotes a refused patch so)."""
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{go_format(value[k])}" for k in sorted(value)) + "]"
    if isinstance(value, list):
        return "[" + " ".join(go_format(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "<nil>" if value is None else str(value)


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


@dataclass
class Refusal(Exception):
    """An API server's Status for a refused request."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] | None = None

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            body["details"] = self.details
        return body


def invalid(kind: str, group: str, name: str, errors: list[FieldError]) -> Refusal:
    listed = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(map(str, errors)) + "]"
    qualified = f"{kind}.{group}" if group else kind
    return Refusal(422, "Invalid", f"{qualified} {json.dumps(name)} is invalid: {listed}",
                   {"name": name, "group": group, "kind": kind, "causes": [e.cause() for e in errors]})


# --- 1 and 2: pruning, nulls, defaults -----------------------------------------------------

_SERVER_OWNED = ("apiVersion", "kind", "metadata")


def prune(obj: Any, schema: dict[str, Any], path: tuple[Any, ...] = ()) -> list[str]:
    """Removes, in place, what the schema does not declare; returns the removed paths
    ("spec.foo"). Also drops nulls where the schema does not allow them (`nullable`)."""
    removed: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key in list(obj):
            if not path and key in _SERVER_OWNED:
                continue
            sub = (props or {}).get(key)
            if sub is None and isinstance(extra, dict):
                sub = extra
            if sub is None:
                if not keep_unknown:
                    removed.append(field_path((*path, key)))
                    del obj[key]
                continue
            if obj[key] is None and not sub.get("nullable"):
                del obj[key]
                continue
            removed += prune(obj[key], sub, (*path, key))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            removed += prune(item, schema["items"], (*path, i))
    return removed


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting: a missing property with a `default` gets it, at every depth
    that exists (a default never creates its parent object)."""
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                if key not in (schema.get("properties") or {}):
                    apply_defaults(value, extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])
    return obj


# --- 3: schema validation ------------------------------------------------------------------


def _int_or_string(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if value and (isinstance(instance, bool) or not isinstance(instance, (int, str))):
        yield jsonschema.ValidationError("int-or-string", validator="x-kubernetes-int-or-string")


def _list_type(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if not isinstance(instance, list):
        return
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: list[Any] = []
    for i, item in enumerate(instance):
        if value == "map" and isinstance(item, dict):
            ident = {k: item.get(k) for k in keys}
        elif value == "set":
            ident = item
        else:
            continue
        if ident in seen:
            yield jsonschema.ValidationError(json.dumps(ident, separators=(",", ":")), validator="duplicate",
                                             path=[i])
        seen.append(ident)


_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {
    "x-kubernetes-int-or-string": _int_or_string,
    "x-kubernetes-list-type": _list_type,
})


def _nullable(schema: Any) -> Any:
    """OpenAPI's `nullable: true` as JSON Schema: null is one more allowed type."""
    if isinstance(schema, dict):
        out = {k: _nullable(v) for k, v in schema.items()}
        if schema.get("nullable") and "type" in schema:
            out["type"] = [schema["type"], "null"]
        return out
    if isinstance(schema, list):
        return [_nullable(v) for v in schema]
    return schema


def _field_error(e: jsonschema.ValidationError) -> FieldError:
    parts = list(e.absolute_path)
    kind, value = e.validator, e.instance
    if kind == "required":
        missing = e.message.split("'")[1] if "'" in e.message else ""
        return FieldError("FieldValueRequired", field_path([*parts, missing]), "Required value")
    path = field_path(parts)
    shown = go_value(value)
    if kind == "duplicate":
        return FieldError("FieldValueDuplicate", path, f"Duplicate value: {e.message}")
    if kind == "enum":
        allowed = ", ".join(go_value(v) for v in e.validator_value)
        return FieldError("FieldValueNotSupported", path, f"Unsupported value: {shown}: supported values: {allowed}")
    if kind == "type":
        want = e.validator_value if isinstance(e.validator_value, str) else e.validator_value[0]
        return FieldError("FieldValueTypeInvalid", path,
                          f"Invalid value: {shown}: {path} in body must be of type {want}: {json.dumps(type_name(value))}")
    if kind == "x-kubernetes-int-or-string":
        return FieldError("FieldValueTypeInvalid", path, f"Invalid value: {shown}: {path} in body must be of type "
                          f"integer,string: {json.dumps(type_name(value))}")
    if kind == "maxLength":
        return FieldError("FieldValueTooLong", path, f"Too long: may not be more than {e.validator_value} bytes")
    if kind == "maxItems":
        return FieldError("FieldValueTooMany", path, f"Too many: {len(value)}: must have at most {e.validator_value} items")
    messages = {
        "minimum": "should be greater than {op} {v}",
        "maximum": "should be less than {op} {v}",
        "minLength": "should be at least {v} chars long",
        "minItems": "should have at least {v} items",
        "pattern": "should match '{v}'",
        "multipleOf": "should be a multiple of {v}",
        "minProperties": "should have at least {v} properties",
        "maxProperties": "should have at most {v} properties",
    }
    if kind in messages:
        exclusive = e.schema.get("exclusiveMinimum" if kind == "minimum" else "exclusiveMaximum")
        text = messages[kind].format(v=e.validator_value, op="" if exclusive else "or equal to").replace("  ", " ")
        return FieldError("FieldValueInvalid", path, f"Invalid value: {shown}: {path} in body {text}")
    return FieldError("FieldValueInvalid", path, f"Invalid value: {shown}: {e.message}")


# --- 3b: CEL rules -------------------------------------------------------------------------

_cel = celpy.Environment()


@functools.lru_cache(maxsize=256)
def _program(text: str) -> Any:
    return _cel.program(_cel.compile(text))


@functools.lru_cache(maxsize=4096)
def rule_holds(text: str, value_json: str) -> bool:
    """A rule's verdict on a value. Pure, so remembered: celpy takes milliseconds a rule, and
    most writes (status updates) leave the spec's values as they were."""
    try:
        result = _program(text).evaluate({"self": celpy.json_to_cel(json.loads(value_json))})
    except celpy.CELEvalError:
        return False
    return not isinstance(result, celpy.CELEvalError) and bool(result)


def _cel_errors(obj: Any, schema: dict[str, Any], parts: tuple[Any, ...]) -> Iterator[FieldError]:
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        if not rule_holds(text, json.dumps(obj, sort_keys=True)):
            path = field_path((*parts, *(rule.get("fieldPath", "").strip(".").split(".") if rule.get("fieldPath")
                                         else ())))
            message = rule.get("message") or f"failed rule: {text}"
            yield FieldError(rule.get("reason", "FieldValueInvalid"), path or "<nil>",
                             f"Invalid value: {json.dumps(type_name(obj))}: {message}")
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj and not (not parts and key == "metadata"):
                yield from _cel_errors(obj[key], sub, (*parts, key))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            yield from _cel_errors(item, schema["items"], (*parts, i))


_validators: dict[int, tuple[dict[str, Any], Any]] = {}


def _validator_for(schema: dict[str, Any]) -> Any:
    """One validator per schema (building one costs more than validating with it)."""
    cached = _validators.get(id(schema))
    if cached is None or cached[0] is not schema:
        checked = {**schema, "properties": {**(schema.get("properties") or {}), "metadata": {"type": "object"}}}
        cached = _validators[id(schema)] = (schema, _Validator(_nullable(checked)))
    return cached[1]


def validate(obj: dict[str, Any], schema: dict[str, Any]) -> list[FieldError]:
    """Every field error of a pruned, defaulted object: the schema's, then (on a schema-valid
    object, so rules see the types they were written for) the CEL rules'."""
    body = {k: v for k, v in obj.items() if k != "metadata"}
    body["metadata"] = {k: obj.get("metadata", {}).get(k) for k in ("name", "namespace", "generateName")
                        if obj.get("metadata", {}).get(k) is not None}
    # An int-or-string node's anyOf [integer, string] is its own check's job: one error, not two.
    found = [e for e in _validator_for(schema).iter_errors(body)
             if not (e.validator == "anyOf" and e.schema.get("x-kubernetes-int-or-string"))]
    errors = [_field_error(e) for e in sorted(found, key=lambda e: list(map(str, e.absolute_path)))]
    if not errors:
        errors = list(_cel_errors(body, schema, ()))
    return errors


# --- the whole admission -------------------------------------------------------------------


@dataclass
class Admitted:
    body: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CustomResourceType:
    """What admission needs of one served version of a CRD."""

    group: str
    version: str
    kind: str
    schema: dict[str, Any]

    def admit(self, body: dict[str, Any], field_validation: str | None, *, patch: Any = None) -> Admitted:
        """The object to store, or a Refusal. patch: the request's patch body, for the
        wording of a refused patch."""
        body = copy.deepcopy(body)
        unknown = sorted(prune(body, self.schema))  # the server lists them sorted
        mode = (field_validation or "Warn").capitalize()
        if unknown and mode == "Strict":
            listed = ", ".join(f"unknown field {json.dumps(u)}" for u in unknown)
            if patch is not None:
                cause = f"Invalid value: {json.dumps(go_format(patch))}: strict decoding error: {listed}"
                raise Refusal(422, "Invalid", f"The request is invalid: patch: {cause}",
                              {"causes": [{"reason": "FieldValueInvalid", "field": "patch", "message": cause}]})
            raise Refusal(400, "BadRequest", f"{self.kind} in version {json.dumps(self.version)} cannot be "
                          f"handled as a {self.kind}: strict decoding error: {listed}")
        apply_defaults(body, self.schema)
        errors = validate(body, self.schema)
        if errors:
            name = (body.get("metadata") or {}).get("name") or ""
            raise invalid(self.kind, self.group, name, errors)
        warnings = [f"unknown field {json.dumps(u)}" for u in unknown] if mode == "Warn" else []
        return Admitted(body, warnings)


def resource_types(crd: dict[str, Any]) -> dict[str, CustomResourceType]:
    """version name -> its admission, for every served version with a schema."""
    spec = crd["spec"]
    return {v["name"]: CustomResourceType(spec["group"], v["name"], spec["names"]["kind"],
                                          v["schema"]["openAPIV3Schema"])
            for v in spec["versions"] if v.get("served", True) and (v.get("schema") or {}).get("openAPIV3Schema")}
