"""Pure functions from an InferenceService to the manifests of its children.

Nothing here talks to the API. The pod template hash is computed over the rendered pod
spec, so any spec change that alters what a pod runs (image, args, model, probes, ...) is
a new hash and the reconciler rolls pods; replicas and warm-pool size do not alter it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from preheat.operator import peer_secret
from preheat.operator.quantity import parse_quantity
from preheat.operator.resources import (
    API_VERSION,
    KIND,
    LABEL_ROLE,
    LABEL_SERVICE,
    LABEL_TEMPLATE_HASH,
    ROLE_SERVING,
    WARM_CONDITION,
)
from preheat.operator.spec import CACHE_NODE_LOCAL, CACHE_SHARED, GPU_RESOURCE, ServiceSpec

ENGINE_PORT = 8000  # DESIGN.md contract
TEMPLATES_DIR = "/etc/preheat/warmup-templates"
SNAPSHOT_DIR = "/var/lib/preheat/snapshots"
MODEL_DIR = "/models"
CACHE_DIR = "/var/cache/preheat"
MODEL_CACHE_DIR = "/var/cache/preheat-models"  # the engines' --download-dir (spec.model.cache)
RUN_AS = 1000
API_KEY_ENV = "PREHEAT_API_KEY"  # the engine's --api-key (engine/config.py: PREHEAT_<FIELD>)
SNAPSHOT_FLUSH_RESERVE_S = 15  # of the grace period, kept for persisting the snapshot


STARTUP_PERIOD_S = 2


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def child_metadata(name: str, namespace: str, uid: str, child_name: str | None = None,
                   **labels: str) -> dict[str, Any]:
    """Metadata every child of the InferenceService `name` carries: its service label (plus
    `labels`) and a controller owner reference, so deleting the service cascades to it."""
    return {
        "name": child_name or name,
        "namespace": namespace,
        "labels": {LABEL_SERVICE: name, **labels},
        "ownerReferences": [owner_reference(name, uid)],
    }


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_SERVICE: name, LABEL_ROLE: ROLE_SERVING}


def selector_string(name: str) -> str:
    """The scale subresource's label selector: what an HPA reads to find serving pods."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def snapshot_claim_name(name: str) -> str:
    return f"{name}-snapshots"


def model_cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def model_cache_volume(name: str, spec: ServiceSpec) -> dict[str, Any]:
    """The volume downloads land in. PodLocal: the pod's emptyDir (each new pod downloads);
    SharedVolume: one claim every pod mounts (one download for the service; needs
    ReadWriteMany storage, or every pod on one node); NodeLocal: a hostPath on each node
    (one download per node, on any storage; the namespace's Pod Security level must allow
    hostPath volumes)."""
    cache = spec.model.cache
    if cache.storage == CACHE_SHARED:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": model_cache_claim_name(name)}}
    if cache.storage == CACHE_NODE_LOCAL:
        return {"name": "model-cache", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "model-cache", "emptyDir": {}}


def weight_cache_dir(spec: ServiceSpec) -> str:
    """Where the engine keeps GGUF weights converted for loading. On the shared snapshot
    volume, the first pod's conversion (~15 s for the default model, minutes for a large one)
    serves every later pod and restart; on the pod's emptyDir each new pod converts again."""
    if spec.snapshot.shared and spec.snapshot.cache_weights:
        return f"{SNAPSHOT_DIR}/weights"
    return f"{CACHE_DIR}/weights"


@dataclass(frozen=True)
class ShutdownBudget:
    """How a pod spends terminationGracePeriodSeconds on the way out, in order: the preStop
    sleep (endpoints forget the pod; the operator has already relabelled it when it chose
    the exit), the drain of in-flight requests, then the snapshot, which must finish inside
    what is left — a write cut off by SIGKILL would be wasted."""
    endpoint_delay: int
    drain: int
    snapshot: int


def shutdown_budget(spec: ServiceSpec) -> ShutdownBudget:
    r = spec.readiness
    grace = r.termination_grace_period_seconds
    rest = max(1, grace - r.endpoint_delay_seconds)
    snapshot = max(1, min(SNAPSHOT_FLUSH_RESERVE_S, rest // 3)) if spec.snapshot.enabled else 0
    # The drain ends with up to 3 s for aborted streams to see their end (the engine's
    # ABORT_SETTLE_S), and a second is kept for the process to exit after the snapshot.
    return ShutdownBudget(r.endpoint_delay_seconds, max(1, rest - snapshot - 4), snapshot)


def peer_url(name: str) -> str:
    """The headless Service `<name>-engines`, by its short name (pods live in its
    namespace): ready serving pods only, which hold the hottest prefixes — never the
    routers the client Service may select, which do not proxy /admin/*."""
    return f"http://{name}-engines:{ENGINE_PORT}"


def default_spread(name: str) -> list[dict[str, Any]]:
    """Serving and warm pods of one service spread across nodes (and zones) when the cluster
    has several: losing a node then costs one pod, and the warm pool covers it. Soft
    (ScheduleAnyway), so a one-node cluster still schedules every pod."""
    match = {"matchLabels": {LABEL_SERVICE: name}}
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": match}
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")]


def _engine_env(name: str, spec: ServiceSpec) -> list[dict[str, Any]]:
    model = spec.model
    if model.pvc:
        model_ref = f"{MODEL_DIR}/{(model.path or '').lstrip('/')}".rstrip("/")
    else:
        model_ref = model.uri or model.path or ""
    budget = shutdown_budget(spec)
    env: dict[str, str] = {
        **({"PREHEAT_MODEL": model_ref} if model_ref else {}),  # empty: embedded default
        "PREHEAT_SERVED_MODEL_NAME": model.served_name or name,
        "PREHEAT_PORT": str(ENGINE_PORT),
        # In-flight requests get the grace period less the preStop sleep and the snapshot.
        "PREHEAT_SHUTDOWN_TIMEOUT": str(budget.drain),
        "PREHEAT_WEIGHT_CACHE_DIR": weight_cache_dir(spec),
        # The root filesystem is read-only: everything that writes goes to mounted dirs.
        "HOME": "/tmp",
        "XDG_CACHE_HOME": CACHE_DIR,
    }
    if model.remote:
        env["PREHEAT_DOWNLOAD_DIR"] = MODEL_CACHE_DIR
    if model.peer_fetch:
        # PodLocal: a new pod takes the model from a Ready peer (the same Service and peer
        # secret as the snapshot fetch), the hub or bucket only when no peer has it.
        env["PREHEAT_MODEL_PEER_URL"] = peer_url(name)
    if spec.needs_peer_secret:
        # The service's peer secret (operator/peer_secret.py): /admin/* and snapshot HMACs.
        env[peer_secret.ENV] = peer_secret.MOUNT_DIR
    if spec.engine.tensor_parallel_size > 1:
        env["PREHEAT_TENSOR_PARALLEL_SIZE"] = str(spec.engine.tensor_parallel_size)
    if spec.warmup_templates:
        env["PREHEAT_WARMUP_TEMPLATES"] = TEMPLATES_DIR
    if spec.snapshot.enabled:
        env["PREHEAT_SNAPSHOT_DIR"] = SNAPSHOT_DIR
        env["PREHEAT_SNAPSHOT_INTERVAL"] = str(spec.snapshot.interval_seconds)
        env["PREHEAT_SHUTDOWN_SNAPSHOT_TIMEOUT"] = str(budget.snapshot)
        if not spec.snapshot.shared:
            # The emptyDir's sizeLimit is invisible to statvfs (it shows the node's disk):
            # the engine prunes to it, leaving room for a write and a fetch. A shared claim
            # is pruned to its free space instead, which counts the weights on it too.
            env["PREHEAT_SNAPSHOT_MAX_BYTES"] = str(int(parse_quantity(spec.snapshot.size)))
        if spec.snapshot.peer_fetch:
            env["PREHEAT_SNAPSHOT_PEER_URL"] = peer_url(name)
    ours: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    key = spec.engine.api_key_secret
    if key is not None:
        # The engine reads PREHEAT_API_KEY like --api-key. From the Secret, never the pod
        # spec: the key stays out of the InferenceService, the pod and the template hash.
        # Only the client API asks for it (never /admin/*: that is the peer secret's); the
        # probes (/health, /ready) and /metrics stay open to the kubelet and operator.
        ours.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": key.name, "key": key.key}}})
    # User env comes last so it can override ours (e.g. PREHEAT_LOG_LEVEL, PREHEAT_DTYPE).
    user_names = {e.get("name") for e in spec.engine.env}
    return [e for e in ours if e["name"] not in user_names] + [dict(e) for e in spec.engine.env]


def shm_volume(tensor_parallel_size: int) -> dict[str, Any]:
    """/dev/shm: memory-backed (torch shares tensors through it; the container runtime's
    default is 64 MiB). With tensor parallelism NCCL keeps its shared-memory transport
    buffers there, which grow with the number of peers: capped at 1 GiB per rank (it counts
    against the pod's memory limit only as far as it is used)."""
    if tensor_parallel_size > 1:
        return {"medium": "Memory", "sizeLimit": f"{tensor_parallel_size}Gi"}
    return {"medium": "Memory"}


def engine_resources(spec: ServiceSpec) -> dict[str, Any]:
    """The container's resources: the user's, plus one GPU per tensor-parallel rank as
    limits["nvidia.com/gpu"] (the scheduler then requests the same; parse_spec refused a
    user value that disagrees). A single-rank pod gets exactly what the user wrote."""
    resources = {k: dict(v) for k, v in spec.engine.resources.items()}
    size = spec.engine.tensor_parallel_size
    if size > 1:
        resources.setdefault("limits", {})[GPU_RESOURCE] = size
    return resources


def _volumes(name: str, spec: ServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": shm_volume(spec.engine.tensor_parallel_size)},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.warmup_templates:
        volumes.append({"name": "warmup-templates", "configMap": {"name": spec.warmup_templates}})
        mounts.append({"name": "warmup-templates", "mountPath": TEMPLATES_DIR, "readOnly": True})
    if spec.needs_peer_secret:
        volumes.append(peer_secret.volume(name))
        mounts.append(peer_secret.mount())
    if spec.snapshot.shared:
        volumes.append({"name": "snapshots",
                        "persistentVolumeClaim": {"claimName": snapshot_claim_name(name)}})
        mounts.append({"name": "snapshots", "mountPath": SNAPSHOT_DIR})
    elif spec.snapshot.enabled:  # PodLocal: any storage works, nothing to bind
        volumes.append({"name": "snapshots", "emptyDir": {"sizeLimit": spec.snapshot.size}})
        mounts.append({"name": "snapshots", "mountPath": SNAPSHOT_DIR})
    if spec.model.remote:
        volumes.append(model_cache_volume(name, spec))
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_DIR})
    if spec.model.pvc:
        volumes.append({"name": "model",
                        "persistentVolumeClaim": {"claimName": spec.model.pvc, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return volumes, mounts


def pod_spec(name: str, spec: ServiceSpec) -> dict[str, Any]:
    volumes, mounts = _volumes(name, spec)
    r = spec.readiness
    http = lambda path: {"path": path, "port": "http"}  # noqa: E731
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine.image,
        "command": ["preheat", "serve"],
        "args": list(spec.engine.args),
        "env": _engine_env(name, spec),
        **({"envFrom": [{"secretRef": {"name": spec.model.credentials_secret}}]}
           if spec.model.credentials_secret else {}),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        # /health answers within a second of the process starting (uvicorn comes up before
        # the model loads), so probe often: a 10 s period could add 10 s to every cold start.
        # Liveness only starts once this passes.
        "startupProbe": {"httpGet": http("/health"), "periodSeconds": STARTUP_PERIOD_S,
                         "failureThreshold": max(1, math.ceil(r.startup_timeout_seconds / STARTUP_PERIOD_S))},
        "livenessProbe": {"httpGet": http("/health"), "periodSeconds": 10, "failureThreshold": 3},
        # /ready is 200 only when loaded, restored and warmed (DESIGN.md contract).
        "readinessProbe": {"httpGet": http("/ready"), "periodSeconds": r.period_seconds,
                           "failureThreshold": r.failure_threshold},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if r.endpoint_delay_seconds > 0:
        # For exits the operator did not choose (eviction, node drain, kubectl delete): keep
        # serving while the endpoints forget the pod, then SIGTERM starts the drain.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": r.endpoint_delay_seconds}}}
    e = spec.engine
    if e.image_pull_policy:
        container["imagePullPolicy"] = e.image_pull_policy
    resources = engine_resources(spec)
    if resources:
        container["resources"] = resources
    out: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        "readinessGates": [{"conditionType": WARM_CONDITION}],
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token in the pod unless asked for.
        "automountServiceAccountToken": e.automount_service_account_token,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "topologySpreadConstraints": (
            default_spread(name) if e.topology_spread_constraints is None
            else [dict(c) for c in e.topology_spread_constraints]),
    }
    if not out["topologySpreadConstraints"]:
        del out["topologySpreadConstraints"]
    if e.node_selector:
        out["nodeSelector"] = e.node_selector
    if e.tolerations:
        out["tolerations"] = [dict(t) for t in e.tolerations]
    if e.affinity:
        out["affinity"] = dict(e.affinity)
    if e.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in e.image_pull_secrets]
    if e.service_account_name:
        out["serviceAccountName"] = e.service_account_name
    if e.priority_class_name:
        out["priorityClassName"] = e.priority_class_name
    if e.runtime_class_name:
        out["runtimeClassName"] = e.runtime_class_name
    return out


def template_hash(pod: dict[str, Any]) -> str:
    blob = json.dumps(pod, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def pod(name: str, namespace: str, uid: str, spec: ServiceSpec, pod_name: str, role: str,
        ) -> dict[str, Any]:
    body = pod_spec(name, spec)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(name, namespace, uid, pod_name,
                                   **{LABEL_ROLE: role, LABEL_TEMPLATE_HASH: template_hash(body)}),
        "spec": body,
    }


def service(name: str, namespace: str, uid: str,
            selector: dict[str, str] | None = None) -> dict[str, Any]:
    """The clients' Service `<name>`; `selector` (render_router.client_selector) picks the
    router pods or the serving pods, default the serving pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(name, namespace, uid),
        "spec": {
            "type": "ClusterIP",
            "selector": selector or selector_labels(name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }


def claim_owner_references(name: str, uid: str, spec: ServiceSpec) -> list[dict[str, Any]]:
    """Owned (deleted with the service) unless snapshot.retainOnDelete keeps it."""
    return [] if spec.snapshot.retain_on_delete else [owner_reference(name, uid)]


def _claim(name: str, namespace: str, uid: str, claim_name: str, access_mode: str, size: str,
           storage_class: str | None, owners: list[dict[str, Any]]) -> dict[str, Any]:
    pvc_spec: dict[str, Any] = {"accessModes": [access_mode], "resources": {"requests": {"storage": size}}}
    if storage_class:
        pvc_spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**child_metadata(name, namespace, uid, claim_name), "ownerReferences": owners},
        "spec": pvc_spec,
    }


def snapshot_claim(name: str, namespace: str, uid: str, spec: ServiceSpec) -> dict[str, Any]:
    s = spec.snapshot
    return _claim(name, namespace, uid, snapshot_claim_name(name), s.access_mode, s.size, s.storage_class,
                  claim_owner_references(name, uid, spec))


def model_cache_claim(name: str, namespace: str, uid: str, spec: ServiceSpec) -> dict[str, Any] | None:
    """The shared download claim (model.cache.storage SharedVolume), owned by the service:
    deleting the service deletes its cached weights."""
    c = spec.model.cache
    if not spec.model.remote or c.storage != CACHE_SHARED:
        return None
    return _claim(name, namespace, uid, model_cache_claim_name(name), c.access_mode, c.size, c.storage_class,
                  [owner_reference(name, uid)])


def external_metric_selector(name: str) -> dict[str, Any]:
    """The label selector an External metric carries: Prometheus labels that the chart's
    PodMonitor copies from the pod labels (podTargetLabels: preheat.dev/service and
    preheat.dev/role, sanitised to preheat_dev_service / preheat_dev_role), so the adapter
    sums the gauge over this service's serving pods only."""
    return {"matchLabels": {"preheat_dev_service": name, "preheat_dev_role": ROLE_SERVING}}


def disruption_budget(name: str, namespace: str, uid: str, spec: ServiceSpec,
                      ) -> dict[str, Any] | None:
    """Voluntary evictions (node drains, cluster upgrades) take at most maxUnavailable serving
    pods at a time; the warm pool covers each one. Warm pods are not covered: losing one
    costs no capacity. Unready serving pods may always be evicted (they serve nothing)."""
    pdb = spec.disruption_budget
    if not pdb.enabled:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(name, namespace, uid),
        "spec": {"selector": {"matchLabels": selector_labels(name)},
                 "maxUnavailable": pdb.max_unavailable,
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def autoscaler(name: str, namespace: str, uid: str, spec: ServiceSpec) -> dict[str, Any] | None:
    """The HPA for Resource/Pods/External metrics; None without autoscaling and in Engine
    mode, where the operator itself sets spec.replicas through /scale."""
    auto = spec.autoscaling
    if auto is None or auto.engine_mode:
        return None
    m = auto.metric
    if m.type == "Resource":
        metric = {"type": "Resource", "resource": {"name": m.name, "target": {
            "type": "Utilization", "averageUtilization": m.target_average_utilization}}}
    elif m.type == "External":
        # AverageValue: the HPA divides the adapter's sum over the serving pods by the
        # current replicas, i.e. the same per-pod average as the Pods route.
        metric = {"type": "External", "external": {
            "metric": {"name": m.name, "selector": external_metric_selector(name)},
            "target": {"type": "AverageValue", "averageValue": m.target_average_value}}}
    else:
        metric = {"type": "Pods", "pods": {"metric": {"name": m.name}, "target": {
            "type": "AverageValue", "averageValue": m.target_average_value}}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(name, namespace, uid),
        "spec": {
            # The HPA drives spec.replicas through the CRD's scale subresource.
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [metric],
            # The same stabilization windows the Engine mode applies (and the HPA's defaults).
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_stabilization_seconds},
                "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds},
            },
        },
    }
