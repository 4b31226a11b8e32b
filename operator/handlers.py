"""kopf registrations: thin shells that wake the per-service reconcile loop.

One daemon per InferenceService runs reconcile() in a loop — on every change of the
resource or of one of its pods (a nudge), and at least every resync_seconds — so one
service is never reconciled twice at once and a missed event is healed by the resync.
A second daemon, only for services with `autoscaling.metric.type: Engine`, runs the
built-in autoscaler every autoscale_interval seconds; kopf starts and stops it as the
spec enters and leaves that mode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf

from preheat.operator.config import OperatorConfig
from preheat.operator.kube import ApiError, Kube
from preheat.operator.reconcile import reconcile
from preheat.operator.resources import GROUP, LABEL_SERVICE, PLURAL, VERSION
from preheat.operator.scale_reconcile import AutoscalerMemory, autoscale


@dataclass
class _Shared:
    credentials: kopf.ConnectionInfo | None = None
    kube: Kube | None = None
    http: httpx.AsyncClient | None = None  # scrapes engine /metrics (Engine autoscaling)
    nudges: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)


@dataclass
class OperatorState:
    """Passed to kopf as `memo`. kopf gives each resource a shallow copy of it, so all
    mutable state lives in one shared object that every copy points to."""
    config: OperatorConfig = field(default_factory=OperatorConfig)
    shared: _Shared = field(default_factory=_Shared)

    def client(self) -> Kube:
        if self.shared.kube is None:
            if self.shared.credentials is None:
                raise RuntimeError("not logged in yet")
            self.shared.kube = Kube(self.shared.credentials)
        return self.shared.kube

    def http(self) -> httpx.AsyncClient:
        if self.shared.http is None:
            # trust_env off: a proxy set for the API server must not sit between us and pods.
            self.shared.http = httpx.AsyncClient(trust_env=False,
                                                 timeout=self.config.metrics_timeout)
        return self.shared.http

    def forget_client(self) -> None:
        self.shared.kube = None  # rebuilt with the latest credentials on next use

    def nudge(self, namespace: str | None, name: str | None) -> None:
        event = self.shared.nudges.get((namespace or "", name or ""))
        if event is not None:
            event.set()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: OperatorState, **_: Any) -> None:
    settings.peering.lifetime = memo.config.peering_lifetime
    # Our own finalizer and annotation prefix instead of kopf's defaults.
    settings.persistence.finalizer = "preheat.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="preheat.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="preheat.dev")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300


@kopf.on.login()
def login(memo: OperatorState, **kwargs: Any) -> kopf.ConnectionInfo | None:
    # In a pod: the service account; elsewhere: the kubeconfig. Our client shares them.
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None and info != memo.shared.credentials:
        memo.shared.credentials = info
        memo.forget_client()
    return info


@kopf.on.cleanup()
async def close(memo: OperatorState, **_: Any) -> None:
    if memo.shared.kube is not None:
        await memo.shared.kube.close()
    if memo.shared.http is not None:
        await memo.shared.http.aclose()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def service_changed(memo: OperatorState, namespace: str, name: str, **_: Any) -> None:
    memo.nudge(namespace, name)  # spec edits, /scale writes, deletion


@kopf.on.event("v1", "pods", labels={LABEL_SERVICE: kopf.PRESENT})
async def pod_changed(memo: OperatorState, namespace: str, labels: Any, **_: Any) -> None:
    memo.nudge(namespace, labels.get(LABEL_SERVICE))  # readiness flips, deaths, relabels


def _post_event(body: Any, type: str, reason: str, message: str) -> None:
    kopf.event(dict(body), type=type, reason=reason, message=message)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def reconcile_loop(memo: OperatorState, stopped: kopf.DaemonStopped, namespace: str,
                         name: str, logger: Any, **_: Any) -> None:
    key = (namespace, name)
    wake = memo.shared.nudges.setdefault(key, asyncio.Event())
    failures = 0
    try:
        while not stopped:
            wake.clear()
            try:
                outcome = await reconcile(memo.client(), namespace, name, _post_event, logger,
                                          network=memo.config.network,
                                          router_image=memo.config.router_image,
                                          router_service_account=memo.config.router_service_account)
                failures = 0
                delay = memo.config.resync_seconds
                if outcome is not None and outcome.recheck_at is not None:
                    # A failover grace, an endpoint delay or a back-off ends then: be there.
                    delay = max(0.05, min(delay, outcome.recheck_at - time.time()))
            except (ApiError, OSError, RuntimeError, asyncio.TimeoutError) as e:
                # Never a crash loop: log, back off, try again.
                failures += 1
                if isinstance(e, ApiError) and e.status == 401:
                    memo.forget_client()
                delay = min(memo.config.resync_seconds, 0.5 * 2 ** failures)
                logger.warning(f"reconcile failed ({failures}x), retrying in {delay:.1f}s: {e}")
            await _sleep_until_nudged(wake, stopped, delay)
    finally:
        memo.shared.nudges.pop(key, None)


async def _sleep_until_nudged(wake: asyncio.Event, stopped: kopf.DaemonStopped,
                              delay: float) -> None:
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _round_log(path: str):
    def record(entry: dict[str, Any]) -> None:
        with open(path, "a") as f:  # one short line per pass: appends stay whole
            f.write(json.dumps(entry) + "\n")
    return record


def _engine_mode(spec: Any, **_: Any) -> bool:
    metric = ((spec or {}).get("autoscaling") or {}).get("metric") or {}
    return metric.get("type") == "Engine"


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10, when=_engine_mode)
async def autoscale_loop(memo: OperatorState, stopped: kopf.DaemonStopped, namespace: str,
                         name: str, logger: Any, **_: Any) -> None:
    memory = AutoscalerMemory()
    never = asyncio.Event()
    record = _round_log(memo.config.autoscale_log) if memo.config.autoscale_log else None
    while not stopped:
        try:
            await autoscale(memo.client(), memo.http(), namespace, name, memory, _post_event,
                            scrape_timeout=memo.config.metrics_timeout, record=record,
                            logger=logger)
        except (ApiError, OSError, RuntimeError, asyncio.TimeoutError) as e:
            if isinstance(e, ApiError) and e.status == 401:
                memo.forget_client()
            logger.warning(f"autoscaling pass failed, next in "
                           f"{memo.config.autoscale_interval:.0f}s: {e}")
        await _sleep_until_nudged(never, stopped, memo.config.autoscale_interval)
