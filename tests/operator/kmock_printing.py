"""Server-side printing for the API emulator (a test part): `kubectl get` asks for a Table.

kubectl sends `Accept: application/json;as=Table;v=v1;g=meta.k8s.io, ...`; the API server
answers a meta.k8s.io/v1 Table whose columns are, for a custom resource, `Name` and then the
CRD's `additionalPrinterColumns` (each cell the value at its `jsonPath`; a `date` column
is the age, as the server formats it: `5m10s`), and for a built-in kind `Name` and `Age`
(the emulator has none of the built-in kinds' own printers; every one of them shows the
age). Each row carries the object's metadata as a PartialObjectMetadata
(`includeObject=Metadata`, the default).
"""

from __future__ import annotations

import datetime
from typing import Any

NAME_COLUMN = {"name": "Name", "type": "string", "format": "name", "priority": 0,
               "description": "Name must be unique within a namespace. Is required when creating resources, "
                              "although some resources may allow a client to request the generation of an "
                              "appropriate name automatically."}
DEFAULT_COLUMNS = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp",
                    "description": "CreationTimestamp is a timestamp representing the server time when this "
                                   "object was created."}]


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration: what kubectl shows as AGE."""
    if seconds < -1:
        return "<invalid>"
    s = max(0, int(seconds))
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if h < 24 * 365 * 2:
        return f"{d}d"
    if h < 24 * 365 * 8:
        return f"{d // 365}y{d % 365}d" if d % 365 else f"{d // 365}y"
    return f"{d // 365}y"


def _cell(value: Any, column: dict[str, Any], now: datetime.datetime) -> Any:
    if column.get("type") == "date" and isinstance(value, str):
        try:
            then = datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            return value
        return human_duration((now - then).total_seconds())
    return value


def wants_table(accept: str | None) -> bool:
    return bool(accept) and "as=Table" in accept


def json_path(obj: Any, path: str) -> Any:
    """A printer column's simple JSONPath (`.status.readyReplicas`, `.spec.items[0].name`)."""
    value = obj
    for part in filter(None, path.replace("[", ".[").split(".")):
        if part.startswith("[") and part.endswith("]"):
            index = int(part[1:-1])
            value = value[index] if isinstance(value, list) and -len(value) <= index < len(value) else None
        else:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            return None
    return value


def columns(printer_columns: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Printer columns as given by a CRD (or the default ones), Name first."""
    return printer_columns if printer_columns is not None else DEFAULT_COLUMNS


def table(objects: list[dict[str, Any]], printer_columns: list[dict[str, Any]] | None,
          resource_version: str) -> dict[str, Any]:
    chosen = columns(printer_columns)
    # A date column's cells are strings (the age) in the Table the server sends.
    definitions = [NAME_COLUMN] + [
        {"name": c["name"], "type": "string" if c.get("type") == "date" else c.get("type", "string"),
         "format": c.get("format", ""), "description": c.get("description", ""), "priority": c.get("priority", 0)}
        for c in chosen]
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for obj in objects:
        meta = obj.get("metadata") or {}
        rows.append({"cells": [meta.get("name"), *(_cell(json_path(obj, c["jsonPath"]), c, now) for c in chosen)],
                     "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": definitions, "rows": rows}
