"""An InferenceService's spec as a typed value, with the same defaults as the CRD schema.

The API server applies the schema's defaults, but the operator must not depend on that
(older objects, tests, a CRD installed without defaults), so parsing defaults again here.
Anything the schema cannot express is checked here and raised as SpecError, which the
reconciler reports as a Degraded condition instead of crashing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from preheat.operator.autoscale import ENGINE_METRICS
from preheat.operator.quantity import parse_quantity

METRIC_TYPES = ("Engine", "Pods", "External", "Resource")

class SpecError(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ModelSource:
    path: str | None = None  # a path inside the image, or inside the PVC when pvc is set
    pvc: str | None = None  # claim name holding the weights (mounted read-only)
    uri: str | None = None  # handed to the engine verbatim
    served_name: str | None = None


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


@dataclass(frozen=True)
class SnapshotSpec:
    enabled: bool = True
    storage_class: str | None = None
    size: str = "10Gi"
    access_mode: str = "ReadWriteMany"
    interval_seconds: int = 300
    cache_weights: bool = True  # keep converted GGUF weights on this volume too


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
    termination_grace_period_seconds: int = 60  # drain + snapshot flush


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


def parse_spec(spec: Mapping[str, Any]) -> ServiceSpec:
    model = spec.get("model") or {}
    chosen = [k for k in ("path", "pvc", "uri") if model.get(k)]
    if len(chosen) > 1:  # none: the engine's embedded default model
        raise SpecError("InvalidModelSource", "model: set at most one of path, pvc or uri")
    pvc = model.get("pvc") or {}
    engine = spec.get("engine") or {}
    if not engine.get("image"):
        raise SpecError("InvalidSpec", "engine.image is required")
    snap = spec.get("snapshot") or {}
    ready = spec.get("readiness") or {}
    auto = spec.get("autoscaling")
    autoscaling = None
    if auto:
        autoscaling = _parse_autoscaling(auto)
    templates = spec.get("warmupTemplates") or {}
    return ServiceSpec(
        model=ModelSource(
            path=model.get("path") or pvc.get("path"),
            pvc=pvc.get("claimName"),
            uri=model.get("uri"),
            served_name=model.get("servedName"),
        ),
        engine=EngineSpec(
            image=engine["image"],
            image_pull_policy=engine.get("imagePullPolicy"),
            args=tuple(engine.get("args") or ()),
            env=tuple(engine.get("env") or ()),
            resources=dict(engine.get("resources") or {}),
            node_selector=dict(engine.get("nodeSelector") or {}),
            tolerations=tuple(engine.get("tolerations") or ()),
            tensor_parallel_size=_tensor_parallel_size(engine),
        ),
        replicas=_nonneg(spec.get("replicas", 1), "replicas"),
        warm_pool_size=_nonneg((spec.get("warmPool") or {}).get("size", 0), "warmPool.size"),
        warmup_templates=templates.get("configMap"),
        snapshot=SnapshotSpec(
            enabled=bool(snap.get("enabled", True)),
            storage_class=snap.get("storageClassName"),
            size=str(snap.get("size", "10Gi")),
            access_mode=snap.get("accessMode", "ReadWriteMany"),
            interval_seconds=_nonneg(snap.get("intervalSeconds", 300), "snapshot.intervalSeconds"),
            cache_weights=bool(snap.get("cacheWeights", True)),
        ),
        autoscaling=autoscaling,
        readiness=ReadinessSpec(
            startup_timeout_seconds=ready.get("startupTimeoutSeconds", 1800),
            period_seconds=ready.get("periodSeconds", 5),
            failure_threshold=ready.get("failureThreshold", 3),
            termination_grace_period_seconds=ready.get("terminationGracePeriodSeconds", 60),
        ),
    )
