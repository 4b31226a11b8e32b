"""The local kubelet against the API emulator, with a stand-in container (no model)."""

from __future__ import annotations

import asyncio
import sys

import httpx
import kmock

from e2e.apiserver import KubeAPIServer
from e2e.kubelet import LocalKubelet
from e2e.waiting import eventually

NS = "default"
GATE = "preheat.dev/warm"
# A container that is ready as soon as it listens.
SERVER = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer((os.environ["PREHEAT_HOST"], int(os.environ["PREHEAT_PORT"])), H).serve_forever()
"""
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}


def gated_pod(name: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
        "spec": {
            "nodeName": "node-a",  # bound: the local kubelet runs only scheduled pods
            "readinessGates": [{"conditionType": GATE}],
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "engine", "command": ["preheat"], "ports": [{"containerPort": 8000}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8000},
                                   "periodSeconds": 1},
            }],
        },
    }


def conditions(pod: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}


async def test_a_gate_opened_while_the_kubelets_own_status_write_is_in_flight_is_not_lost(
        tmp_path):
    """The operator opens the readiness gate in reaction to the kubelet's ContainersReady
    write; the kubelet's watch can deliver that newer pod before the (older) response to its
    own write comes back. The kubelet must report Ready from the newer pod, not overwrite its
    view with the stale response and then never write Ready (the wedge this test pins)."""
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        operator = httpx.AsyncClient(base_url=url, timeout=10)
        gate_opened = asyncio.Event()
        opened_at_rv: list[int] = []

        async def play_the_operator(response: httpx.Response) -> None:
            # Runs in the kubelet's client after its status write has been applied and
            # before its code sees the response: the operator reacts in that window.
            req = response.request
            if req.method != "PATCH" or not req.url.path.endswith("/status") or \
                    gate_opened.is_set():
                return
            await response.aread()
            if conditions(response.json()).get("ContainersReady") != "True":
                return
            gate_opened.set()
            r = await operator.patch(
                req.url.path, headers=STRATEGIC,
                json={"status": {"conditions": [{"type": GATE, "status": "True"}]}})
            opened_at_rv.append(int(r.json()["metadata"]["resourceVersion"]))
            # Until the kubelet's watch has delivered the newer pod.
            await eventually(lambda: _seen(kubelet, opened_at_rv[0]), 10, interval=0.01)

        async with LocalKubelet(url, NS, tmp_path,
                                commands={"preheat": [sys.executable, "-c", SERVER]}) as kubelet:
            kubelet._client.event_hooks["response"].append(play_the_operator)
            try:
                await operator.post(f"/api/v1/namespaces/{NS}/pods", json=gated_pod("p"))

                async def ready():
                    pod = (await operator.get(f"/api/v1/namespaces/{NS}/pods/p")).json()
                    assert gate_opened.is_set(), "the kubelet never reported ContainersReady"
                    assert conditions(pod).get("Ready") == "True", conditions(pod)
                    return True
                # Generous for a slow machine: when the race wedges the pod, no wait helps.
                await eventually(ready, 30, interval=0.05)
            finally:
                await operator.delete(f"/api/v1/namespaces/{NS}/pods/p")
                await operator.aclose()


async def _seen(kubelet: LocalKubelet, rv: int) -> bool:
    return any(int(rt.pod["metadata"]["resourceVersion"]) >= rv and
               conditions(rt.pod).get(GATE) == "True" for rt in kubelet.pods.values())


async def test_a_pod_created_while_the_housekeeping_list_is_in_flight_still_runs(tmp_path):
    """Housekeeping lists the pods to stop those whose DELETED the watch missed. A pod
    created after the server took that list, but seen on the watch before the list's
    response is read, is absent from the list without being deleted: it must keep running
    (stopping it would leave it in the API, never started again: a pod that never gets
    ready, and an operator that sees nothing to do)."""
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        user = httpx.AsyncClient(base_url=url, timeout=10)
        created = asyncio.Event()
        pods_path = f"/api/v1/namespaces/{NS}/pods"

        async def create_meanwhile(response: httpx.Response) -> None:
            req = response.request
            if req.method != "GET" or req.url.path != pods_path or \
                    "watch" in req.url.params or created.is_set():
                return
            created.set()
            await user.post(pods_path, json=gated_pod("late"))
            # Until the kubelet's watch has picked the new pod up.
            await eventually(lambda: _running(kubelet, "late"), 10, interval=0.01)

        async with LocalKubelet(url, NS, tmp_path,
                                commands={"preheat": [sys.executable, "-c", SERVER]}) as kubelet:
            kubelet._client.event_hooks["response"].append(create_meanwhile)
            try:
                async def started():
                    response = await user.get(f"{pods_path}/late")
                    assert created.is_set(), "no housekeeping round yet"
                    # The hook sets `created` before its POST has been answered: until then the
                    # pod is 404, a Status object, not yet a pod.
                    assert response.status_code == 200, f"not created yet: {response.status_code}"
                    pod = response.json()
                    assert conditions(pod).get("ContainersReady") == "True", conditions(pod)
                    return True
                await eventually(started, 30, interval=0.05)
                # Still running a few housekeeping rounds (every 2 s) later.
                await asyncio.sleep(2.5)
                assert await _running(kubelet, "late")
            finally:
                await user.delete(f"{pods_path}/late")
                await user.aclose()


async def _running(kubelet: LocalKubelet, name: str) -> bool:
    return any(rt.name == name and not rt.stop.is_set() for rt in kubelet.pods.values())


# A container that serves the content of the file PREHEAT_SECRET_FILE as /ready's body.
ECHO_FILE = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open(os.environ["PREHEAT_SECRET_FILE"], "rb").read()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer((os.environ["PREHEAT_HOST"], int(os.environ["PREHEAT_PORT"])), H).serve_forever()
"""


def secret_pod(name: str) -> dict:
    pod = gated_pod(name)
    pod["spec"].pop("readinessGates")
    pod["spec"]["volumes"] = [{"name": "peer", "secret": {"secretName": "peer", "defaultMode": 0o440}}]
    [c] = pod["spec"]["containers"]
    c["volumeMounts"] = [{"name": "peer", "mountPath": "/etc/peer", "readOnly": True}]
    c["env"] = [{"name": "PREHEAT_SECRET_FILE", "value": "/etc/peer/current"},
                {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "token"}}}]
    return pod


async def test_a_missing_secret_keeps_the_container_waiting_as_kubelet_says_it(tmp_path):
    """As a kubelet does: an env secretKeyRef to a missing Secret leaves the container Waiting,
    reason CreateContainerConfigError, message `secret "api" not found` (kubelet_pods.go);
    a Secret without the key, `couldn't find key token in Secret default/api`; a Secret
    volume is mounted as one file per key."""
    import base64

    async with KubeAPIServer() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        user = httpx.AsyncClient(base_url=url, timeout=10)
        b64 = lambda v: base64.b64encode(v.encode()).decode()  # noqa: E731
        secrets = f"/api/v1/namespaces/{NS}/secrets"
        await user.post(secrets, json={"metadata": {"name": "peer"}, "data": {"current": b64("k" * 32)}})
        async with LocalKubelet(url, NS, tmp_path,
                                commands={"preheat": [sys.executable, "-c", ECHO_FILE]}) as kubelet:
            try:
                await user.post(f"/api/v1/namespaces/{NS}/pods", json=secret_pod("s"))

                def waiting_with(message: str):
                    async def check():
                        pod = (await user.get(f"/api/v1/namespaces/{NS}/pods/s")).json()
                        [c] = (pod.get("status") or {}).get("containerStatuses") or [{}]
                        waiting = (c.get("state") or {}).get("waiting") or {}
                        assert waiting == {"reason": "CreateContainerConfigError", "message": message}, c
                        return True
                    return check
                await eventually(waiting_with('secret "api" not found'), 30, interval=0.05)
                await user.post(secrets, json={"metadata": {"name": "api"}, "data": {"other": b64("x")}})
                await eventually(waiting_with(f"couldn't find key token in Secret {NS}/api"), 30,
                                 interval=0.05)
                await user.patch(f"{secrets}/api", json={"data": {"token": b64("t")}})

                async def serving_the_mounted_secret():
                    rt = next(r for r in kubelet.pods.values() if r.name == "s")
                    assert rt.ip is not None and rt.port is not None
                    try:
                        r = httpx.get(f"http://{rt.ip}:{rt.port}/ready", timeout=5)
                    except httpx.TransportError as e:
                        raise AssertionError(f"not listening yet: {e}") from None
                    assert r.text == "k" * 32
                    return True
                await eventually(serving_the_mounted_secret, 30, interval=0.1)
            finally:
                await user.delete(f"/api/v1/namespaces/{NS}/pods/s")
                await user.aclose()
