"""A local-path volume provisioner (TEST HARNESS): binds each PersistentVolumeClaim of a
namespace to a directory on this machine, the one the local kubelet mounts for that claim
(podmap.claim_dir). Like a local-path provisioner it creates the directory and marks the
claim Bound; there is no PersistentVolume object.

`prepopulate` names entries every new claim directory starts with, as links to directories
on this machine — what a volume created from a pre-filled source (a VolumeSnapshot, a
cloned PVC) would hold. The local cluster uses it for the converted-weight cache, so the
GGUF is converted once per machine rather than once per test run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from e2e.podmap import claim_dir
from e2e.watch import watch


class LocalProvisioner:
    def __init__(self, api_url: str, namespace: str, root: Path, prepopulate: dict[str, Path] | None = None) -> None:
        self.namespace = namespace
        self.root = root
        self.prepopulate = dict(prepopulate or {})
        self._client = httpx.AsyncClient(base_url=api_url.rstrip("/"), timeout=10)
        self._task: asyncio.Task | None = None

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
        directory = claim_dir(self.root, self.namespace, name)
        directory.mkdir(parents=True, exist_ok=True)
        for entry, source in self.prepopulate.items():
            source.mkdir(parents=True, exist_ok=True)
            if not ((directory / entry).exists() or (directory / entry).is_symlink()):
                (directory / entry).symlink_to(source, target_is_directory=True)
        spec = claim.get("spec") or {}
        status = {"phase": "Bound", "accessModes": spec.get("accessModes") or [],
                  "capacity": (spec.get("resources") or {}).get("requests") or {}}
        await self._client.patch(
            f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{name}/status",
            json={"status": status}, headers={"Content-Type": "application/merge-patch+json"})
