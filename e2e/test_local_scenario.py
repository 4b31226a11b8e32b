"""The local end-to-end scenario (issue 7): one InferenceService of the embedded model on
the API emulator, the real operator, and engines run by the local kubelet test harness."""

from __future__ import annotations

import json

import pytest

from e2e import scenario
from e2e.local_cluster import local_cluster
from e2e.manifests import WARMUP_TEMPLATE
from e2e.waiting import eventually
from preheat.operator.resources import NETWORK_POLICIES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SERVICE = "chat"
# The engines require an API key, handed to them from a Secret (spec.engine.apiKeySecretRef):
# everything below (probes, promotion, peer snapshot fetch, draining) works with it set.
API_KEY = "e2e-key-0123"


async def test_inference_service_end_to_end_on_one_machine(tmp_path):
    t = scenario.Timings()
    async with local_cluster(tmp_path / "node") as cluster:
        try:
            await scenario.apply(cluster, SERVICE, t=t, api_key=API_KEY)

            # Each pod's volumes are local directories: the template ConfigMap's files and
            # the (pod-local) snapshot directory per pod; the Service's URL maps to its
            # stand-in (cluster DNS); each engine has its own port.
            everything = list(cluster.kubelet.pods.values())
            runtimes = [rt for rt in everything if "router" not in rt.plan.argv]
            routers = [rt for rt in everything if "router" in rt.plan.argv]
            assert (len(runtimes), len(routers)) == (2, 2)
            # Snapshot peers are the serving engines (headless <name>-engines), never routers.
            service_url = await cluster.service_url(SERVICE + "-engines")
            for rt in routers:
                # API credentials, as a cluster gives them: a token, the API's address.
                env = rt.plan.env
                token = env["PREHEAT_ROUTER_SERVICE_ACCOUNT_DIR"] + "/token"
                assert open(token).read() and env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
                assert env["PREHEAT_ROUTER_SERVICE"] == SERVICE and "PREHEAT_API_KEY" not in env
            for rt in runtimes:
                assert "KUBERNETES_SERVICE_HOST" not in rt.plan.env  # engines get no token
                env = rt.plan.env
                assert env["PREHEAT_SNAPSHOT_DIR"] == str(rt.plan.mounts["/var/lib/preheat/snapshots"])
                assert f"/pods/{rt.uid}/" in env["PREHEAT_SNAPSHOT_DIR"]
                assert env["PREHEAT_SNAPSHOT_PEER_URL"] == service_url
                templates = rt.plan.mounts["/etc/preheat/warmup-templates"]
                assert env["PREHEAT_WARMUP_TEMPLATES"] == str(templates)
                assert (templates / "e2e-support.yaml").read_text() == WARMUP_TEMPLATE
                # Each pod on its own address, on the container port, as on a pod network.
                assert (env["PREHEAT_HOST"], env["PREHEAT_PORT"]) == (rt.ip, "8000")
                # The key reaches the engine from the Secret, never through the pod spec.
                assert env["PREHEAT_API_KEY"] == API_KEY and API_KEY not in repr(rt.pod)
                assert rt.pod["status"]["podIP"] == rt.ip
                # The service's peer secret (made once by the operator, which never reads
                # it back) is a file: what /admin/* asks for and what signs snapshots.
                peer_dir = rt.plan.mounts["/etc/preheat/peer-secret"]
                assert env["PREHEAT_PEER_SECRET_FILE"] == str(peer_dir)
                peer_key = (peer_dir / "current").read_text()
                assert len(peer_key) == 64 and peer_key not in repr(rt.pod) and peer_key != API_KEY
            assert len({rt.ip for rt in runtimes}) == 2
            for policy in ("chat-engines", "chat-router"):  # one pair per InferenceService
                assert await cluster.kube.get(NETWORK_POLICIES, cluster.namespace, policy), policy
            # Spread: the serving and the warm pod run on different nodes.
            assert len({rt.node for rt in runtimes}) == 2

            await scenario.chat(cluster, SERVICE, t, api_key=API_KEY)
            await scenario.chat_through_service(cluster, SERVICE, t, api_key=API_KEY)
            await scenario.scale_up_by_promotion(cluster, SERVICE, t)
            await scenario.restart_operator_during_eviction(cluster, SERVICE, t)
            # A crashed engine covered by the pool: e2e/test_chaos.py (under traffic).
            started = cluster.kubelet.all_pids()
            await scenario.delete_everything(cluster, SERVICE, t)

            # ... and every engine process with them, each drained on SIGTERM (exit 0).
            async def no_engine_left():
                return not cluster.kubelet.pods and not cluster.kubelet.live_pids()
            await eventually(no_engine_left, 60, interval=0.1)
            finished = cluster.kubelet.finished
            assert {pid for rt in finished for pid in rt.pids} == set(started)
            # The evicted engine was killed (hard eviction: 137); every other one (and each
            # router) drained on SIGTERM and exited 0.
            codes = sorted(rt.exit_codes[-1] for rt in finished)
            assert codes.count(137) == 1 and set(codes) <= {0, 137}, \
                [(rt.name, rt.exit_codes) for rt in finished]
            # Each engine persisted its hot prefixes into its own snapshot directory (DESIGN.md:
            # snapshot on SIGTERM), and every pod after the first fetched one from a serving
            # peer through <name>-engines before it turned ready (sending the peer secret: the
            # peer route answers nothing else, the clients' API key least of all), and
            # every snapshot carries its HMAC.
            own_dirs = [rt.plan.mounts["/var/lib/preheat/snapshots"] for rt in finished
                        if rt.plan and "/var/lib/preheat/snapshots" in rt.plan.mounts]  # engines
            assert any(list(d.glob("*/manifest.json")) for d in own_dirs), own_dirs
            assert all((m.parent / "manifest.hmac").exists() for d in own_dirs
                       for m in d.glob("*/manifest.json"))
            logs = "".join(p.read_text(errors="replace") for rt in finished for p in rt.logs)
            assert "snapshot: fetched" in logs
        except BaseException:
            print(cluster.diagnostics())
            raise
        finally:
            print("e2e timings:", json.dumps(t.values, indent=1))
            print("kubelet: stale pod versions ignored:", cluster.kubelet.stale_versions)
