"""The per-InferenceService peer secret: what the engines of one service share, and no
client has (engine/peer/peer_secret.py is the engine's side).

The operator creates it once — `create` only, a 409 means it exists — and never reads it
back: it has no `get` on Secrets. The value is random (32 bytes, hex) and goes straight
into the create call. The engines get it as a Secret volume (`current`, and `previous`
when a person rotates it by hand: docs/security.md), handed to --peer-secret-file.

Its lifetime follows the snapshots it signs: with a shared claim the Secret is owned by
the claim, so it goes when the claim goes and stays when `snapshot.retainOnDelete` keeps
the claim (a re-created service adopts the claim and finds the Secret: its snapshots
still verify); without a claim it is owned by the InferenceService. Owner references to
the claim set blockOwnerDeletion false: it needs no permission on the claim's finalizers.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from preheat.operator.resources import API_VERSION, KIND, LABEL_SERVICE

MOUNT_DIR = "/etc/preheat/peer-secret"
VOLUME = "peer-secret"
ENV = "PREHEAT_PEER_SECRET_FILE"  # the engine's --peer-secret-file
KEY = "current"


def secret_name(service: str) -> str:
    return f"{service}-peer"


def owner(service: str, service_uid: str, claim: dict[str, Any] | None) -> dict[str, Any]:
    """The owner reference: the claim when the snapshots live on one, else the service."""
    if claim is not None and (claim.get("metadata") or {}).get("uid"):
        meta = claim["metadata"]
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": meta["name"],
                "uid": meta["uid"], "controller": False, "blockOwnerDeletion": False}
    return {"apiVersion": API_VERSION, "kind": KIND, "name": service, "uid": service_uid,
            "controller": True, "blockOwnerDeletion": False}


def manifest(service: str, namespace: str, owner_ref: dict[str, Any],
             value: str | None = None) -> dict[str, Any]:
    """The Secret to create; `value` only for tests (default: 32 random bytes, hex)."""
    value = value or secrets.token_hex(32)
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": secret_name(service), "namespace": namespace,
                     "labels": {LABEL_SERVICE: service}, "ownerReferences": [owner_ref]},
        "data": {KEY: base64.b64encode(value.encode()).decode()},
    }


def volume(service: str) -> dict[str, Any]:
    # 0440 with the pod's fsGroup: the engine (non-root) reads it, nobody else in the pod.
    return {"name": VOLUME, "secret": {"secretName": secret_name(service), "defaultMode": 0o440}}


def mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}
