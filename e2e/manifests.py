"""The objects the scenario applies: an InferenceService of the embedded model and a small
warmup-template ConfigMap. Small engine settings keep several engines cheap on 2 CPU cores."""

from __future__ import annotations

import base64
from typing import Any

NAMESPACE = "default"
DEFAULT_IMAGE = "ghcr.io/preheat/engine:0.1.0"
TEMPLATES = "e2e-warmup-templates"

# One short business-shaped template: a pinned system prompt and a two-turn chat.
WARMUP_TEMPLATE = """\
templates:
  - name: e2e-support
    description: A short support chat, enough to exercise warmup without slowing CI.
    system: You are a concise support assistant for an online store.
    conversations:
      - - {role: user, content: "Where is my order?"}
        - {role: assistant, content: "Please send me your order number."}
        - {role: user, content: "It is NW-20481377."}
    max_tokens: 4
"""

ENGINE_ENV = [
    {"name": "PREHEAT_MAX_TOTAL_TOKENS", "value": "4096"},
    {"name": "PREHEAT_MAX_MODEL_LEN", "value": "1024"},
    {"name": "PREHEAT_MAX_NUM_SEQS", "value": "8"},
    {"name": "PREHEAT_LOG_LEVEL", "value": "info"},
    # Several engines share the machine's cores (no cgroups here): one compute thread each,
    # as a CPU limit of 1 would give them, instead of every engine spinning on all cores.
    {"name": "OMP_NUM_THREADS", "value": "1"},
]


API_KEY_SECRET_KEY = "api-key"


def api_key_secret(name: str, key: str, namespace: str = NAMESPACE) -> dict[str, Any]:
    """A Secret holding the engines' API key (data is base64, as the API server keeps it)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace},
            "data": {API_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()}}


def warmup_configmap(namespace: str = NAMESPACE) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": TEMPLATES, "namespace": namespace},
            "data": {"e2e-support.yaml": WARMUP_TEMPLATE}}


def inference_service(name: str, *, replicas: int = 1, warm_pool: int = 1,
                      image: str = DEFAULT_IMAGE, snapshot: bool = True,
                      shared_snapshots: bool = False, templates: bool = True,
                      namespace: str = NAMESPACE, failover_s: int = 2,
                      endpoint_delay_s: int = 1,
                      autoscaling: dict[str, Any] | None = None,
                      api_key_secret: str | None = None, router: bool = True) -> dict[str, Any]:
    """The product's defaults except where noted: snapshots are pod-local (each pod's
    emptyDir, a new pod fetches one from a ready peer through the Service) unless
    shared_snapshots asks for a ReadWriteOnce shared claim (pods then share one node).
    api_key_secret: the engines' API key from that Secret (its key API_KEY_SECRET_KEY).
    router: the default 2 router pods in front (the Service selects them); False: off."""
    spec: dict[str, Any] = {
        "model": {},  # the engine's embedded default model (SmolLM2-135M-Instruct)
        "engine": {"image": image, "env": ENGINE_ENV},
        "replicas": replicas,
        "warmPool": {"size": warm_pool},
        "snapshot": {"enabled": snapshot, "size": "1Gi",
                     **({"storage": "SharedVolume", "accessMode": "ReadWriteOnce"}
                        if shared_snapshots else {})},
        # Probe every second so a cold pod is seen ready as soon as it is; a short grace
        # period because the engine drains an idle server in well under a second; the
        # local Service stand-in follows endpoints within 0.5 s, so a 1 s endpoint delay.
        "readiness": {"periodSeconds": 1, "terminationGracePeriodSeconds": 20,
                      "endpointDelaySeconds": endpoint_delay_s},
        "failover": {"unreadySeconds": failover_s},
    }
    if not router:
        spec["router"] = {"enabled": False}
    if templates:
        spec["warmupTemplates"] = {"configMap": TEMPLATES}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    if api_key_secret:
        spec["engine"]["apiKeySecretRef"] = {"name": api_key_secret, "key": API_KEY_SECRET_KEY}
    return {"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
