"""Whether spec.engine.apiKeySecretRef can be handed to the engines: a pure decision.

A pod whose env names a missing Secret or key never starts (CreateContainerConfigError),
and an engine given an empty key refuses to start (it would otherwise serve without
authentication). Either way every pod the operator made would sit broken, and failover
would keep replacing them. So the operator reads the Secret first and, when it cannot
work, reports why (a Degraded condition naming the Secret and key) and makes no new pods.
The value itself is only checked for emptiness; it never leaves the Secret.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from preheat.operator.spec import SecretKeyRef


def _value(secret: Mapping[str, Any], key: str) -> str | None:
    """The key's value: `data` is base64 (what the API server returns); `stringData` is
    write-only on a real server, read here too for stand-ins that keep it."""
    data = secret.get("data") or {}
    if key in data:
        try:
            return base64.b64decode(data[key] or "", validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            return None
    string_data = secret.get("stringData") or {}
    return str(string_data[key]) if key in string_data else None


def api_key_problem(ref: SecretKeyRef, secret: Mapping[str, Any] | None,
                    ) -> tuple[str, str] | None:
    """(reason, message) when the engines cannot get a usable key from `secret` (the
    Secret `ref.name` as read, None when absent); None when they can."""
    where = f"Secret {ref.name!r} (spec.engine.apiKeySecretRef)"
    if secret is None:
        return ("ApiKeySecretNotFound",
                f"{where} not found in the service's namespace; no new pods until it exists")
    value = _value(secret, ref.key)
    if value is None:
        keys = sorted({*(secret.get("data") or {}), *(secret.get("stringData") or {})})
        return ("ApiKeySecretKeyNotFound",
                f"{where} has no key {ref.key!r} (keys: {', '.join(keys) or 'none'}); "
                "no new pods until it does")
    if not value.strip():
        return ("ApiKeyEmpty",
                f"key {ref.key!r} of {where} is empty: the engine refuses an empty API key; "
                "no new pods until it holds one")
    return None
