"""What the pods' own status says about their configuration: a pure reading.

The operator has no `get` on Secrets (a Secret holds what the operator has no need to
see). A Secret a pod needs and cannot have — the API key (spec.engine.apiKeySecretRef),
model credentials (spec.model.credentialsSecretRef), anything named in spec.engine.env —
shows in the pod instead: the kubelet keeps its container Waiting with reason
CreateContainerConfigError and a message in its own words, `secret "NAME" not found` or
`couldn't find key KEY in Secret NS/NAME`. That is read here, for any Secret, and becomes
a problem the reconciler reports (Degraded) and that stops new pods until the kubelet
starts the container (the Secret exists now): more pods would sit in the same state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

CONFIG_ERROR = "CreateContainerConfigError"
_NOT_FOUND = re.compile(r'secret "([^"]+)" not found')
_NO_KEY = re.compile(r"couldn't find key (\S+) in Secret ([^/\s]+)/(\S+)")


def waiting_config_errors(pod: Mapping[str, Any]) -> list[str]:
    """The kubelet's messages for this pod's containers stuck in CreateContainerConfigError."""
    status = pod.get("status") or {}
    out = []
    for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == CONFIG_ERROR:
            out.append(str(waiting.get("message") or "").strip())
    return out


def secret_refs(spec: Mapping[str, Any]) -> dict[str, str]:
    """Secret name -> the spec field naming it, from the raw InferenceService spec (read
    defensively: fields other engineers add may be absent)."""
    refs: dict[str, str] = {}
    engine = spec.get("engine") if isinstance(spec.get("engine"), Mapping) else {}
    model = spec.get("model") if isinstance(spec.get("model"), Mapping) else {}
    for where, ref in (("spec.engine.apiKeySecretRef", engine.get("apiKeySecretRef")),
                       ("spec.model.credentialsSecretRef", model.get("credentialsSecretRef"))):
        if isinstance(ref, Mapping) and isinstance(ref.get("name"), str):
            refs.setdefault(ref["name"], where)
    for e in engine.get("env") or []:
        ref = ((e or {}).get("valueFrom") or {}).get("secretKeyRef") if isinstance(e, Mapping) else None
        if isinstance(ref, Mapping) and isinstance(ref.get("name"), str):
            refs.setdefault(ref["name"], f"spec.engine.env[{e.get('name')}]")
    return refs


def _problem(message: str, refs: Mapping[str, str]) -> tuple[str, str]:
    if m := _NOT_FOUND.search(message):
        name = m.group(1)
        where = f" ({refs[name]})" if name in refs else ""
        return "SecretNotFound", f"Secret {name!r}{where} not found in the service's namespace"
    if m := _NO_KEY.search(message):
        key, name = m.group(1), m.group(3)
        where = f" ({refs[name]})" if name in refs else ""
        return "SecretKeyNotFound", f"Secret {name!r}{where} has no key {key!r}"
    return "ContainerConfigError", message or "the kubelet cannot configure the container"


def config_problems(pods: Iterable[Mapping[str, Any]], spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(reason, message) per distinct configuration error the pods show; the message names
    the Secret and the spec field that names it, and says that no new pods follow."""
    refs = secret_refs(spec)
    found: dict[tuple[str, str], None] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for message in waiting_config_errors(pod):
            found.setdefault(_problem(message, refs), None)
    # The pods' names stay out of the message: it must not change (and be reported again)
    # each time a pod comes or goes while the Secret is missing.
    return [(reason, f"{text}: the pods cannot start ({CONFIG_ERROR}); no new pods until "
                     "they can")
            for reason, text in found]
