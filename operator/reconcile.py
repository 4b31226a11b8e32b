"""One reconcile pass for one InferenceService: observe, decide (pure), act, report.

This is the thin, effectful shell around decide.desired_state() and status.compute().
It is safe to run at any time and any number of times: every step compares what exists
with what should, and only writes the difference.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from preheat.operator import engine_facts, model_progress, peer_secret, render, render_router
from preheat.operator.decide import (
    Action,
    CreatePod,
    DeletePod,
    FailoverHistory,
    Plan,
    Relabel,
    Retire,
    SetWarmGate,
    Target,
    plan,
)
from preheat.operator.kube import STRATEGIC, ApiError, Kube
from preheat.operator.network_policy import PolicySettings, network_policies, policy_names
from preheat.operator.ownership import Conflict, Ownership, conflict, ownership
from preheat.operator.pod_config import config_problems
from preheat.operator.pods import PodView, parse_time, view
from preheat.operator.quantity import parse_quantity
from preheat.operator.resources import (
    CONFIGMAPS,
    DRAINING_SINCE,
    HPAS,
    INFERENCE_SERVICES,
    LABEL_ROLE,
    LABEL_SERVICE,
    NETWORK_POLICIES,
    PDBS,
    PODS,
    PVCS,
    ROLE_DRAINING,
    ROLE_ROUTER,
    SECRETS,
    SERVICES,
    WARM_CONDITION,
)
from preheat.operator.router_children import RouterState, reconcile_router
from preheat.operator.snapshot_storage import CONDITION as SNAPSHOT_STORAGE
from preheat.operator.snapshot_storage import EngineFacts
from preheat.operator.spec import ServiceSpec, SpecError, parse_spec
from preheat.operator.status import Observation, compute

# (body, type, reason, message) -> None; kopf.event in the operator, a list in tests.
EventSink = Callable[[Mapping[str, Any], str, str, str], None]

log = logging.getLogger(__name__)

_EVENT_TEXT = {
    "Promoted": "promoted warm pod {pod} to serving",
    "Demoted": "demoted serving pod {pod} into the warm pool",
    "Adopted": "moved pod {pod} with an unknown role into the warm pool",
    "Replaced": "deleted dead pod {pod}; a replacement follows",
    "ScaledDown": "deleted serving pod {pod}: replicas lowered and the warm pool is full",
    "PoolShrunk": "deleted warm pod {pod}: the warm pool is above its size",
    "RolledOut": "deleted outdated pod {pod}: its replacement is warm",
    "Drained": "deleted pod {pod}: out of the Service's endpoints long enough, now draining",
}
_RETIRE_TEXT = {
    "ScaledDown": "took serving pod {pod} out of the Service (replicas lowered); deleted after "
                  "the endpoint delay",
    "RolledOut": "took outdated serving pod {pod} out of the Service: its replacement is warm "
                 "and serving; deleted after the endpoint delay",
}


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    recheck_at: float | None  # epoch seconds: reconcile again by then (a deadline passes)


def _rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now() -> str:
    return _rfc3339(time.time())


def _role(pod: Mapping[str, Any]) -> str:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE, "")


def _owned(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


async def _ensure_service(kube: Kube, name: str, ns: str, uid: str,
                          selector: dict[str, str]) -> Conflict | None:
    want = render.service(name, ns, uid, selector)
    have = await kube.get(SERVICES, ns, name)
    owner = ownership(have, name, uid)
    if owner is Ownership.ABSENT:
        await kube.create(SERVICES, ns, want)
        return None
    if owner is Ownership.FOREIGN:
        return conflict("Service", have, name)
    ports = lambda s: [(p.get("name"), p.get("port"), p.get("targetPort"))  # noqa: E731
                       for p in (s.get("spec") or {}).get("ports") or []]
    if (have.get("spec") or {}).get("selector") != want["spec"]["selector"] or \
            ports(have) != ports(want):
        await kube.patch(SERVICES, ns, name, {"spec": {"selector": want["spec"]["selector"],
                                                       "ports": want["spec"]["ports"]}})
    return None


@dataclass(frozen=True)
class ClaimState:
    phase: str | None  # the shared claim's status.phase; None when none is wanted
    conflict: Conflict | None = None
    claim: dict[str, Any] | None = None  # the claim as read or created


async def _ensure_peer_secret(kube: Kube, name: str, ns: str, uid: str,
                              claim: dict[str, Any] | None) -> None:
    """Creates the service's peer secret once (operator/peer_secret.py); 409: it exists
    (this operator made it on an earlier pass, or it was kept with a retained claim)."""
    want = peer_secret.manifest(name, ns, peer_secret.owner(name, uid, claim))
    try:
        await kube.create(SECRETS, ns, want)
    except ApiError as e:
        if e.status != 409:
            raise


async def _ensure_snapshot_claim(kube: Kube, name: str, ns: str, uid: str,
                                 spec: ServiceSpec) -> ClaimState:
    if not spec.snapshot.shared:
        return ClaimState(None)  # an existing claim is kept: it holds data, owned for cleanup
    return await _ensure_claim(kube, name, ns, uid, render.snapshot_claim(name, ns, uid, spec))


async def _ensure_claim(kube: Kube, name: str, ns: str, uid: str, want: dict[str, Any]) -> ClaimState:
    """Creates the claim, or keeps its owner references as `want` says (a retained claim is
    not garbage-collected with the service)."""
    claim = await kube.get(PVCS, ns, want["metadata"]["name"])
    owner = ownership(claim, name, uid, adopt_retained=True)
    if owner is Ownership.FOREIGN:
        return ClaimState(None, conflict("PersistentVolumeClaim", claim, name))
    if claim is None:
        claim = await kube.create(PVCS, ns, want)
    else:
        wanted = want["metadata"]["ownerReferences"]
        have = (claim.get("metadata") or {}).get("ownerReferences") or []
        if bool(wanted) != any(r.get("uid") == uid for r in have):
            others = [r for r in have if r.get("uid") != uid]
            await kube.patch(PVCS, ns, claim["metadata"]["name"],
                             {"metadata": {"ownerReferences": others + wanted}})
    # A new claim has no status yet.
    return ClaimState((claim.get("status") or {}).get("phase") or "Pending", claim=claim)


async def _ensure_disruption_budget(kube: Kube, name: str, ns: str, uid: str,
                                    spec: ServiceSpec) -> Conflict | None:
    want = render.disruption_budget(name, ns, uid, spec)
    have = await kube.get(PDBS, ns, name)
    owner = ownership(have, name, uid)
    if want is None:
        if owner is Ownership.OURS:
            await kube.delete(PDBS, ns, name)
    elif owner is Ownership.ABSENT:
        await kube.create(PDBS, ns, want)
    elif owner is Ownership.FOREIGN:
        return conflict("PodDisruptionBudget", have, name)
    elif {k: (have.get("spec") or {}).get(k) for k in want["spec"]} != want["spec"]:
        await kube.patch(PDBS, ns, name, {"spec": want["spec"]})
    return None


def _contains(have: Any, want: Any) -> bool:
    """Whether `have` (as the API server returns it) already holds everything in `want`. The
    server adds defaults (an HPA's behavior policies) and canonicalises quantities ("0.8"
    comes back as "800m"), so plain equality would patch on every pass."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_contains(have.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and \
            all(_contains(h, w) for h, w in zip(have, want))
    if isinstance(want, str) and isinstance(have, (str, int, float)) and str(have) != want:
        try:
            return parse_quantity(have) == parse_quantity(want)
        except ValueError:
            return False
    return have == want


async def _ensure_autoscaler(kube: Kube, name: str, ns: str, uid: str,
                             spec: ServiceSpec) -> Conflict | None:
    want = render.autoscaler(name, ns, uid, spec)
    have = await kube.get(HPAS, ns, name)
    owner = ownership(have, name, uid)
    if want is None:
        if owner is Ownership.OURS:
            await kube.delete(HPAS, ns, name)
    elif owner is Ownership.ABSENT:
        await kube.create(HPAS, ns, want)
    elif owner is Ownership.FOREIGN:
        return conflict("HorizontalPodAutoscaler", have, name)
    elif not _contains(have.get("spec"), want["spec"]):
        await kube.patch(HPAS, ns, name, {"spec": want["spec"]})
    return None


async def _ensure_network_policies(kube: Kube, name: str, ns: str, uid: str,
                                   raw_spec: Mapping[str, Any],
                                   settings: PolicySettings | None) -> list[Conflict]:
    """The service's NetworkPolicies (operator/network_policy.py): created, kept in step,
    and deleted when no longer wanted (turned off, or the router policy with the router
    off). A foreign policy of the same name is left alone and reported."""
    if settings is None:
        return []
    wanted = {p["metadata"]["name"]: p for p in network_policies(
        name, ns, render.child_metadata(name, ns, uid), raw_spec, settings)}
    found: list[Conflict] = []
    for policy_name in policy_names(name):
        want = wanted.get(policy_name)
        have = await kube.get(NETWORK_POLICIES, ns, policy_name)
        owner = ownership(have, name, uid)
        if owner is Ownership.FOREIGN:
            if want is not None:
                found.append(conflict("NetworkPolicy", have, name))
        elif want is None:
            if owner is Ownership.OURS:
                await kube.delete(NETWORK_POLICIES, ns, policy_name)
        elif owner is Ownership.ABSENT:
            await kube.create(NETWORK_POLICIES, ns, want)
        elif not _contains(have.get("spec"), want["spec"]):
            await kube.patch(NETWORK_POLICIES, ns, policy_name, {"spec": want["spec"]})
    return found


async def _apply(kube: Kube, body: Mapping[str, Any], spec: ServiceSpec, action: Action,
                 events: EventSink) -> None:
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
    if isinstance(action, CreatePod):
        pod_name = f"{name}-{secrets.token_hex(3)}"
        await kube.create(PODS, ns, render.pod(name, ns, uid, spec, pod_name, action.role))
        events(body, "Normal", "Created", f"created {action.role} pod {pod_name} ({action.reason})")
    elif isinstance(action, Relabel):
        await kube.patch(PODS, ns, action.pod, {"metadata": {"labels": {LABEL_ROLE: action.role}}})
        events(body, "Normal", action.reason, _EVENT_TEXT[action.reason].format(pod=action.pod))
    elif isinstance(action, Retire):
        # Out of the Service's selector now; deleted (SIGTERM: drain, snapshot) once the
        # endpoints have had the endpoint delay to notice (decide.py, rule 1).
        await kube.patch(PODS, ns, action.pod, {"metadata": {
            "labels": {LABEL_ROLE: ROLE_DRAINING}, "annotations": {DRAINING_SINCE: _now()}}})
        events(body, "Normal", "Draining", _RETIRE_TEXT[action.reason].format(pod=action.pod))
    elif isinstance(action, DeletePod):
        await kube.delete(PODS, ns, action.pod)
        if action.reason != "FailedOver":  # a Warning with the whole story follows
            events(body, "Normal", action.reason, _EVENT_TEXT[action.reason].format(pod=action.pod))
    elif isinstance(action, SetWarmGate):
        # Strategic merge: conditions merge by type, so the kubelet's own are left alone.
        condition = {"type": WARM_CONDITION, "status": "True" if action.warm else "False",
                     "lastTransitionTime": _now(),
                     "reason": "EngineWarm" if action.warm else "EngineNotWarm"}
        await kube.patch(PODS, ns, action.pod, {"status": {"conditions": [condition]}},
                         subresource="status", content_type=STRATEGIC)


def _history(status: Mapping[str, Any]) -> FailoverHistory:
    f = status.get("failover") or {}
    count = f.get("count")
    return FailoverHistory(count if isinstance(count, int) else 0, parse_time(f.get("lastTime")))


def _report_failovers(body: Mapping[str, Any], p: Plan, target: Target,
                      previous: Mapping[str, Any], events: EventSink) -> None:
    for failed, promoted, why in p.failovers:
        cover = f"promoted warm pod {promoted}" if promoted else "the pool is refilled"
        cause = "its container died (Crashed)" if why == "Crashed" else \
            f"it could not serve for {target.unready_seconds:g}s or more ({why})"
        events(body, "Warning", "FailedOver", f"pod {failed}: {cause}; {cover}, {failed} is deleted")
    was = any(c.get("type") == "FailoverBackoff" and c.get("status") == "True"
              for c in previous.get("conditions") or [])
    if p.backoff_until is not None and not was:
        events(body, "Warning", "FailoverBackoff",
               f"{p.history.count} failovers in a row: the next one waits until "
               f"{_rfc3339(p.backoff_until)}")


@dataclass(frozen=True)
class ChildSettings:
    """How the children that are not pods are rendered (the operator's flags)."""
    network: PolicySettings | None = None  # None: no NetworkPolicies (tests that ignore them)
    router_image: str | None = None  # None: the engine image, which ships the same `preheat`
    router_service_account: str = render_router.ROUTER_SERVICE_ACCOUNT


@dataclass
class _Pass:
    """One pass over one InferenceService: what was observed, then what acting changed.
    `blocking` stops new pods (a bad spec, a missing ConfigMap or Secret); `conflicts` are
    children whose names are taken (a foreign claim also blocks). Both end up in the
    Degraded condition."""
    kube: Kube
    body: Mapping[str, Any]
    events: EventSink
    logger: logging.Logger | logging.LoggerAdapter
    children: ChildSettings
    spec: ServiceSpec | None
    blocking: list[tuple[str, str]]
    raw_pods: list[dict[str, Any]]
    pods: tuple[PodView, ...] = ()
    routers: list[dict[str, Any]] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    claim: ClaimState = ClaimState(None)
    router_state: RouterState | None = None
    template_hash: str = ""
    planned: Plan | None = None
    target: Target | None = None

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def uid(self) -> str:
        return self.body["metadata"]["uid"]

    @property
    def previous(self) -> Mapping[str, Any]:
        return self.body.get("status") or {}

    @property
    def raw_spec(self) -> Mapping[str, Any]:
        return self.body.get("spec") or {}

    def take_pods(self, raw: list[dict[str, Any]]) -> None:
        """This service's pods: router pods are not engines, so the warm-pool, failover and
        status decisions never see them (router_children.py keeps them)."""
        ours = [p for p in raw if _owned(p, self.uid)]
        self.routers = [p for p in ours if _role(p) == ROLE_ROUTER]
        self.pods = tuple(view(p) for p in ours if _role(p) != ROLE_ROUTER)


async def reconcile(kube: Kube, namespace: str, name: str, events: EventSink,
                    logger: logging.Logger | logging.LoggerAdapter = log,
                    network: PolicySettings | None = None,
                    router_image: str | None = None,
                    router_service_account: str = render_router.ROUTER_SERVICE_ACCOUNT,
                    ) -> Outcome | None:
    """Reconcile once; returns the status written and when to look again (None if the
    resource is gone). `network`: how to render the service's NetworkPolicies (None: the
    operator renders none, e.g. in tests that do not look at them). router_image: the
    router pods' image (default the engine image, which ships the same `preheat`).

    Observe (the resource, its spec, its pods) → decide (decide.plan, pure) → act (the
    plan, the children) → report (status.compute, pure; then the status and Events)."""
    p = await _observe(kube, namespace, name, events, logger,
                       ChildSettings(network, router_image, router_service_account))
    if p is None:
        return None  # owner references cascade the children away
    if p.spec is not None:
        await _prepare(p, p.spec)
        p.planned = _decide(p, p.spec)
        await _act(p, p.spec)
    return await _report(p)


async def _observe(kube: Kube, namespace: str, name: str, events: EventSink,
                   logger: logging.Logger | logging.LoggerAdapter,
                   children: ChildSettings) -> _Pass | None:
    body = await kube.get(INFERENCE_SERVICES, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    spec: ServiceSpec | None = None
    blocking: list[tuple[str, str]] = []
    try:
        spec = parse_spec(body.get("spec") or {})
    except SpecError as e:
        blocking.append((e.reason, e.message))
    uid = body["metadata"]["uid"]
    raw_pods = [p for p in await kube.list(PODS, namespace, {LABEL_SERVICE: name}) if _owned(p, uid)]
    p = _Pass(kube, body, events, logger, children, spec, blocking, raw_pods)
    p.take_pods(raw_pods)
    if spec is not None:
        p.template_hash = render.template_hash(render.pod_spec(name, spec))
    return p


async def _prepare(p: _Pass, spec: ServiceSpec) -> None:
    """What must exist or be known before pods are planned: the claims (first, always: a
    pod made this pass must not mount a foreign one), the first pods' children (their peer
    URL and peer-secret volume), and the inputs whose absence stops new pods."""
    p.claim = await _ensure_snapshot_claim(p.kube, p.name, p.namespace, p.uid, spec)
    if p.claim.conflict is not None:
        p.conflicts.append(p.claim.conflict)
    cache_claim = render.model_cache_claim(p.name, p.namespace, p.uid, spec)
    if cache_claim is not None:
        cached = await _ensure_claim(p.kube, p.name, p.namespace, p.uid, cache_claim)
        if cached.conflict is not None:
            p.conflicts.append(cached.conflict)
    # Once pods exist, acting on them comes first (_act): a failover must not wait for
    # other API calls.
    if not p.pods:
        await _ensure_children(p, spec)
    if spec.warmup_templates and \
            await p.kube.get(CONFIGMAPS, p.namespace, spec.warmup_templates) is None:
        p.blocking.append(("WarmupTemplatesNotFound", f"ConfigMap {spec.warmup_templates!r} "
                           "not found; no new pods until it exists"))
    # A Secret the pods need and cannot have (API key, model credentials, env): the
    # kubelet says so in their status; the operator never reads Secrets itself.
    p.blocking.extend(config_problems(p.raw_pods, p.raw_spec))


def _decide(p: _Pass, spec: ServiceSpec) -> Plan:
    p.target = Target(spec.replicas, spec.warm_pool_size, p.template_hash,
                      allow_create=not p.blocking and not any(c.blocks_pods for c in p.conflicts),
                      max_surge=spec.rollout.surge(spec.replicas),
                      max_unavailable=spec.rollout.unavailable(spec.replicas),
                      unready_seconds=spec.failover.unready_seconds,
                      drain_seconds=spec.readiness.endpoint_delay_seconds)
    return plan(p.target, list(p.pods), time.time(), _history(p.previous))


async def _act(p: _Pass, spec: ServiceSpec) -> None:
    assert p.planned is not None and p.target is not None
    for action in p.planned.actions:
        p.logger.info(f"{action}")
        try:
            await _apply(p.kube, p.body, spec, action, p.events)
        except ApiError as e:
            # A conflict or a vanished pod: the next pass sees the new world and retries.
            p.logger.warning(f"{action} failed: {e}")
    _report_failovers(p.body, p.planned, p.target, p.previous, p.events)
    if p.pods:
        await _ensure_children(p, spec)
    if p.planned.actions:
        p.take_pods(await p.kube.list(PODS, p.namespace, {LABEL_SERVICE: p.name}))


async def _ensure_children(p: _Pass, spec: ServiceSpec) -> None:
    """The peer secret, the routers, the Service, the HPA, the budget, the NetworkPolicies."""
    kube, name, ns, uid = p.kube, p.name, p.namespace, p.uid
    if spec.needs_peer_secret and p.claim.conflict is None:
        await _ensure_peer_secret(kube, name, ns, uid, p.claim.claim)
    p.router_state, found_router = await reconcile_router(
        kube, p.body, spec, p.routers, p.children.router_image or spec.engine.image, p.events,
        allow_create=not p.blocking, service_account=p.children.router_service_account)
    selector = render_router.client_selector(name, spec, p.router_state.ready > 0)
    found = [*found_router, await _ensure_service(kube, name, ns, uid, selector),
             await _ensure_autoscaler(kube, name, ns, uid, spec),
             await _ensure_disruption_budget(kube, name, ns, uid, spec)]
    p.conflicts.extend(c for c in found if c is not None)
    p.conflicts.extend(await _ensure_network_policies(kube, name, ns, uid, p.raw_spec,
                                                      p.children.network))


def _problems(p: _Pass) -> list[tuple[str, str]]:
    return p.blocking + [(c.reason, c.message) for c in p.conflicts]


def _observation(p: _Pass, facts: EngineFacts | None = None) -> Observation:
    spec, planned = p.spec, p.planned
    problems = _problems(p)
    degraded = (problems[0][0], "; ".join(m for _, m in problems)) if problems else None
    return Observation(
        replicas=spec.replicas if spec else int(p.raw_spec.get("replicas") or 0),
        warm_pool=spec.warm_pool_size if spec else 0,
        template_hash=p.template_hash, pods=p.pods,
        snapshot_enabled=bool(spec and spec.snapshot.enabled), snapshot_phase=p.claim.phase,
        degraded=degraded, generation=p.body["metadata"].get("generation"),
        snapshot_shared=bool(spec and spec.snapshot.shared),
        snapshot_access_mode=spec.snapshot.access_mode if spec else "",
        progress_deadline_seconds=spec.rollout.progress_deadline_seconds if spec else 600,
        history=planned.history if planned else _history(p.previous),
        backoff_until=planned.backoff_until if planned else None,
        failing=planned.failing if planned else (),
        snapshot_size=spec.snapshot.size if spec else "0",
        snapshot_cache_weights=bool(spec and spec.snapshot.cache_weights),
        engine_facts=facts,
    )


async def _engine_facts(p: _Pass) -> EngineFacts | None:
    """What an engine of the current template published for the snapshot storage check:
    from status.snapshotStorage when it is this template's, else asked of its pods (only
    with snapshots on: no HTTP otherwise)."""
    if p.spec is None or not p.spec.snapshot.enabled:
        return None
    known = EngineFacts.from_status(p.previous.get("snapshotStorage"), p.template_hash)
    if known is not None:
        return known
    engines = [pod for pod in p.raw_pods if _role(pod) != ROLE_ROUTER]
    if not engine_facts.candidates(engines, p.template_hash):
        return None
    async with httpx.AsyncClient() as client:
        return await engine_facts.read(client, engines, p.template_hash)


async def _model_status(p: _Pass, status: dict[str, Any]) -> float | None:
    """status.model: a hub or S3 model's download progress; returns when to look again
    while a download runs."""
    spec, previous = p.spec, p.previous
    if spec is not None and spec.model.remote:
        raw = [pod for pod in await p.kube.list(PODS, p.namespace, {LABEL_SERVICE: p.name})
               if _owned(pod, p.uid) and _role(pod) != ROLE_ROUTER]  # engines download, routers do not
        async with httpx.AsyncClient() as client:
            status["model"] = {"uri": spec.model.uri, "downloading": await model_progress.downloading(client, raw)}
        if status["model"]["downloading"]:
            return time.time() + model_progress.RECHECK_S
    elif "model" in previous:
        status["model"] = None
    return None


def _router_and_autoscaling_status(p: _Pass, status: dict[str, Any]) -> None:
    spec, previous = p.spec, p.previous
    if spec is not None and spec.router.enabled and p.router_state is not None:
        selects = "router" if p.router_state.ready > 0 else "serving"
        status["router"] = p.router_state.status(spec.router.replicas, selects)
    elif spec is not None and "router" in previous and not spec.router.enabled:
        status["router"] = None
    elif "router" in previous:
        status["router"] = previous["router"]
    engine_mode = bool(spec and spec.autoscaling and spec.autoscaling.engine_mode)
    if "autoscaling" in previous and not engine_mode:
        status["autoscaling"] = None  # the built-in autoscaler's last word no longer applies


async def _report(p: _Pass) -> Outcome:
    """The status (written only when it changed), the Events of what turned bad, and when
    to look again."""
    previous = p.previous
    obs = _observation(p, await _engine_facts(p))
    status = compute(obs, render.selector_string(p.name), previous, _now())
    progress_recheck = await _model_status(p, status)
    _router_and_autoscaling_status(p, status)
    if any(previous.get(k) != v for k, v in status.items()):
        await p.kube.patch(INFERENCE_SERVICES, p.namespace, p.name, {"status": status},
                           subresource="status")
        _report_problems(p.body, previous, _problems(p), p.events)
        _report_transitions(p.body, previous, status, p.events)
    recheck = _recheck_at(p.planned, status, obs)
    if progress_recheck is not None:
        recheck = progress_recheck if recheck is None else min(recheck, progress_recheck)
    return Outcome(status, recheck)


def _report_problems(body: Mapping[str, Any], previous: Mapping[str, Any],
                     problems: list[tuple[str, str]], events: EventSink) -> None:
    """A Warning Event for each problem the previous Degraded condition did not name yet:
    once when it appears, not on every pass."""
    before = _condition(previous, "Degraded")
    known = str(before.get("message", "")) if before.get("status") == "True" else ""
    for reason, message in problems:
        if message not in known:
            events(body, "Warning", reason, message)


def _condition(status: Mapping[str, Any], ctype: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == ctype), {})


def _report_transitions(body: Mapping[str, Any], previous: Mapping[str, Any],
                        status: Mapping[str, Any], events: EventSink) -> None:
    """A Warning Event when a condition turns bad (once, not on every pass)."""
    for ctype, bad_reason in (("Progressing", "ProgressDeadlineExceeded"),
                              ("SnapshotVolumeBound", "ClaimPending"),
                              (SNAPSHOT_STORAGE, "SnapshotStorageTooSmall"),
                              ("ModelUnavailable", "ModelNotFoundOrRefused")):
        new, old = _condition(status, ctype), _condition(previous, ctype)
        if new.get("reason") == bad_reason and old.get("reason") != bad_reason:
            events(body, "Warning", bad_reason, str(new.get("message", "")))


def _recheck_at(planned: Plan | None, status: Mapping[str, Any], obs: Observation) -> float | None:
    times = [planned.recheck_at] if planned and planned.recheck_at is not None else []
    progressing = _condition(status, "Progressing")
    if progressing.get("status") == "True" and progressing.get("reason") != "RolloutComplete":
        since = parse_time(progressing.get("lastUpdateTime"))
        if since is not None:
            times.append(since + obs.progress_deadline_seconds + 1)
    return min(times) if times else None
