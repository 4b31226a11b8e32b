"""Model files from a Ready peer of the same service (engine/model/peer_serve.py and
peer_fetch.py): two real engines on loopback, the second takes the model from the first and
the hub stand-in serves it no bytes; a peer whose bytes are not what the hub lists is refused
and the hub is used; without a peer secret there is no route."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from conftest import TINY_REPO
from fastapi import FastAPI, Request
from serve_process import free_port, serve_app, start
from test_serve_download import FLAGS, counter

from preheat.engine.model.download import Progress, RemoteFile, read_complete
from preheat.engine.model.fetch import fetch_model
from preheat.engine.model.peer_fetch import ModelPeer, fetch_from_peer, listing_problem
from preheat.engine.model.peer_serve import FILES_PATH, add_model_peer_routes, model_key
from preheat.engine.peer.peer_secret import PeerSecret
from preheat.engine.request.api_errors import APIError
from preheat.engine.serve.http_auth import Authentication

KEY = "peer-secret-for-model-files-0123456789"


def source_bytes(text: str, source: str) -> float:
    m = re.search(rf'^preheat_model_download_source_bytes_total{{source="{source}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture
def secret_file(tmp_path) -> Path:
    path = tmp_path / "peer-secret"
    path.write_text(KEY + "\n")
    return path


def peer_app(model: str, download_dir: Path, secret: PeerSecret | None) -> FastAPI:
    """The model routes behind the engine's own Authentication and error handler."""
    app = FastAPI()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    add_model_peer_routes(app, model, download_dir)
    app.add_middleware(Authentication, api_key=None, peer_secret=secret)
    return app


def test_a_second_engine_takes_the_model_from_the_first(hub, tmp_path, secret_file):
    size = sum(p.stat().st_size for p in hub.repos[TINY_REPO].files.values())
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    common = [*FLAGS, "--model", f"hf://{TINY_REPO}", "--weight-cache-dir", "off",
              "--peer-secret-file", str(secret_file)]
    first = start(tmp_path, [*common, "--download-dir", str(tmp_path / "a"),
                             "--model-peer-url", f"http://127.0.0.1:{free_port()}"], env=env, name="first")
    second = None
    try:
        first.wait_ready(240)
        text = first.metrics()
        # Nobody to ask (the first pod of a service): the hub, counted as such.
        assert source_bytes(text, "hub") == size == counter(text) and source_bytes(text, "peer") == 0
        # The peer route answers only the peer secret.
        files_url = first.url + FILES_PATH
        key = model_key(f"hf://{TINY_REPO}")
        assert httpx.get(files_url, params={"key": key}, timeout=10).status_code == 401
        listed = httpx.get(files_url, params={"key": key}, timeout=10,
                           headers={"Authorization": f"Bearer {KEY}"}).json()
        assert sum(f["size"] for f in listed["files"]) == size

        hub_before = hub.bytes_served(TINY_REPO)
        second = start(tmp_path, [*common, "--download-dir", str(tmp_path / "b"),
                                  "--model-peer-url", first.url], env=env, name="second")
        second.wait_ready(240)
        text = second.metrics()
        assert hub.bytes_served(TINY_REPO) == hub_before  # only the revision and tree calls
        assert source_bytes(text, "peer") == size == counter(text) and source_bytes(text, "hub") == 0
        done = read_complete(tmp_path / "b", key)  # its own marker: a restart reads its dir
        assert done is not None and done.version == listed["version"]
        out = httpx.post(second.url + "/v1/completions", timeout=60,
                         json={"model": TINY_REPO, "prompt": "hi", "max_tokens": 2})
        assert out.status_code == 200
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_peer_whose_bytes_are_not_the_hubs_is_refused_and_the_hub_used(hub_endpoint, hub, tmp_path,
                                                                        secret_file):
    model = f"hf://{TINY_REPO}"
    fetch_model(model, str(tmp_path / "peer"), None, Progress())
    done = read_complete(tmp_path / "peer", model_key(model))
    weights = Path(done.root / "model.safetensors").resolve()
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # same size: only the digest tells
    weights.write_bytes(bytes(raw))

    with serve_app(peer_app(model, tmp_path / "peer", PeerSecret(secret_file))) as url:
        peer = ModelPeer(url, PeerSecret(secret_file).keys, timeout=60)
        before = hub.bytes_served(TINY_REPO)
        progress = Progress()
        got = fetch_model(model, str(tmp_path / "new"), None, progress, peer)
        assert progress.source == "hub"
        # The weights came from the hub; the files the peer sent before them verified and
        # were kept.
        total = sum(f.size for f in done.files)
        assert len(raw) <= hub.bytes_served(TINY_REPO) - before < total
        fresh = (Path(got.path) / "model.safetensors").read_bytes()
        assert fresh != bytes(raw) and len(fresh) == len(raw)
        # The same peer asked directly says why.
        listing = {f.path: f for f in done.files}
        result = fetch_from_peer(peer, model_key(model), done.version, list(listing.values()),
                                 tmp_path / "direct", Progress())
        assert result.result == "refused" and "model.safetensors" in result.detail
        assert not (tmp_path / "direct" / "model.safetensors").exists()


def test_without_a_peer_secret_there_is_no_route(hub_endpoint, tmp_path):
    model = f"hf://{TINY_REPO}"
    fetch_model(model, str(tmp_path / "dl"), None, Progress())
    with serve_app(peer_app(model, tmp_path / "dl", None)) as url:
        r = httpx.get(url + FILES_PATH, params={"key": model_key(model)}, timeout=10)
        assert r.status_code == 404
        # A peer without a secret to send gets nothing either, and says so.
        got = fetch_from_peer(ModelPeer(url, lambda: None, 10), model_key(model), "x", [], tmp_path, Progress())
        assert got.result == "none"


def test_a_listing_that_is_not_the_sources_is_refused():
    files = [RemoteFile("a.json", 10, git_sha1="1" * 40), RemoteFile("w.safetensors", 99, sha256="2" * 64)]
    good = {"version": "v1", "files": [{"path": "a.json", "size": 10, "git_sha1": "1" * 40},
                                       {"path": "w.safetensors", "size": 99, "sha256": "2" * 64}]}
    assert listing_problem(good, "v1", files) is None
    assert "version" in listing_problem(good, "v2", files)
    assert "other files" in listing_problem({**good, "files": good["files"][:1]}, "v1", files)
    bigger = {**good, "files": [good["files"][0], {**good["files"][1], "size": 100}]}
    assert "100 bytes" in listing_problem(bigger, "v1", files)
    other = {**good, "files": [good["files"][0], {**good["files"][1], "sha256": "3" * 64}]}
    assert "sha256" in listing_problem(other, "v1", files)
    assert listing_problem(["not", "a", "dict"], "v1", files) == "not a listing"


def test_progress_says_where_the_bytes_come_from():
    p = Progress()
    p.start(10, 0)
    assert "source" not in p.as_dict()
    p.source = "peer"
    assert p.as_dict() == {"bytes_done": 0, "bytes_total": 10, "source": "peer"}
