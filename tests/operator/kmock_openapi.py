"""The OpenAPI documents of the API emulator (a test part), as kube-apiserver publishes them.

kubectl reads them before it sends a body: `kubectl apply` downloads `/openapi/v3` (then
`/openapi/v2` when v3 is missing) to decide whether the server validates fields itself (a
PATCH operation of that kind, tagged `x-kubernetes-group-version-kind`, that takes a
`fieldValidation` query parameter: then it sends `fieldValidation=Strict` and leaves the
checking to the server) and to compute strategic merge patches (`x-kubernetes-patch-*`).

- `/openapi/v3`: the index, one `serverRelativeURL` per group-version (`apis/apps/v1`,
  `api/v1`, `apis/serving.preheat.dev/v1alpha1`), each with a `?hash=` of its document, as
  client-go's cache expects; `/openapi/v3/<gv>`: that group-version's paths and, in
  `components.schemas`, the schemas its kinds reach.
- `/openapi/v2`: one Swagger 2.0 document for everything (JSON only: the emulator has no
  protobuf encoder).

Built-in kinds come from the schemas kubernetes-validate ships (the Kubernetes release's own
OpenAPI definitions, turned into JSON Schema: this undoes that), CRDs from their
`openAPIV3Schema`, named and tagged the way the apiextensions-apiserver publishes them.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import kubernetes_validate

SCHEMA_VERSION = "1.35.0"  # the Kubernetes release whose built-in schemas are served
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"


@functools.cache
def builtin_definitions() -> dict[str, Any]:
    """Definition name -> OpenAPI schema (refs as `#/definitions/<name>`)."""
    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{SCHEMA_VERSION}-local" \
        / "_definitions.json"
    defs = json.loads(path.read_text())["$defs"]
    out = {name: _from_json_schema(schema) for name, schema in defs.items()}
    out[INT_OR_STRING] = {"type": "string", "format": "int-or-string",
                          "description": defs[INT_OR_STRING].get("description", "")}
    return out


def _from_json_schema(node: Any) -> Any:
    """kubernetes-validate's JSON Schema form back to OpenAPI: `type: [T, "null"]` -> T,
    `#/$defs/` -> `#/definitions/`."""
    if isinstance(node, list):
        return [_from_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _from_json_schema(v) for k, v in node.items()}
    if isinstance(out.get("type"), list):
        types = [t for t in out["type"] if t != "null"]
        out["type"] = types[0] if len(types) == 1 else types
    if isinstance(out.get("$ref"), str):
        out["$ref"] = "#/definitions/" + out["$ref"].rsplit("/", 1)[-1]
    return out


def crd_definition_name(group: str, version: str, kind: str) -> str:
    """apiextensions-apiserver's name: the group reversed, e.g. dev.preheat.serving.v1alpha1.InferenceService."""
    return ".".join([*reversed(group.split(".")), version, kind])


def crd_definitions(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One definition per served version of a CRD: its schema, with the kind's tag and
    metadata as ObjectMeta (what the apiextensions-apiserver adds)."""
    spec = crd["spec"]
    out = {}
    for version in spec["versions"]:
        schema = copy.deepcopy((version.get("schema") or {}).get("openAPIV3Schema") or {"type": "object"})
        props = schema.setdefault("properties", {})
        props["metadata"] = {"$ref": f"#/definitions/{META}ObjectMeta"}
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        schema["x-kubernetes-group-version-kind"] = [
            {"group": spec["group"], "version": version["name"], "kind": spec["names"]["kind"]}]
        out[crd_definition_name(spec["group"], version["name"], spec["names"]["kind"])] = schema
    return out


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[-1])
        for v in node.values():
            found |= _refs(v)
    elif isinstance(node, list):
        for v in node:
            found |= _refs(v)
    return found


def closure(names: set[str], definitions: dict[str, Any]) -> dict[str, Any]:
    """The named definitions and every one they reference."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in definitions:
            continue
        seen.add(name)
        todo.extend(_refs(definitions[name]) - seen)
    return {name: definitions[name] for name in sorted(seen)}


def kind_definitions(definitions: dict[str, Any], group: str, version: str) -> dict[str, str]:
    """kind -> definition name, for the kinds of one group-version."""
    out = {}
    for name, schema in definitions.items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            if gvk.get("group", "") == group and gvk.get("version") == version:
                out[gvk["kind"]] = name
    return out


_QUERY = {name: {"name": name, "in": "query", "type": "string", "uniqueItems": True}
          for name in ("fieldValidation", "fieldManager", "dryRun", "pretty", "force")}


def paths(group: str, version: str, plural: str, kind: str, namespaced: bool,
          subresources: set[str]) -> dict[str, dict[str, Any]]:
    """The REST paths of one resource, each operation tagged with its kind and action (v2
    style: parameters carry `type`; to_v3 moves that into `schema`)."""
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    base = f"{prefix}/namespaces/{{namespace}}/{plural}" if namespaced else f"{prefix}/{plural}"
    gvk = {"group": group, "version": version, "kind": kind}
    writes = [_QUERY["dryRun"], _QUERY["fieldManager"], _QUERY["fieldValidation"], _QUERY["pretty"]]

    def op(action: str, params: list[dict[str, Any]], target_kind: dict[str, str] = gvk) -> dict[str, Any]:
        return {"operationId": f"{action}{kind}", "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": target_kind, "parameters": params,
                "responses": {"200": {"description": "OK"}}}

    out = {
        base: {"get": op("list", [_QUERY["pretty"]]), "post": op("post", writes)},
        f"{base}/{{name}}": {"get": op("get", [_QUERY["pretty"]]), "put": op("put", writes),
                              "patch": op("patch", [*writes, _QUERY["force"]]), "delete": op("delete", [])},
    }
    for sub in sorted(subresources):
        target = {"group": "autoscaling", "version": "v1", "kind": "Scale"} if sub == "scale" else gvk
        out[f"{base}/{{name}}/{sub}"] = {"get": op("get", [], target), "put": op("put", writes, target),
                                         "patch": op("patch", [*writes, _QUERY["force"]], target)}
    return out


def swagger(all_paths: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    return {"swagger": "2.0", "info": {"title": "Kubernetes", "version": f"v{SCHEMA_VERSION}"},
            "paths": all_paths, "definitions": definitions}


def to_v3(all_paths: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """The same content as an OpenAPI 3.0 document (refs into components.schemas)."""
    text = json.dumps(definitions).replace('"#/definitions/', '"#/components/schemas/')
    v3_paths = {}
    for path, item in all_paths.items():
        v3_item = {}
        for method, operation in item.items():
            operation = copy.deepcopy(operation)
            operation["parameters"] = [{"name": p["name"], "in": p["in"], "schema": {"type": p["type"],
                                        "uniqueItems": True}} for p in operation["parameters"]]
            v3_item[method] = operation
        v3_paths[path] = v3_item
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": f"v{SCHEMA_VERSION}"},
            "paths": v3_paths, "components": {"schemas": json.loads(text)}}


def digest(doc: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32].upper()
