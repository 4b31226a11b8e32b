"""Validate objects the way the API server validates a custom resource against its CRD:
structural defaulting, then the OpenAPI v3 schema (jsonschema), unknown fields
(kubectl's default strict field validation), and the CEL x-kubernetes-validations rules.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferenceservices.yaml"


def load_schema(crd_file: pathlib.Path = CRD_FILE) -> dict[str, Any]:
    crd = yaml.safe_load(crd_file.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    if isinstance(obj, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            apply_defaults(item, schema["items"])
    return obj


def _unknown_fields(obj: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key not in schema["properties"]:
                if path != "" or key not in ("apiVersion", "kind", "metadata"):
                    yield f"{path}.{key}: field not declared in schema"
            elif key != "metadata":
                yield from _unknown_fields(value, schema["properties"][key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            yield from _unknown_fields(item, schema["items"], f"{path}[{i}]")


_cel = celpy.Environment()


def _cel_errors(obj: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations") or []:
        program = _cel.program(_cel.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(obj)})):
            yield f"{path or '<root>'}: {rule.get('message', rule['rule'])}"
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj and key != "metadata":
                yield from _cel_errors(obj[key], sub, f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            yield from _cel_errors(item, schema["items"], f"{path}[{i}]")


def errors(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """Every reason the API server would refuse obj (empty when it would accept it)."""
    schema = schema or load_schema()
    obj = apply_defaults(copy.deepcopy(obj), schema)
    found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
             for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    found += list(_unknown_fields(obj, schema, ""))
    if not found:  # like the server, CEL runs only on schema-valid objects
        found += list(_cel_errors(obj, schema, ""))
    return found
