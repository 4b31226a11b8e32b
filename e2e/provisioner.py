"""A local-path volume provisioner (TEST HARNESS): binds each PersistentVolumeClaim of a
namespace to a directory on this machine, the one the local kubelet mounts for that claim
(podmap.claim_dir). Like a local-path provisioner it creates the directory and marks the
claim Bound; there is no PersistentVolume object.

`access_modes` are the modes its storage offers. The default is what kind's and k3d's
local-path, EBS and GCE PD offer: ReadWriteOnce(Pod) only. A claim asking for a mode the
storage does not offer (ReadWriteMany there) is never bound: it stays Pending with a
ProvisioningFailed Event, and the scheduler keeps every pod that mounts it Pending —
what a real cluster does. A ReadWriteOnce volume is local to one node: the provisioner
records that node on the claim (NODE_ANNOTATION, standing in for the PersistentVolume's
node affinity) and the scheduler puts every pod that mounts the claim there.

`prepopulate` names entries every new claim directory starts with, as links to directories
on this machine — what a volume created from a pre-filled source (a VolumeSnapshot, a
cloned PVC) would hold. The local cluster uses it for the converted-weight cache, so the
GGUF is converted once per machine rather than once per test run."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from e2e.podmap import claim_dir
from e2e.watch import watch

RWO_ONLY = ("ReadWriteOnce", "ReadWriteOncePod")
ANY_MODE = ("ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany", "ReadOnlyMany")
NODE_ANNOTATION = "e2e.preheat.dev/node"  # the node a node-local volume lives on


class LocalProvisioner:
    def __init__(self, api_url: str, namespace: str, root: Path,
                 prepopulate: dict[str, Path] | None = None,
                 access_modes: Sequence[str] = RWO_ONLY, node: str | None = None) -> None:
        self.namespace = namespace
        self.root = root
        self.prepopulate = dict(prepopulate or {})
        self.access_modes = tuple(access_modes)
        self.node = node  # where node-local (ReadWriteOnce) volumes are created
        self._client = httpx.AsyncClient(base_url=api_url.rstrip("/"), timeout=10)
        self._task: asyncio.Task | None = None
        self._refused: set[str] = set()  # claim uids an Event was posted for

    async def __aenter__(self) -> LocalProvisioner:
        path = f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims"
        self._task = asyncio.create_task(watch(self._client, path, self._on_event))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()

    async def _on_event(self, kind: str, claim: dict[str, Any]) -> None:
        if kind == "DELETED" or (claim.get("status") or {}).get("phase") == "Bound":
            return  # the directory outlives the claim, like a Retain reclaim policy
        name = claim["metadata"]["name"]
        spec = claim.get("spec") or {}
        wanted = list(spec.get("accessModes") or ["ReadWriteOnce"])
        missing = [m for m in wanted if m not in self.access_modes]
        if missing:
            await self._refuse(claim, missing)
            return
        directory = claim_dir(self.root, self.namespace, name)
        directory.mkdir(parents=True, exist_ok=True)
        for entry, source in self.prepopulate.items():
            source.mkdir(parents=True, exist_ok=True)
            if not ((directory / entry).exists() or (directory / entry).is_symlink()):
                (directory / entry).symlink_to(source, target_is_directory=True)
        base = f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{name}"
        merge = {"Content-Type": "application/merge-patch+json"}
        if self.node and not any(m in ("ReadWriteMany", "ReadOnlyMany") for m in wanted):
            await self._client.patch(base, headers=merge, json={
                "metadata": {"annotations": {NODE_ANNOTATION: self.node}}})
        status = {"phase": "Bound", "accessModes": wanted,
                  "capacity": (spec.get("resources") or {}).get("requests") or {}}
        await self._client.patch(f"{base}/status", json={"status": status}, headers=merge)

    async def _refuse(self, claim: dict[str, Any], missing: list[str]) -> None:
        uid = claim["metadata"].get("uid", "")
        if uid in self._refused:
            return
        self._refused.add(uid)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        name = claim["metadata"]["name"]
        await self._client.post(f"/api/v1/namespaces/{self.namespace}/events", json={
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:12]}", "namespace": self.namespace},
            "involvedObject": {"kind": "PersistentVolumeClaim", "name": name,
                               "namespace": self.namespace, "uid": uid},
            "type": "Warning", "reason": "ProvisioningFailed",
            "message": f"this storage only supports {', '.join(self.access_modes)}; the claim "
                       f"asks for {', '.join(missing)} (e2e local provisioner)",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "source": {"component": "e2e-local-provisioner"}})
