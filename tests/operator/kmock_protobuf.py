"""Kubernetes protobuf request bodies, decoded for the API emulator (a test part).

client-go's typed clients send built-in objects as `application/vnd.kubernetes.protobuf`
(and accept JSON back): helm's release storage does, creating and updating the release
Secret (or ConfigMap, with HELM_DRIVER=configmap). The wire format
(https://kubernetes.io/docs/reference/using-api/api-concepts/#protobuf-encoding) is the
magic `k8s\\x00`, then a runtime.Unknown {1: typeMeta {1: apiVersion, 2: kind}, 2: raw},
raw being the object's message as k8s.io/api's generated.proto numbers its fields. Only the
kinds below are decoded (their field numbers copied from those .proto files); any other kind
is answered 415, never guessed.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"


class UnsupportedProtobuf(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a message: ints for varints, bytes for length-delimited."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            yield number, data[pos:pos + size]
            pos += size
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise UnsupportedProtobuf(f"wire type {wire}")


def _map_entry(data: bytes) -> tuple[str, bytes]:
    entry = dict(fields(data))
    return bytes(entry.get(1, b"")).decode(), bytes(entry.get(2, b""))


def _text(value: Any) -> str:
    return bytes(value).decode()


# k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto ObjectMeta (timestamps, owner
# references and managed fields are the server's business: not read).
_META_STRINGS = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}


def object_meta(data: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for number, value in fields(data):
        if number in _META_STRINGS:
            if value:  # proto2 sends unset strings as "": Go's JSON omits them
                meta[_META_STRINGS[number]] = _text(value)
        elif number in (11, 12):
            key, val = _map_entry(bytes(value))
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = val.decode()
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
    return meta


def _secret(data: bytes) -> dict[str, Any]:
    """k8s.io/api/core/v1 Secret: 1 metadata, 2 data (bytes), 3 type, 4 stringData, 5 immutable."""
    body: dict[str, Any] = {}
    for number, value in fields(data):
        if number == 1:
            body["metadata"] = object_meta(bytes(value))
        elif number == 2:
            key, val = _map_entry(bytes(value))
            body.setdefault("data", {})[key] = base64.b64encode(val).decode()
        elif number == 3:
            body["type"] = _text(value)
        elif number == 4:
            key, val = _map_entry(bytes(value))
            body.setdefault("stringData", {})[key] = val.decode()
        elif number == 5:
            body["immutable"] = bool(value)
    return body


def _config_map(data: bytes) -> dict[str, Any]:
    """k8s.io/api/core/v1 ConfigMap: 1 metadata, 2 data, 3 binaryData, 4 immutable."""
    body: dict[str, Any] = {}
    for number, value in fields(data):
        if number == 1:
            body["metadata"] = object_meta(bytes(value))
        elif number == 2:
            key, val = _map_entry(bytes(value))
            body.setdefault("data", {})[key] = val.decode()
        elif number == 3:
            key, val = _map_entry(bytes(value))
            body.setdefault("binaryData", {})[key] = base64.b64encode(val).decode()
        elif number == 4:
            body["immutable"] = bool(value)
    return body


def _delete_options(data: bytes) -> dict[str, Any]:
    """meta/v1 DeleteOptions: 1 gracePeriodSeconds, 4 propagationPolicy (the rest unread)."""
    body: dict[str, Any] = {}
    for number, value in fields(data):
        if number == 1:
            body["gracePeriodSeconds"] = value
        elif number == 4:
            body["propagationPolicy"] = _text(value)
    return body


DECODERS: dict[tuple[str, str], Callable[[bytes], dict[str, Any]]] = {
    ("v1", "Secret"): _secret,
    ("v1", "ConfigMap"): _config_map,
    ("v1", "DeleteOptions"): _delete_options,
}


def decode(body: bytes) -> dict[str, Any]:
    """A protobuf request body as the JSON object it stands for."""
    if not body.startswith(MAGIC):
        raise UnsupportedProtobuf("no k8s protobuf envelope")
    unknown = dict(fields(body[len(MAGIC):]))
    type_meta = dict(fields(bytes(unknown.get(1, b""))))
    api_version, kind = _text(type_meta.get(1, b"")), _text(type_meta.get(2, b""))
    decoder = DECODERS.get((api_version, kind))
    if decoder is None:
        raise UnsupportedProtobuf(f"{api_version}/{kind} in protobuf")
    return {"apiVersion": api_version, "kind": kind, **decoder(bytes(unknown.get(2, b"")))}
