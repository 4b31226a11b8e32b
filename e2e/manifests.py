"""The objects the scenario applies: an InferenceService of the embedded model and a small
warmup-template ConfigMap. Small engine settings keep several engines cheap on 2 CPU cores."""

from __future__ import annotations

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
]


def warmup_configmap(namespace: str = NAMESPACE) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": TEMPLATES, "namespace": namespace},
            "data": {"e2e-support.yaml": WARMUP_TEMPLATE}}


def inference_service(name: str, *, replicas: int = 1, warm_pool: int = 1,
                      image: str = DEFAULT_IMAGE, snapshot: bool = True,
                      templates: bool = True, namespace: str = NAMESPACE,
                      autoscaling: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {},  # the engine's embedded default model (SmolLM2-135M-Instruct)
        "engine": {"image": image, "env": ENGINE_ENV},
        "replicas": replicas,
        "warmPool": {"size": warm_pool},
        "snapshot": {"enabled": snapshot, "size": "1Gi", "accessMode": "ReadWriteOnce"},
        # Probe every second so a cold pod is seen ready as soon as it is; a short grace
        # period because the engine drains an idle server in well under a second.
        "readiness": {"periodSeconds": 1, "terminationGracePeriodSeconds": 20},
    }
    if templates:
        spec["warmupTemplates"] = {"configMap": TEMPLATES}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return {"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
