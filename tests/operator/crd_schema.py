"""Validate objects the way the API server validates a custom resource against its CRD:
structural defaulting, then the OpenAPI v3 schema (jsonschema), unknown fields
(kubectl's default strict field validation), and the CEL x-kubernetes-validations rules.

The defaulting, pruning and CEL evaluation are the API emulator's own (kmock_admission.py),
so the offline checks and the emulator cannot drift apart; the messages here stay
jsonschema's, short and greppable, for tests that name the check that failed.
"""

from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import jsonschema
import yaml
from kmock_admission import apply_defaults, prune, rule_holds

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferenceservices.yaml"

__all__ = ["apply_defaults", "errors", "load_schema"]


def load_schema(crd_file: pathlib.Path = CRD_FILE) -> dict[str, Any]:
    crd = yaml.safe_load(crd_file.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _cel_errors(obj: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations") or []:
        if not rule_holds(rule["rule"], json.dumps(obj, sort_keys=True)):
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
    found += [f".{path}: field not declared in schema" for path in prune(copy.deepcopy(obj), schema)]
    if not found:  # like the server, CEL runs only on schema-valid objects
        found += list(_cel_errors(obj, schema, ""))
    return found
