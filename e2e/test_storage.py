"""Issue 12, point 3, end to end on the local harness (no engine ever starts here): on
ReadWriteOnce-only storage a ReadWriteMany snapshot claim never binds, its pods stay Pending
as kube-scheduler leaves them, and the InferenceService says why. (The default service,
pod-local snapshots, runs on the same storage in test_local_scenario.py.)"""

from __future__ import annotations

import pytest

from e2e import manifests, scenario
from e2e.local_cluster import local_cluster
from e2e.waiting import eventually
from preheat.operator.resources import INFERENCE_SERVICES, PVCS

pytestmark = [pytest.mark.timeout(120)]


async def test_a_readwritemany_claim_on_readwriteonce_storage_is_a_clear_condition(tmp_path):
    async with local_cluster(tmp_path / "node") as cluster:  # RWO-only, like local-path/EBS
        try:
            body = manifests.inference_service("rwx", warm_pool=0, templates=False, router=False)
            body["spec"]["snapshot"] = {"storage": "SharedVolume", "accessMode": "ReadWriteMany"}
            await cluster.kube.create(INFERENCE_SERVICES, cluster.namespace, body)

            async def reported():
                st = await scenario.status_of(cluster, "rwx")
                conds = {c["type"]: c for c in st.get("conditions") or []}
                snap, ready = conds.get("SnapshotVolumeBound") or {}, conds.get("Ready") or {}
                return (snap.get("reason") == "ClaimPending"
                        and ready.get("reason") == "PodsUnschedulable") and st
            st = await eventually(reported, 60, interval=0.2)
            conds = {c["type"]: c for c in st["conditions"]}
            assert "ReadWriteMany" in conds["SnapshotVolumeBound"]["message"]
            assert "unbound immediate PersistentVolumeClaims" in conds["Ready"]["message"]
            assert st["phase"] == "Pending"
            claim = await cluster.kube.get(PVCS, cluster.namespace, "rwx-snapshots")
            assert (claim.get("status") or {}).get("phase") != "Bound"
            [pod] = await scenario.pods_of(cluster, "rwx")
            scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
            assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
            assert not pod["spec"].get("nodeName") and not cluster.kubelet.pods
        except BaseException:
            print(cluster.diagnostics())
            raise
