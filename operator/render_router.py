"""Pure functions from an InferenceService to its router children (docs/router.md):

- router pods (`preheat router`, label role=router): no GPU, no warm gate, the engines'
  security settings, the router ServiceAccount the chart creates in every watched namespace
  (get/list/watch of pods, nothing else);
- the headless Service `<name>-engines` over the Ready serving pods: what the routers
  follow and what the snapshot peer URL points at;
- the client Service `<name>`'s selector: the router pods once one is Ready, else (router
  off, or none Ready yet) the serving pods, so a Service never loses its last endpoint;
- a PodDisruptionBudget over the router pods (the engines keep theirs).
"""

from __future__ import annotations

from typing import Any

from preheat.operator.render import (
    ENGINE_PORT,
    RUN_AS,
    child_metadata,
    selector_labels,
    template_hash,
)
from preheat.operator.resources import LABEL_ROLE, LABEL_SERVICE, LABEL_TEMPLATE_HASH, ROLE_ROUTER
from preheat.operator.spec import ServiceSpec

ROUTER_SERVICE_ACCOUNT = "preheat-router"  # the chart's per-namespace router account


def engines_service_name(name: str) -> str:
    return f"{name}-engines"


def router_pdb_name(name: str) -> str:
    return f"{name}-router"


def router_labels(name: str) -> dict[str, str]:
    return {LABEL_SERVICE: name, LABEL_ROLE: ROLE_ROUTER}


def client_selector(name: str, spec: ServiceSpec, router_ready: bool) -> dict[str, str]:
    """What the Service `<name>` selects: routers only while one is Ready to take traffic."""
    return router_labels(name) if spec.router.enabled and router_ready else selector_labels(name)


def router_pod_name(name: str, suffix: str) -> str:
    long = f"{name}-router-{suffix}"
    return long if len(long) <= 63 else f"{name}-r-{suffix}"  # a DNS label, like engine pods


def router_pod_spec(name: str, spec: ServiceSpec, image: str,
                    service_account: str = ROUTER_SERVICE_ACCOUNT) -> dict[str, Any]:
    r = spec.readiness
    http = lambda path: {"path": path, "port": "http"}  # noqa: E731
    container: dict[str, Any] = {
        "name": "router",
        "image": image,
        "command": ["preheat", "router"],
        "env": [{"name": "PREHEAT_ROUTER_SERVICE", "value": name},
                {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                # Which router pod it is, and its address: it pulls its peers' placements
                # from its pod IP, which they check, and is no peer of itself.
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        # /ready: the router has listed the engine pods (requests wait for an engine from then on).
        "readinessProbe": {"httpGet": http("/ready"), "periodSeconds": r.period_seconds,
                           "failureThreshold": r.failure_threshold},
        "livenessProbe": {"httpGet": http("/health"), "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
        },
    }
    if r.endpoint_delay_seconds > 0:
        # Leave the client Service's endpoints before SIGTERM, as the engines do.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": r.endpoint_delay_seconds}}}
    if spec.router.resources:
        container["resources"] = {k: dict(v) for k, v in spec.router.resources.items()}
    if spec.engine.image_pull_policy:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    out: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "serviceAccountName": service_account,
        "automountServiceAccountToken": True,  # it watches the pods
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
             "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": router_labels(name)}}],
    }
    e = spec.engine
    if e.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in e.image_pull_secrets]
    if e.priority_class_name:
        out["priorityClassName"] = e.priority_class_name
    return out


def router_pod(name: str, namespace: str, uid: str, spec: ServiceSpec, pod_name: str,
               image: str, service_account: str = ROUTER_SERVICE_ACCOUNT) -> dict[str, Any]:
    body = router_pod_spec(name, spec, image, service_account)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": child_metadata(name, namespace, uid, pod_name, **{
            LABEL_ROLE: ROLE_ROUTER, LABEL_TEMPLATE_HASH: template_hash(body)}),
        "spec": body,
    }


def engines_service(name: str, namespace: str, uid: str) -> dict[str, Any]:
    """Headless: DNS gives the Ready serving pods' IPs (snapshot peers), the routers watch
    the same pods themselves."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": child_metadata(name, namespace, uid, engines_service_name(name)),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_disruption_budget(name: str, namespace: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": child_metadata(name, namespace, uid, router_pdb_name(name)),
        "spec": {"selector": {"matchLabels": router_labels(name)}, "maxUnavailable": 1,
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }
