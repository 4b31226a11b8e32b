"""An InferenceService's spec as a typed value, with the same defaults as the CRD schema.

The API server applies the schema's defaults, but the operator must not depend on that
(older objects, tests, a CRD installed without defaults), so parsing defaults again here.
Anything the schema cannot express is checked here and raised as SpecError, which the
reconciler reports as a Degraded condition instead of crashing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from preheat.operator.quantity import parse_quantity
from preheat.operator.scale_decide import ENGINE_METRICS

METRIC_TYPES = ("Engine", "Pods", "External", "Resource")

class SpecError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


CACHE_POD_LOCAL = "PodLocal"  # each pod's emptyDir: every new pod downloads
CACHE_SHARED = "SharedVolume"  # one claim (ReadWriteMany) every pod mounts: one download
CACHE_NODE_LOCAL = "NodeLocal"  # a hostPath on each node: one download per node (any storage)
CACHE_STORAGES = (CACHE_POD_LOCAL, CACHE_SHARED, CACHE_NODE_LOCAL)
REMOTE_SCHEMES = ("hf://", "s3://")


@dataclass(frozen=True)
class ModelCacheSpec:
    """Where engines download a hub or S3 model (their --download-dir)."""
    storage: str = CACHE_POD_LOCAL
    size: str = "50Gi"
    storage_class: str | None = None
    access_mode: str = "ReadWriteMany"
    host_path: str = "/var/cache/preheat/models"


@dataclass(frozen=True)
class ModelSource:
    path: str | None = None  # a path inside the image, or inside the PVC when pvc is set
    pvc: str | None = None  # claim name holding the weights (mounted read-only)
    uri: str | None = None  # hf://, s3:// or ORG/NAME: the engine downloads it (pvc:// is parsed into pvc/path)
    served_name: str | None = None
    credentials_secret: str | None = None  # a Secret whose keys become the engines' env (HF_TOKEN, AWS_*)
    cache: ModelCacheSpec = ModelCacheSpec()

    @property
    def remote(self) -> bool:
        """The engine downloads it (hub or S3) rather than reading a path."""
        return bool(self.uri)

    @property
    def peer_fetch(self) -> bool:
        """Each pod downloads into its own emptyDir: a new pod takes the files from a Ready
        peer of the service first (the engine's --model-peer-url), the source only when no
        peer has them."""
        return self.remote and self.cache.storage == CACHE_POD_LOCAL


def _model_uri(uri: str | None) -> tuple[str | None, str | None, str | None]:
    """(uri for the engine, claim, path in claim) from spec.model.uri."""
    if not uri:
        return None, None, None
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        if not claim:
            raise SpecError("InvalidModelSource", f"model.uri {uri!r}: expected pvc://CLAIM/PATH")
        return None, claim, path or None
    if "://" in uri and not uri.startswith(REMOTE_SCHEMES):
        raise SpecError("InvalidModelSource", f"model.uri {uri!r}: the scheme must be hf://, s3:// "
                        "or pvc:// (or give a hub id ORG/NAME)")
    return uri, None, None


def _model_cache(cache: Mapping[str, Any]) -> ModelCacheSpec:
    storage = cache.get("storage", CACHE_POD_LOCAL)
    if storage not in CACHE_STORAGES:
        raise SpecError("InvalidSpec", f"model.cache.storage must be one of {', '.join(CACHE_STORAGES)}, "
                        f"got {storage!r}")
    return ModelCacheSpec(storage=storage, size=str(cache.get("size", "50Gi")),
                          storage_class=cache.get("storageClassName"),
                          access_mode=cache.get("accessMode", "ReadWriteMany"),
                          host_path=cache.get("hostPath", "/var/cache/preheat/models"))


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the service's namespace (as a pod's env secretKeyRef)."""
    name: str
    key: str


@dataclass(frozen=True)
class EngineSpec:
    image: str
    image_pull_policy: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    tensor_parallel_size: int = 1  # GPUs (ranks) per pod; > 1 requests that many nvidia.com/gpu
    # Pod settings (issue 12). None/empty: left out of the pod spec.
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    # No API token in the engine's pod unless asked for: the engine never calls the API.
    automount_service_account_token: bool = False
    affinity: dict[str, Any] = field(default_factory=dict)
    # None: the default spread (serving and warm pods across nodes, see render.py);
    # an empty tuple: no spread constraints at all.
    topology_spread_constraints: tuple[dict[str, Any], ...] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    # The engines' API key (PREHEAT_API_KEY from this Secret key); None: no authentication.
    api_key_secret: SecretKeyRef | None = None


STORAGE_POD_LOCAL = "PodLocal"  # each pod's own emptyDir; new pods fetch from a ready peer
STORAGE_SHARED = "SharedVolume"  # one PersistentVolumeClaim mounted by every pod


@dataclass(frozen=True)
class SnapshotSpec:
    enabled: bool = True
    # PodLocal works on any storage (nothing to bind); SharedVolume survives a restart of
    # every pod but needs ReadWriteMany storage (or every pod on one node).
    storage: str = STORAGE_POD_LOCAL
    peer_fetch: bool = True  # a starting pod fetches a fresh snapshot through the Service
    storage_class: str | None = None
    size: str = "10Gi"
    access_mode: str = "ReadWriteMany"
    interval_seconds: int = 300
    cache_weights: bool = True  # keep converted GGUF weights on the shared volume too
    retain_on_delete: bool = False  # keep the shared claim when the service is deleted

    @property
    def shared(self) -> bool:
        return self.enabled and self.storage == STORAGE_SHARED


@dataclass(frozen=True)
class FailoverSpec:
    # A serving pod unready this long (crashed, hung, unschedulable, node lost) is replaced
    # by promoting a ready warm pod. Long enough to ride out a readiness blip.
    unready_seconds: int = 5


IntOrPercent = int | str


@dataclass(frozen=True)
class RolloutSpec:
    """Deployment semantics: percents of replicas, maxSurge rounded up, maxUnavailable down.
    maxUnavailable defaults to 0, not the Deployment's 25%: the warm pool already absorbs a
    rollout, so dropping serving capacity would only trade users' latency for speed."""
    max_surge: IntOrPercent = "25%"
    max_unavailable: IntOrPercent = 0
    progress_deadline_seconds: int = 600

    def surge(self, replicas: int) -> int:
        return resolve_int_or_percent(self.max_surge, replicas, round_up=True)

    def unavailable(self, replicas: int) -> int:
        return resolve_int_or_percent(self.max_unavailable, replicas, round_up=False)


@dataclass(frozen=True)
class DisruptionBudgetSpec:
    enabled: bool = True
    max_unavailable: IntOrPercent = 1  # serving pods an eviction may take at once


@dataclass(frozen=True)
class MetricSpec:
    # "Engine": the operator scrapes the engine gauge `name` from the Ready serving pods and
    # scales itself (no HPA); "Pods" / "External" / "Resource": an HPA with that metric.
    type: str
    name: str
    target_average_utilization: int | None = None
    target_average_value: str | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    metric: MetricSpec
    # The HPA's behavior.scaleUp/scaleDown.stabilizationWindowSeconds, with its defaults.
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300

    @property
    def engine_mode(self) -> bool:
        return self.metric.type == "Engine"


@dataclass(frozen=True)
class ReadinessSpec:
    startup_timeout_seconds: int = 1800  # model load of a large model from a cold node
    period_seconds: int = 5
    failure_threshold: int = 3
    termination_grace_period_seconds: int = 60  # endpoint delay + drain + snapshot flush
    # A leaving serving pod is out of the Service's endpoints this long before it gets
    # SIGTERM (relabel, then delete; a preStop sleep for evictions): endpoint propagation.
    endpoint_delay_seconds: int = 5


@dataclass(frozen=True)
class RouterSpec:
    """spec.router: the `preheat router` pods in front of the engines (docs/router.md)."""
    enabled: bool = True
    replicas: int = 2
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServiceSpec:
    model: ModelSource
    engine: EngineSpec
    replicas: int = 1
    warm_pool_size: int = 0
    warmup_templates: str | None = None  # ConfigMap name
    snapshot: SnapshotSpec = SnapshotSpec()
    autoscaling: AutoscalingSpec | None = None
    readiness: ReadinessSpec = ReadinessSpec()
    failover: FailoverSpec = FailoverSpec()
    rollout: RolloutSpec = RolloutSpec()
    disruption_budget: DisruptionBudgetSpec = DisruptionBudgetSpec()
    router: RouterSpec = RouterSpec()

    @property
    def needs_peer_secret(self) -> bool:
        """Engines call each other's /admin/*: for snapshots, or for model files."""
        return self.snapshot.enabled or self.model.peer_fetch


_PERCENT = re.compile(r"^(0|[1-9][0-9]*)%$")


def resolve_int_or_percent(value: IntOrPercent, total: int, *, round_up: bool) -> int:
    """An IntOrString as a Deployment reads it: an int as is, "N%" of total, rounded."""
    if isinstance(value, int) and not isinstance(value, bool):
        return max(0, value)
    match = _PERCENT.match(str(value))
    if not match:
        raise SpecError("InvalidSpec", f"{value!r} is neither an integer nor a percentage like '25%'")
    exact = int(match.group(1)) * total
    return -(-exact // 100) if round_up else exact // 100


def _int_or_percent(value: Any, what: str) -> IntOrPercent:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _PERCENT.match(value):
        return value
    raise SpecError("InvalidSpec", f"{what} must be a non-negative integer or a percentage like "
                    f"'25%', got {value!r}")


def _nonneg(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SpecError("InvalidSpec", f"{what} must be a non-negative integer, got {value!r}")
    return value


def _parse_autoscaling(auto: Mapping[str, Any]) -> AutoscalingSpec:
    metric = auto.get("metric") or {}
    target = metric.get("targetAverageValue")
    autoscaling = AutoscalingSpec(
        min_replicas=_nonneg(auto.get("minReplicas", 1), "autoscaling.minReplicas"),
        max_replicas=_nonneg(auto.get("maxReplicas", 0), "autoscaling.maxReplicas"),
        metric=MetricSpec(
            type=metric.get("type", ""),
            name=metric.get("name", ""),
            target_average_utilization=metric.get("targetAverageUtilization"),
            target_average_value=None if target is None else str(target),
        ),
        scale_up_stabilization_seconds=_nonneg(
            auto.get("scaleUpStabilizationSeconds", 0), "autoscaling.scaleUpStabilizationSeconds"),
        scale_down_stabilization_seconds=_nonneg(
            auto.get("scaleDownStabilizationSeconds", 300),
            "autoscaling.scaleDownStabilizationSeconds"),
    )
    if autoscaling.min_replicas > autoscaling.max_replicas:
        raise SpecError("InvalidAutoscaling", "autoscaling.minReplicas must be <= maxReplicas")
    if autoscaling.max_replicas < 1:
        raise SpecError("InvalidAutoscaling", "autoscaling.maxReplicas must be >= 1")
    m = autoscaling.metric
    if m.type not in METRIC_TYPES or not m.name:
        raise SpecError("InvalidAutoscaling",
                        f"autoscaling.metric needs a type ({'|'.join(METRIC_TYPES)}) and a name")
    if m.type == "Resource" and m.target_average_utilization is None:
        raise SpecError("InvalidAutoscaling", "a Resource metric needs targetAverageUtilization")
    if m.type != "Resource":
        if m.target_average_value is None:
            raise SpecError("InvalidAutoscaling", f"a {m.type} metric needs targetAverageValue")
        try:
            value = parse_quantity(m.target_average_value)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise SpecError("InvalidAutoscaling",
                            f"targetAverageValue {m.target_average_value!r} must be a positive "
                            "quantity, e.g. 4, \"0.8\" or 800m")
    if m.type == "Engine" and m.name not in ENGINE_METRICS:
        raise SpecError("InvalidAutoscaling",
                        f"an Engine metric is one of {', '.join(ENGINE_METRICS)}; got {m.name!r}")
    return autoscaling


GPU_RESOURCE = "nvidia.com/gpu"


def _tensor_parallel_size(engine: Mapping[str, Any]) -> int:
    """spec.engine.tensorParallelSize, checked against GPUs the user asked for themselves:
    a pod with N ranks needs exactly N GPUs (the operator requests them)."""
    size = engine.get("tensorParallelSize", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise SpecError("InvalidSpec", f"engine.tensorParallelSize must be a positive integer, got {size!r}")
    if size > 1:
        resources = engine.get("resources") or {}
        for kind in ("limits", "requests"):
            given = (resources.get(kind) or {}).get(GPU_RESOURCE)
            if given is not None and str(given) != str(size):
                raise SpecError("InvalidSpec", f"engine.resources.{kind}[{GPU_RESOURCE!r}] is {given} but "
                                f"engine.tensorParallelSize is {size}: each rank needs its own GPU")  # fmt: skip
    return size


def _secret_key_ref(value: Any, what: str) -> SecretKeyRef | None:
    if value is None:
        return None
    name = value.get("name") if isinstance(value, Mapping) else None
    key = value.get("key") if isinstance(value, Mapping) else None
    if not isinstance(name, str) or not name or not isinstance(key, str) or not key:
        raise SpecError("InvalidSpec", f"{what} needs a Secret name and a key, got {value!r}")
    return SecretKeyRef(name, key)


def _parse_model(model: Mapping[str, Any]) -> ModelSource:
    """spec.model: one of path, pvc or uri (none: the engine's embedded default model)."""
    chosen = [k for k in ("path", "pvc", "uri") if model.get(k)]
    if len(chosen) > 1:
        raise SpecError("InvalidModelSource", "model: set at most one of path, pvc or uri")
    pvc = model.get("pvc") or {}
    uri, uri_claim, uri_path = _model_uri(model.get("uri"))
    credentials = model.get("credentialsSecretRef") or {}
    return ModelSource(
        path=model.get("path") or pvc.get("path") or uri_path,
        pvc=pvc.get("claimName") or uri_claim,
        uri=uri,
        served_name=model.get("servedName"),
        credentials_secret=credentials.get("name") or None,
        cache=_model_cache(model.get("cache") or {}),
    )


def _parse_engine(engine: Mapping[str, Any]) -> EngineSpec:
    """spec.engine: the engine container and the pod settings around it."""
    if not engine.get("image"):
        raise SpecError("InvalidSpec", "engine.image is required")
    spread = engine.get("topologySpreadConstraints")
    return EngineSpec(
        image=engine["image"],
        image_pull_policy=engine.get("imagePullPolicy"),
        args=tuple(engine.get("args") or ()),
        env=tuple(engine.get("env") or ()),
        resources=dict(engine.get("resources") or {}),
        node_selector=dict(engine.get("nodeSelector") or {}),
        tolerations=tuple(engine.get("tolerations") or ()),
        tensor_parallel_size=_tensor_parallel_size(engine),
        image_pull_secrets=tuple(s["name"] for s in engine.get("imagePullSecrets") or ()
                                 if s.get("name")),
        service_account_name=engine.get("serviceAccountName") or None,
        automount_service_account_token=bool(engine.get("automountServiceAccountToken", False)),
        affinity=dict(engine.get("affinity") or {}),
        topology_spread_constraints=None if spread is None else tuple(spread),
        priority_class_name=engine.get("priorityClassName") or None,
        runtime_class_name=engine.get("runtimeClassName") or None,
        api_key_secret=_secret_key_ref(engine.get("apiKeySecretRef"), "engine.apiKeySecretRef"),
    )


def _parse_snapshot(snap: Mapping[str, Any]) -> SnapshotSpec:
    """spec.snapshot: where the hot-prefix snapshots live and how often they are written."""
    storage = snap.get("storage", STORAGE_POD_LOCAL)
    if storage not in (STORAGE_POD_LOCAL, STORAGE_SHARED):
        raise SpecError("InvalidSpec", f"snapshot.storage must be {STORAGE_POD_LOCAL} or "
                        f"{STORAGE_SHARED}, got {storage!r}")
    return SnapshotSpec(
        enabled=bool(snap.get("enabled", True)),
        storage=storage,
        peer_fetch=bool(snap.get("peerFetch", True)),
        storage_class=snap.get("storageClassName"),
        size=str(snap.get("size", "10Gi")),
        access_mode=snap.get("accessMode", "ReadWriteMany"),
        interval_seconds=_nonneg(snap.get("intervalSeconds", 300), "snapshot.intervalSeconds"),
        cache_weights=bool(snap.get("cacheWeights", True)),
        retain_on_delete=bool(snap.get("retainOnDelete", False)),
    )


def _parse_readiness(ready: Mapping[str, Any]) -> ReadinessSpec:
    """spec.readiness: probes and the leaving pod's grace period."""
    grace = _nonneg(ready.get("terminationGracePeriodSeconds", 60),
                    "readiness.terminationGracePeriodSeconds")
    endpoint_delay = _nonneg(ready.get("endpointDelaySeconds", 5), "readiness.endpointDelaySeconds")
    if endpoint_delay >= grace:
        raise SpecError("InvalidSpec", "readiness.endpointDelaySeconds must be below "
                        "terminationGracePeriodSeconds (the grace period also covers the "
                        "drain and the snapshot)")
    return ReadinessSpec(
        startup_timeout_seconds=ready.get("startupTimeoutSeconds", 1800),
        period_seconds=ready.get("periodSeconds", 5),
        failure_threshold=ready.get("failureThreshold", 3),
        termination_grace_period_seconds=grace,
        endpoint_delay_seconds=endpoint_delay,
    )


def _parse_failover(failover: Mapping[str, Any]) -> FailoverSpec:
    return FailoverSpec(
        unready_seconds=_nonneg(failover.get("unreadySeconds", 5), "failover.unreadySeconds"))


def _parse_rollout(roll: Mapping[str, Any]) -> RolloutSpec:
    return RolloutSpec(
        max_surge=_int_or_percent(roll.get("maxSurge", "25%"), "rollout.maxSurge"),
        max_unavailable=_int_or_percent(roll.get("maxUnavailable", 0), "rollout.maxUnavailable"),
        progress_deadline_seconds=_nonneg(roll.get("progressDeadlineSeconds", 600),
                                          "rollout.progressDeadlineSeconds"),
    )


def _parse_disruption_budget(pdb: Mapping[str, Any]) -> DisruptionBudgetSpec:
    return DisruptionBudgetSpec(
        enabled=bool(pdb.get("enabled", True)),
        max_unavailable=_int_or_percent(pdb.get("maxUnavailable", 1),
                                        "disruptionBudget.maxUnavailable"))


def _parse_router(router: Mapping[str, Any]) -> RouterSpec:
    replicas = _nonneg(router.get("replicas", 2), "router.replicas")
    if replicas < 1:
        raise SpecError("InvalidSpec", "router.replicas must be at least 1 (or router.enabled: false)")
    return RouterSpec(enabled=bool(router.get("enabled", True)), replicas=replicas,
                      resources=dict(router.get("resources") or {}))


def _check_rollout_can_progress(out: ServiceSpec) -> None:
    """A Deployment refuses this too: with no surge, no unavailability and no warm pod to
    make room with, a rollout could never start a new pod."""
    some = max(1, out.replicas)
    if out.warm_pool_size == 0 and out.rollout.surge(some) == 0 and out.rollout.unavailable(some) == 0:
        raise SpecError("InvalidRollout", "rollout.maxSurge and rollout.maxUnavailable are both "
                        "0 and there is no warm pool: a rollout could never make progress")


def parse_spec(spec: Mapping[str, Any]) -> ServiceSpec:
    """The whole spec, one parser per section; a section left out parses as {} (its defaults).
    Checks across sections come last."""
    def section(key: str) -> Mapping[str, Any]:
        return spec.get(key) or {}

    auto = spec.get("autoscaling")
    out = ServiceSpec(
        model=_parse_model(section("model")),
        engine=_parse_engine(section("engine")),
        replicas=_nonneg(spec.get("replicas", 1), "replicas"),
        warm_pool_size=_nonneg(section("warmPool").get("size", 0), "warmPool.size"),
        warmup_templates=section("warmupTemplates").get("configMap"),
        snapshot=_parse_snapshot(section("snapshot")),
        autoscaling=_parse_autoscaling(auto) if auto else None,
        readiness=_parse_readiness(section("readiness")),
        failover=_parse_failover(section("failover")),
        rollout=_parse_rollout(section("rollout")),
        disruption_budget=_parse_disruption_budget(section("disruptionBudget")),
        router=_parse_router(section("router")),
    )
    _check_rollout_can_progress(out)
    return out
