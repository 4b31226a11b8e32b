"""The harness's stand-ins for a scheduler, a local-path provisioner, nodes and a Service,
against the API emulator, with a stand-in container (no model, no operator)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import kmock

from e2e.apiserver import KubeAPIServer
from e2e.kubelet import LocalKubelet
from e2e.nodes import ClusterNodes
from e2e.placement import ClaimInfo, NodeInfo, place
from e2e.provisioner import NODE_ANNOTATION, RWO_ONLY, LocalProvisioner
from e2e.scheduler import LocalScheduler
from e2e.service_proxy import ClusterServices
from e2e.waiting import eventually

NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
# Ready as soon as it listens; answers every GET with its own pod name.
SERVER = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ.get("POD", "").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer((os.environ["PREHEAT_HOST"], int(os.environ["PREHEAT_PORT"])), H).serve_forever()
"""


def pod(name: str, *, claim: str | None = None, service: str = "svc", role: str = "serving",
        pre_stop_s: int = 0) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "engine", "command": ["preheat"], "ports": [{"containerPort": 8000}],
        "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8000}, "periodSeconds": 1},
    }
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 10, "containers": [container]}
    if claim:
        spec["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
        container["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    if pre_stop_s:
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": pre_stop_s}}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"preheat.dev/service": service, "preheat.dev/role": role}},
            "spec": spec}


def claim(name: str, mode: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}}


def condition(p: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (p.get("status") or {}).get("conditions") or []
                 if c.get("type") == ctype), {})


@contextlib.asynccontextmanager
async def harness(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, LocalKubelet,
                                                         ClusterServices]]:
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        nodes = ClusterNodes.named()
        holder: list[LocalKubelet] = []

        def address_of(name: str) -> tuple[str, int] | None:
            try:
                rt = holder[0].by_name(name)
            except KeyError:
                return None
            return (rt.ip, rt.port) if rt.ip and rt.port else None
        user = httpx.AsyncClient(base_url=url, timeout=10)
        async with LocalProvisioner(url, NS, tmp_path, access_modes=RWO_ONLY, node="node-a"), \
                LocalScheduler(url, NS, nodes), \
                ClusterServices(url, NS, address_of, propagation_s=0.1) as services, \
                LocalKubelet(url, NS, tmp_path, nodes=nodes, dns=services.address,
                             commands={"preheat": [sys.executable, "-c", SERVER]}) as kubelet:
            holder.append(kubelet)
            try:
                yield user, kubelet, services
            finally:
                await user.aclose()


async def get(user: httpx.AsyncClient, name: str) -> dict[str, Any]:
    return (await user.get(f"{PODS}/{name}")).json()


def test_placement_is_pure_and_names_why_a_pod_cannot_be_placed():
    nodes = [NodeInfo("a"), NodeInfo("b", lost=True), NodeInfo("c")]
    p = pod("x", claim="data")
    assert "unbound immediate PersistentVolumeClaims" in place(p, nodes, {}, {}).message
    assert place(p, nodes, {"data": ClaimInfo("Pending")}, {}).node is None
    assert place(p, nodes, {"data": ClaimInfo("Bound", node="c")}, {}).node == "c"
    refused = place(p, nodes, {"data": ClaimInfo("Bound", node="b")}, {})
    assert refused.node is None and "volume node affinity conflict" in refused.message
    # Spread: the node with the fewest pods of the service, never the lost one.
    assert place(pod("y"), nodes, {}, {"a": 2, "c": 1}).node == "c"


async def test_a_readwritemany_claim_on_readwriteonce_storage_leaves_its_pod_pending(tmp_path):
    async with harness(tmp_path) as (user, kubelet, _):
        await user.post(f"/api/v1/namespaces/{NS}/persistentvolumeclaims", json=claim("rwx", "ReadWriteMany"))
        await user.post(PODS, json=pod("p", claim="rwx"))

        async def unschedulable():
            c = condition(await get(user, "p"), "PodScheduled")
            return c if c.get("status") == "False" else None
        c = await eventually(unschedulable, 15)
        assert c["reason"] == "Unschedulable"
        assert "unbound immediate PersistentVolumeClaims" in c["message"]
        await asyncio.sleep(1.5)  # a few scheduler rounds later: still not started anywhere
        p = await get(user, "p")
        assert (p.get("status") or {}).get("phase") == "Pending"
        assert not (p.get("spec") or {}).get("nodeName") and not kubelet.pods
        claim_now = (await user.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/rwx")).json()
        assert (claim_now.get("status") or {}).get("phase") != "Bound"
        events = (await user.get(f"/api/v1/namespaces/{NS}/events")).json()["items"]
        assert any(e.get("reason") == "ProvisioningFailed" for e in events)


async def test_a_readwriteonce_claim_pins_its_pods_to_one_node_and_others_spread(tmp_path):
    async with harness(tmp_path) as (user, kubelet, _):
        await user.post(f"/api/v1/namespaces/{NS}/persistentvolumeclaims", json=claim("rwo", "ReadWriteOnce"))
        for name in ("v1", "v2"):
            await user.post(PODS, json=pod(name, claim="rwo", service="vol"))
        for name in ("s1", "s2", "s3"):
            await user.post(PODS, json=pod(name, service="spread"))

        async def all_bound():
            nodes = {n: (await get(user, n)).get("spec", {}).get("nodeName")
                     for n in ("v1", "v2", "s1", "s2", "s3")}
            return nodes if all(nodes.values()) else None
        nodes = await eventually(all_bound, 15)
        rwo = (await user.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/rwo")).json()
        assert rwo["metadata"]["annotations"][NODE_ANNOTATION] == "node-a"
        assert nodes["v1"] == nodes["v2"] == "node-a"
        assert {nodes["s1"], nodes["s2"], nodes["s3"]} == {"node-a", "node-b", "node-c"}

        async def running():
            return {rt.name for rt in kubelet.pods.values() if rt.port} >= set(nodes)
        await eventually(running, 15)


async def test_the_service_stand_in_routes_to_ready_serving_pods_only(tmp_path):
    async with harness(tmp_path) as (user, kubelet, services):
        await user.post(f"/api/v1/namespaces/{NS}/services", json={
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc", "namespace": NS},
            "spec": {"selector": {"preheat.dev/service": "svc", "preheat.dev/role": "serving"},
                     "ports": [{"port": 8000, "targetPort": 8000}]}})
        await user.post(PODS, json=pod("serving-1"))
        await user.post(PODS, json=pod("warm-1", role="warm"))
        url = await services.url("svc")

        async def answered() -> set[str]:
            seen = set()
            for _ in range(6):
                with contextlib.suppress(httpx.HTTPError):
                    async with httpx.AsyncClient() as c:  # a new connection each time
                        seen.add((await c.get(url + "/")).text)
            return seen
        assert await eventually(answered, 20) == {"serving-1"}  # never the warm pod
        # Relabelled out of the selector: the endpoint goes, connections are refused.
        await user.patch(f"{PODS}/serving-1", json={"metadata": {"labels": {"preheat.dev/role": "draining"}}},
                         headers={"Content-Type": "application/merge-patch+json"})

        async def gone():
            return not services.proxies["svc"].endpoints
        await eventually(gone, 5)
        assert await answered() == set()
        assert services.proxies["svc"].stats.refused > 0
        # Cluster DNS: the Service's name resolves to its stand-in.
        assert await services.address("svc", 8000) == url.removeprefix("http://")
        assert await services.address("svc", 9999) is None
        assert await services.address("nosuch", 8000) is None


async def test_a_lost_node_freezes_its_pods_and_a_deletion_there_kills_at_once(tmp_path):
    async with harness(tmp_path) as (user, kubelet, _):
        await user.post(PODS, json=pod("n1", pre_stop_s=5))

        async def ready():
            return condition(await get(user, "n1"), "ContainersReady").get("status") == "True"
        await eventually(ready, 15)
        rt = kubelet.by_name("n1")
        pid = rt.proc.pid
        assert await kubelet.lose_node(rt.node) == ["n1"]
        assert _state(pid) == "T"  # stopped: connections to it hang, as to a vanished machine
        await user.delete(f"{PODS}/n1")

        async def killed():
            return not kubelet.pods and kubelet.finished[-1].exit_codes == [137]
        await eventually(killed, 3)  # no preStop sleep, no grace: the node is gone


async def test_the_pre_stop_sleep_runs_before_sigterm(tmp_path):
    async with harness(tmp_path) as (user, kubelet, _):
        await user.post(PODS, json=pod("ps", pre_stop_s=2))

        async def ready():
            return condition(await get(user, "ps"), "ContainersReady").get("status") == "True"
        await eventually(ready, 15)
        proc = kubelet.by_name("ps").proc
        await user.delete(f"{PODS}/ps")
        await asyncio.sleep(1)
        assert proc.returncode is None  # still serving during the preStop sleep

        async def stopped():
            return proc.returncode is not None
        await eventually(stopped, 15)
        assert kubelet.finished[-1].exit_codes == [128 + 15]  # SIGTERM after the sleep


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]



async def test_a_hard_eviction_kills_at_once_and_leaves_the_pod_failed(tmp_path):
    async with harness(tmp_path) as (user, kubelet, _):
        await user.post(PODS, json=pod("ev", pre_stop_s=5))

        async def ready():
            return condition(await get(user, "ev"), "ContainersReady").get("status") == "True"
        await eventually(ready, 15)
        await kubelet.evict("ev")  # returns once the pod has stopped
        assert kubelet.finished[-1].exit_codes == [137]  # no preStop, no SIGTERM
        status = (await get(user, "ev"))["status"]
        assert (status["phase"], status["reason"]) == ("Failed", "Evicted")
        assert condition(await get(user, "ev"), "Ready")["status"] == "False"
