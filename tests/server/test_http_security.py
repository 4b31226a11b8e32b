"""The HTTP server as an attacker reaches it, on a fake engine (no model): who may call
what (engine/serve/http_auth.py), JSON bodies only as application/json, trusted hosts, /health's
error text, and — over a real uvicorn server and raw sockets — a slowloris client, a body
that never finishes, and a request flood that fills the request limit while the probes
still answer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine

from preheat.engine.async_engine import AsyncEngine
from preheat.engine.config import EngineConfig
from preheat.engine.metrics import Metrics
from preheat.engine.peer.peer_secret import PeerKeys
from preheat.engine.serve.http_auth import OPEN_ROUTES, refusal, route_kind
from preheat.engine.serve.http_limits import guarded_protocol
from preheat.engine.serve.server import create_app

API_KEY = "client-key-0123456789"
PEER = b"peer-secret-0123456789ab"


class StaticSecret:
    def __init__(self, *keys: bytes) -> None:
        self._keys = PeerKeys(keys[0], keys)

    def keys(self) -> PeerKeys:
        return self._keys


@pytest.fixture
async def app_client():
    made = []

    async def make(**kwargs):
        aengine = AsyncEngine(Metrics(), FakeEngine())
        aengine.start(asyncio.get_running_loop())
        aengine.set_phase("ready")
        app = create_app(aengine, **kwargs)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        made.append((aengine, client))
        return aengine, client

    yield make
    for aengine, client in made:
        await client.aclose()
        aengine.stop()


def bearer(token) -> dict[str, str]:
    return {"Authorization": f"Bearer {token.decode() if isinstance(token, bytes) else token}"}


# --------------------------------------------------------------------------- who may call what


def test_routes_are_open_peer_or_client_and_anything_new_is_client():
    assert OPEN_ROUTES == {"/health", "/ready", "/health_generate", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"}
    assert [route_kind(p) for p in ("/health", "/admin", "/admin/snapshot/latest", "/v1/models",
                                    "/generate", "/admin2", "/healthz")] == \
        ["open", "peer", "peer", "client", "client", "client", "client"]
    keys = StaticSecret(PEER).keys()
    assert refusal("peer", API_KEY, API_KEY, keys).status == 401  # the client key is no peer key
    assert refusal("peer", PEER.decode(), API_KEY, None).status == 404  # no secret: no /admin
    assert refusal("client", None, None, keys) is None  # no API key: the API is open


async def test_the_export_is_refused_to_nobody_a_client_and_a_wrong_secret(app_client, tmp_path):
    from preheat.engine.warm.snapshotter import Snapshotter

    snapshotter = Snapshotter(str(tmp_path), 1024, 0, Metrics())
    _, http = await app_client(api_key=API_KEY, peer_secret=StaticSecret(PEER, b"previous-0123456789abc"),
                               snapshotter=snapshotter)
    for path in ("/admin/snapshot/latest?max_age=0", "/admin/snapshot"):
        method = "GET" if "latest" in path else "POST"
        for headers in ({}, bearer(API_KEY), bearer("peer-secret-0123456789aa"), {"Authorization": PEER.decode()}):
            r = await http.request(method, path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_peer_secret", (path, headers)
    # The peer secret (current or previous) passes authentication; the fake engine has
    # nothing cached, so the route itself answers.
    for key in (PEER, b"previous-0123456789abc"):
        r = await http.get("/admin/snapshot/latest", headers=bearer(key))
        assert r.status_code != 401, r.text
    # And the peer secret is no client credential.
    assert (await http.get("/v1/models", headers=bearer(PEER))).status_code == 401
    assert (await http.get("/v1/models", headers=bearer(API_KEY))).status_code == 200


async def test_without_a_peer_secret_admin_does_not_exist(app_client, tmp_path):
    _, http = await app_client()  # no API key either: the most open configuration
    for method, path in (("POST", "/admin/snapshot"), ("GET", "/admin/snapshot/latest")):
        r = await http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert (await http.get("/v1/models")).status_code == 200


async def test_open_routes_need_nothing_even_with_both_credentials_set(app_client):
    _, http = await app_client(api_key=API_KEY, peer_secret=StaticSecret(PEER))
    for path in ("/health", "/ready", "/metrics", "/openapi.json", "/docs"):
        assert (await http.get(path)).status_code == 200, path


# --------------------------------------------------------------------------- bodies, hosts, errors

CHAT = {"model": "fake", "prompt": [[1, 2]], "max_tokens": 2}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
async def test_a_body_not_sent_as_json_is_415(app_client, content_type):
    """What a browser can send cross-site without a preflight (CSRF, DNS rebinding)."""
    _, http = await app_client()
    headers = {"content-type": content_type} if content_type else {}
    import json
    r = await http.post("/v1/completions", content=json.dumps(CHAT).encode(), headers=headers)
    if content_type is None:  # httpx sends none for raw content
        assert "content-type" not in r.request.headers
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


async def test_json_with_a_charset_is_accepted(app_client):
    import json
    _, http = await app_client()
    r = await http.post("/v1/completions", content=json.dumps(CHAT).encode(),
                        headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


async def test_trusted_hosts_refuse_another_host_but_never_the_probes(app_client):
    _, http = await app_client(trusted_hosts=["preheat.example", "*.svc.cluster.local"])
    assert (await http.get("/v1/models", headers={"host": "attacker.example"})).status_code == 400
    assert (await http.get("/v1/models", headers={"host": "preheat.example"})).status_code == 200
    assert (await http.get("/v1/models", headers={"host": "smol.ns.svc.cluster.local"})).status_code == 200
    for probe in ("/health", "/ready", "/metrics"):  # the kubelet sends the pod IP as Host
        assert (await http.get(probe, headers={"host": "10.0.0.7:8000"})).status_code == 200


async def test_health_reports_a_dead_loop_without_the_exception_text(app_client):
    aengine, http = await app_client()
    aengine.error = RuntimeError("token ids [1, 2, 3] of user alice from /var/lib/secret")
    r = await http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "dead"
    assert "alice" not in r.text and "/var/lib" not in r.text and "RuntimeError" in r.text


def test_the_default_request_limit_leaves_room_for_the_queue():
    c = EngineConfig(max_num_seqs=64, max_queue_len=1024)
    assert c.request_limit >= c.max_num_seqs + c.max_queue_len
    assert EngineConfig(limit_concurrency=5).request_limit == 5


# --------------------------------------------------------------------------- over real sockets


@contextlib.contextmanager
def real_server(**app_kwargs):
    """uvicorn with the engine's protocol (header deadline 0.5 s) in a thread, on a fake
    engine running on that server's loop."""
    box: dict = {}
    port_sock = socket.socket()
    port_sock.bind(("127.0.0.1", 0))
    port = port_sock.getsockname()[1]
    port_sock.close()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            aengine = AsyncEngine(Metrics(), FakeEngine())
            aengine.start(asyncio.get_running_loop())
            aengine.set_phase("ready")
            box["aengine"], box["app"] = aengine, create_app(aengine, **app_kwargs)
            await super().startup(sockets)

    async def app(scope, receive, send):  # the engine's app, built on the server's loop
        await box["app"](scope, receive, send)

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off", http=guarded_protocol(0.5), timeout_keep_alive=5)
    server = Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(10)
        box["aengine"].stop()


def closed_by_server(sock: socket.socket, keep_sending: bytes, rounds: int = 400) -> int:
    """Trickles `keep_sending` one byte per round (20 ms apart) until the server closes the
    connection; returns the bytes sent by then (fails if it never closes)."""
    sock.settimeout(0.02)
    for i in range(rounds):
        try:
            if sock.recv(1024) == b"":
                return i
        except TimeoutError:
            pass
        except ConnectionResetError:
            return i
        try:
            sock.send(keep_sending[i % len(keep_sending):][:1])
        except (BrokenPipeError, ConnectionResetError):
            return i
    raise AssertionError("the server kept a trickling connection open")


def test_a_slowloris_client_is_cut_off_while_others_are_served():
    with real_server() as (host, port):
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            sent = closed_by_server(slow, b"X-Padding: aaaaaaaaaaaaaaaaaaaa\r\n")
            assert sent < 400  # closed at the header deadline, not when the client gave up
            assert httpx.get(f"http://{host}/health").status_code == 200


def test_a_kept_alive_connection_gets_a_new_header_deadline_per_request():
    with real_server() as (host, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200 OK" in conn.recv(4096)
            conn.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, trickled
            closed_by_server(conn, b"X-A: b\r\n")


def test_a_body_that_never_finishes_is_a_408():
    with real_server(body_timeout=0.5) as (host, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            conn.settimeout(30)
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = conn.recv(4096)
                assert chunk, "closed without an answer"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408")


def test_a_full_request_limit_is_503_for_requests_but_never_for_probes():
    with real_server(request_limit=2, body_timeout=60) as (host, port):
        held = []
        for _ in range(2):  # two requests in flight: their bodies never finish
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            held.append(s)
        try:
            deadline = time.monotonic() + 30
            while True:  # until the server has both in flight
                r = httpx.get(f"http://{host}/v1/models")
                if r.status_code == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
            assert r.headers["retry-after"] == "1"
            for probe in ("/health", "/ready", "/metrics"):
                assert httpx.get(f"http://{host}{probe}").status_code == 200, probe
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 30
        while httpx.get(f"http://{host}/v1/models").status_code != 200:  # freed again
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_an_unusable_peer_secret_stops_serve_before_anything_loads(tmp_path):
    """A peer secret that cannot be read (or is too short to be one) is a configuration
    error: `preheat serve` says so and exits 2, rather than serving /admin/* unguarded."""
    import subprocess
    import sys

    from preheat.engine.config import ConfigError

    with pytest.raises(ConfigError, match="--peer-secret-file"):
        EngineConfig(peer_secret_file=" ")
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    for path, words in ((tmp_path / "absent", "cannot read"), (weak, "shorter than")):
        run = subprocess.run([sys.executable, "-m", "preheat", "serve", "--peer-secret-file", str(path)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "--peer-secret-file" in run.stderr and words in run.stderr, run.stderr
