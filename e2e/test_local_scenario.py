"""The local end-to-end scenario (issue 7): one InferenceService of the embedded model on
the API emulator, the real operator, and engines run by the local kubelet test harness."""

from __future__ import annotations

import json

import pytest

from e2e import scenario
from e2e.local_cluster import local_cluster
from e2e.manifests import WARMUP_TEMPLATE
from e2e.podmap import claim_dir
from e2e.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SERVICE = "chat"


async def test_inference_service_end_to_end_on_one_machine(tmp_path):
    t = scenario.Timings()
    async with local_cluster(tmp_path / "node") as cluster:
        try:
            await scenario.apply(cluster, SERVICE, t=t)

            # Each pod's volumes are local directories: the template ConfigMap's files in a
            # per-pod directory, the snapshot claim one directory shared by every pod.
            shared = claim_dir(cluster.root, cluster.namespace, f"{SERVICE}-snapshots")
            runtimes = list(cluster.kubelet.pods.values())
            assert len(runtimes) == 2
            for rt in runtimes:
                env = rt.plan.env
                assert env["PREHEAT_SNAPSHOT_DIR"] == str(shared)
                # Converted weights live on the claim as well, shared by every pod.
                assert env["PREHEAT_WEIGHT_CACHE_DIR"] == str(shared / "weights")
                templates = rt.plan.mounts["/etc/preheat/warmup-templates"]
                assert env["PREHEAT_WARMUP_TEMPLATES"] == str(templates)
                assert (templates / "e2e-support.yaml").read_text() == WARMUP_TEMPLATE
                # Each pod on its own address, on the container port, as on a pod network.
                assert (env["PREHEAT_HOST"], env["PREHEAT_PORT"]) == (rt.ip, "8000")
                assert rt.pod["status"]["podIP"] == rt.ip
            assert len({rt.ip for rt in runtimes}) == 2

            await scenario.chat(cluster, SERVICE, t)
            await scenario.scale_up_by_promotion(cluster, SERVICE, t)
            await scenario.restart_operator_during_eviction(cluster, SERVICE, t)
            await scenario.crash_serving_engine(cluster, SERVICE, t)
            started = cluster.kubelet.all_pids()
            await scenario.delete_everything(cluster, SERVICE, t)

            # ... and every engine process with them, each drained on SIGTERM (exit 0).
            async def no_engine_left():
                return not cluster.kubelet.pods and not cluster.kubelet.live_pids()
            await eventually(no_engine_left, 60, interval=0.1)
            finished = cluster.kubelet.finished
            assert {pid for rt in finished for pid in rt.pids} == set(started)
            assert all(rt.exit_codes[-1] == 0 for rt in finished), \
                [(rt.name, rt.exit_codes) for rt in finished]
            assert any(137 in rt.exit_codes for rt in finished)  # the crashed engine
            # The engines persisted their hot prefixes into the one shared snapshot volume
            # (DESIGN.md: snapshot on SIGTERM), where the next pod to start finds them.
            assert list(shared.glob("*/manifest.json")), sorted(shared.iterdir())
            # Every pod loaded the converted weights from the claim (one conversion at most).
            assert list((shared / "weights").glob("*/DONE")), sorted(shared.iterdir())
        except BaseException:
            print(cluster.diagnostics())
            raise
        finally:
            print("e2e timings:", json.dumps(t.values, indent=1))
            print("kubelet: stale pod versions ignored:", cluster.kubelet.stale_versions)
