"""The router's part of a reconcile pass: its pods, the `<name>-engines` Service, its
disruption budget. A pure plan (router_plan) and the thin shell that applies it.

Router pods are bare pods like the engines (the operator owns their lifecycle, no
Deployment controller needed): `spec.router.replicas` of the current template; a pod of an
older template is deleted only once that many current ones are Ready (a surge, so the
client Service always has a Ready router while routers roll); dead ones are replaced.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preheat.operator import render, render_router
from preheat.operator.kube import Kube
from preheat.operator.ownership import Conflict, Ownership, conflict, ownership
from preheat.operator.pods import PodView, view
from preheat.operator.resources import PDBS, PODS, SERVICES
from preheat.operator.spec import ServiceSpec


def router_ready(p: PodView) -> bool:
    return p.ready_condition == "True" and not p.terminating and not p.dead


@dataclass(frozen=True)
class RouterPlan:
    create: int
    delete: tuple[str, ...]


def router_plan(pods: list[PodView], want: int, template_hash: str) -> RouterPlan:
    """Pure: which router pods to create and delete (want 0: delete them all)."""
    dead = [p.name for p in pods if p.dead and not p.terminating]
    live = [p for p in pods if not p.dead and not p.terminating]
    current = sorted((p for p in live if p.template_hash == template_hash),
                     key=lambda p: (router_ready(p), p.created), reverse=True)
    outdated = [p.name for p in live if p.template_hash != template_hash]
    delete = list(dead)
    if want == 0:
        return RouterPlan(0, tuple(delete + [p.name for p in live]))
    extra = current[want:]  # the newest unready ones go first
    delete += [p.name for p in extra]
    current = current[:want]
    if sum(router_ready(p) for p in current) >= want:
        delete += outdated
    return RouterPlan(max(0, want - len(current)), tuple(delete))


@dataclass(frozen=True)
class RouterState:
    replicas: int  # live router pods
    ready: int

    def status(self, want: int, selects: str) -> dict[str, Any]:
        return {"replicas": self.replicas, "readyReplicas": self.ready,
                "summary": f"{self.ready}/{want}", "serviceSelects": selects}


async def ensure_engines_service(kube: Kube, name: str, ns: str, uid: str) -> Conflict | None:
    want = render_router.engines_service(name, ns, uid)
    svc_name = render_router.engines_service_name(name)
    have = await kube.get(SERVICES, ns, svc_name)
    owner = ownership(have, name, uid)
    if owner is Ownership.ABSENT:
        await kube.create(SERVICES, ns, want)
    elif owner is Ownership.FOREIGN:
        return conflict("Service", have, name)
    elif (have.get("spec") or {}).get("selector") != want["spec"]["selector"]:
        await kube.patch(SERVICES, ns, svc_name, {"spec": {"selector": want["spec"]["selector"]}})
    return None


async def _ensure_router_budget(kube: Kube, name: str, ns: str, uid: str,
                                enabled: bool) -> Conflict | None:
    pdb_name = render_router.router_pdb_name(name)
    have = await kube.get(PDBS, ns, pdb_name)
    owner = ownership(have, name, uid)
    if not enabled:
        if owner is Ownership.OURS:
            await kube.delete(PDBS, ns, pdb_name)
    elif owner is Ownership.ABSENT:
        await kube.create(PDBS, ns, render_router.router_disruption_budget(name, ns, uid))
    elif owner is Ownership.FOREIGN:
        return conflict("PodDisruptionBudget", have, name)
    return None


async def reconcile_router(kube: Kube, body: Mapping[str, Any], spec: ServiceSpec,
                           pods: list[dict[str, Any]], image: str, events: Any,
                           allow_create: bool = True,
                           service_account: str = render_router.ROUTER_SERVICE_ACCOUNT,
                           ) -> tuple[RouterState, list[Conflict]]:
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
    conflicts = [c for c in (await ensure_engines_service(kube, name, ns, uid),
                             await _ensure_router_budget(kube, name, ns, uid, spec.router.enabled))
                 if c is not None]
    views = [view(p) for p in pods]
    want = spec.router.replicas if spec.router.enabled else 0
    template_hash = render.template_hash(
        render_router.router_pod_spec(name, spec, image, service_account))
    plan = router_plan(views, want, template_hash)
    for pod_name in plan.delete:
        await kube.delete(PODS, ns, pod_name)
        events(body, "Normal", "RouterDeleted", f"deleted router pod {pod_name}")
    for _ in range(plan.create if allow_create else 0):
        pod_name = render_router.router_pod_name(name, secrets.token_hex(3))
        await kube.create(PODS, ns, render_router.router_pod(name, ns, uid, spec, pod_name, image,
                                                             service_account))
        events(body, "Normal", "RouterCreated", f"created router pod {pod_name}")
    live = [p for p in views if not p.dead and not p.terminating and p.name not in plan.delete]
    return RouterState(len(live) + (plan.create if allow_create else 0),
                       sum(router_ready(p) for p in live)), conflicts
