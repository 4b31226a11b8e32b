"""The router's engine set follows the pods through the API emulator's list + watch: only
Ready role=serving pods of its service, out on the first event that says otherwise."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import kmock
import kopf

sys.path.append(str(Path(__file__).resolve().parents[1] / "operator"))
from kmock_apiserver import KubeAPIServer

from preheat.operator.kube import STRATEGIC, Kube
from preheat.operator.resources import PODS
from preheat.router.config import RouterConfig
from preheat.router.discovery import Endpoints, api_access, engine_url, router_url, watch_engines

NS = "default"


def pod(name: str, role: str, service: str = "chat") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"preheat.dev/service": service, "preheat.dev/role": role}},
            "spec": {"containers": [{"name": "engine", "image": "x"}]}}


async def set_ready(kube: Kube, name: str, ready: bool, ip: str) -> None:
    await kube.patch(PODS, NS, name, {"status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}},
        subresource="status", content_type=STRATEGIC)


async def until(check, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.02)


def test_only_ready_serving_pods_of_the_service_qualify():
    ok = {**pod("a", "serving"), "status": {"podIP": "10.0.0.1", "conditions": [
        {"type": "Ready", "status": "True"}]}}
    assert engine_url(ok, "chat", 8000) == "http://10.0.0.1:8000"
    assert engine_url({**ok, "metadata": {**ok["metadata"], "labels": {
        "preheat.dev/service": "chat", "preheat.dev/role": "warm"}}}, "chat", 8000) is None
    assert engine_url(ok, "other", 8000) is None
    assert engine_url({**ok, "metadata": {**ok["metadata"], "deletionTimestamp": "t"}},
                      "chat", 8000) is None
    assert engine_url({**ok, "status": {"podIP": "10.0.0.1"}}, "chat", 8000) is None


def test_the_peers_are_the_other_ready_router_pods_of_the_service():
    ok = {**pod("chat-router-1", "router"), "status": {"podIP": "10.0.0.2", "conditions": [
        {"type": "Ready", "status": "True"}]}}
    ok["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8080}]
    assert router_url(ok, "chat", 8000, own="chat-router-2") == "http://10.0.0.2:8080"
    assert router_url(ok, "chat", 8000, own="chat-router-1") is None  # not a peer of itself
    assert router_url(ok, "other", 8000, own=None) is None
    assert engine_url(ok, "chat", 8000) is None  # and never an engine
    assert router_url({**ok, "status": {"podIP": "10.0.0.2"}}, "chat", 8000, None) is None


async def test_the_engine_set_follows_readiness_relabels_and_deletion(tmp_path):
    (tmp_path / "token").write_text("router-token\n")
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        kube = Kube(kopf.ConnectionInfo(server=str(server.url).rstrip("/")))
        cfg = RouterConfig(service="chat", namespace=NS, api_server=str(server.url),
                           service_account_dir=str(tmp_path))
        access = api_access(cfg)
        assert access.headers() == {"Authorization": "Bearer router-token"}
        for name, role in (("chat-a", "serving"), ("chat-w", "warm"), ("other-a", "serving"),
                           ("chat-router-x", "router")):
            await kube.create(PODS, NS, pod(name, role, "other" if name.startswith("other") else "chat"))
            await set_ready(kube, name, True, f"127.0.0.{len(name)}")
        eps = Endpoints()
        task = asyncio.create_task(watch_engines(cfg, eps, access))
        try:
            await until(lambda: eps.synced)
            assert eps.ready == {"chat-a": "http://127.0.0.6:8000"}  # listed: warm and other out
            assert eps.peers == {"chat-router-x": "http://127.0.0.13:8000"}  # a router: a peer
            assert eps.peer_hosts() == {"127.0.0.13"}
            # A warm pod promoted (relabelled) joins; one turning unready leaves.
            await kube.patch(PODS, NS, "chat-w", {"metadata": {"labels": {"preheat.dev/role": "serving"}}})
            await until(lambda: "chat-w" in eps.ready)
            await set_ready(kube, "chat-a", False, "127.0.0.6")
            await until(lambda: "chat-a" not in eps.ready)
            await set_ready(kube, "chat-a", True, "127.0.0.6")
            await until(lambda: "chat-a" in eps.ready)
            # Retired (role=draining) leaves at once, before its deletion; a deleted pod too.
            await kube.patch(PODS, NS, "chat-a", {"metadata": {"labels": {"preheat.dev/role": "draining"}}})
            await until(lambda: "chat-a" not in eps.ready)
            await kube.delete(PODS, NS, "chat-w")
            await until(lambda: eps.ready == {})
            await kube.delete(PODS, NS, "chat-router-x")
            await until(lambda: eps.peers == {})
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await kube.close()


async def test_preheat_router_serves_ready_once_listed_and_exits_0_on_sigterm(tmp_path):
    """The program as a pod runs it: `preheat router` against the API, then SIGTERM."""
    import os
    import signal
    import subprocess

    import httpx
    from serve_process import free_port

    async with KubeAPIServer() as api, kmock.Server(api) as server:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "preheat", "router", "--service", "chat", "-n", NS,
             "--api-server", str(server.url), "--service-account-dir", str(tmp_path),
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=(tmp_path / "router.log").open("w"), stderr=subprocess.STDOUT, env=env)
        try:
            async with httpx.AsyncClient(timeout=2) as http:
                async def ready():
                    try:
                        return (await http.get(f"http://127.0.0.1:{port}/ready")).status_code == 200
                    except httpx.HTTPError:
                        return False
                deadline = asyncio.get_running_loop().time() + 60
                while not await ready():
                    assert proc.poll() is None, (tmp_path / "router.log").read_text()
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.1)
                body = (await http.get(f"http://127.0.0.1:{port}/ready")).json()
                assert body == {"synced": True, "engines": []}
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
            assert code == 0, (tmp_path / "router.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
