"""Snapshots fetched from a peer over HTTP (engine/warm/snapshot_peer.py), on stand-ins (no
model): the transfer round-trips, a bad transfer never lands, the peer needs the peer
secret (not the API key), and whatever arrives is restored only if it passes the same
checks as a snapshot on disk. Attacks on the stream itself: test_peer_stream_attacks.py."""

from __future__ import annotations

import contextlib
import io
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from serve_process import free_port, serve_app

from preheat.engine.kv.snapshot import list_snapshots, load_latest_snapshot, save_snapshot
from preheat.engine.metrics import Metrics
from preheat.engine.peer.peer_secret import PeerKeys
from preheat.engine.request.api_errors import APIError
from preheat.engine.serve.http_auth import Authentication
from preheat.engine.warm.snapshot_peer import (
    NAME_HEADER,
    BadTransfer,
    add_snapshot_peer_routes,
    extract,
    fetch_latest,
    pick_or_save,
    tar_stream,
)
from preheat.engine.warm.snapshotter import (
    ASSUMED_WRITE_BYTES_PER_S,
    Snapshotter,
    kv_bytes_per_token,
    shutdown_token_budget,
)

from .snapshot_helpers import fingerprint, record
from .test_snapshotter import StandInAsyncEngine, StandInEngine

KEY = "peer-key-0123456789abcdef"
CLIENT_KEY = "client-key-0123456789"


class StaticSecret:
    """A PeerSecret whose keys never change (engine/peer/peer_secret.PeerSecret reads a file)."""

    def __init__(self, *keys: str) -> None:
        raw = tuple(k.encode() for k in keys)
        self._keys = PeerKeys(raw[0], raw)

    def keys(self) -> PeerKeys:
        return self._keys


SECRET = StaticSecret(KEY)


def saved(root: Path, *records, secret=SECRET) -> Path:
    keys = secret.keys() if secret is not None else None
    return save_snapshot(root, fingerprint(), list(records), "peer", keys=keys)


def test_a_snapshot_survives_the_tar_transfer_byte_for_byte(tmp_path):
    src = saved(tmp_path / "a", record(8, seed=1, hits=3, pinned=True), record(4, seed=2))
    into = tmp_path / "b"
    into.mkdir()
    size = extract(tar_stream(src), into, 1 << 30)
    assert sorted(p.name for p in into.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((into / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())
    assert size == sum(p.stat().st_size for p in src.iterdir())


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> list[bytes]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    raw = buf.getvalue()
    return [raw[i:i + 700] for i in range(0, len(raw), 700)]


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, b""


BAD_TRANSFERS = {
    "path escape": [_file("../manifest.json")],
    "nested path": [_file("sub/kv-00000.safetensors")],
    "symlink": [_link("manifest.json", "/etc/passwd")],
    "unknown file": [_file("evil.py")],
    "repeated file": [_file("manifest.json"), _file("manifest.json")],
    "too big": [_file("kv-00000.safetensors", b"y" * 5000)],
}


@pytest.mark.parametrize("case", BAD_TRANSFERS, ids=list(BAD_TRANSFERS))
def test_a_transfer_that_is_not_a_snapshots_files_is_refused(tmp_path, case):
    with pytest.raises(BadTransfer):
        extract(_tar(BAD_TRANSFERS[case]), tmp_path, 4096)
    assert not (tmp_path.parent / "passwd").exists()


def test_garbage_is_refused(tmp_path):
    with pytest.raises(BadTransfer):
        extract([b"this is not a tar archive" * 40], tmp_path, 4096)


def test_a_young_snapshot_is_served_as_is_an_old_one_is_replaced_by_a_fresh_save(tmp_path):
    old = saved(tmp_path, record(8, seed=1))
    saver = Snapshotter(str(tmp_path), 1024, 0, Metrics(), writer="peer", peer_secret=SECRET)
    ae = StandInAsyncEngine(StandInEngine([record(8, seed=5, pinned=True)]))
    assert pick_or_save(saver, ae, max_age=3600) == old
    fresh = pick_or_save(saver, ae, max_age=3600, now=lambda: time.time() + 7200)
    assert fresh != old and fresh == list_snapshots(tmp_path)[0]
    # Nothing cached and nothing young enough: the old one is better than none.
    empty = Snapshotter(str(tmp_path / "e"), 1024, 0, Metrics())
    assert pick_or_save(empty, StandInAsyncEngine(StandInEngine([])), 0) is None


# -- over HTTP -----------------------------------------------------------------------------------

@contextlib.contextmanager
def peer(directory: Path, records, secret=SECRET, ready: bool = True,
         api_key: str | None = CLIENT_KEY) -> Iterator[str]:
    """A real HTTP server with the peer route behind the engine's own Authentication, on
    stand-ins for the engine."""
    app = FastAPI()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    saver = Snapshotter(str(directory), 1024, 0, Metrics(), writer="peer", peer_secret=secret)
    aengine = StandInAsyncEngine(StandInEngine(list(records)), "ready" if ready else "warming")
    aengine.is_ready = ready
    add_snapshot_peer_routes(app, aengine, saver)
    app.add_middleware(Authentication, api_key=api_key, peer_secret=secret)
    with serve_app(app) as url:
        yield url


def test_a_new_pod_restores_what_its_peer_has_cached(tmp_path):
    hot = [record(8, seed=1, hits=9, pinned=True), record(4, seed=2, hits=1)]
    with peer(tmp_path / "peer", hot) as url:
        restorer = Snapshotter(str(tmp_path / "new"), 1024, 0, Metrics(), peer_url=url,
                               peer_secret=SECRET)
        target = StandInEngine()
        assert restorer.restore(StandInAsyncEngine(target, "restoring")) == 12
    assert [r.token_ids for r in target.imported] == [r.token_ids for r in hot]
    # The peer pinned its first prefix; here it is an ordinary cache entry, and counted.
    assert [r.pinned for r in target.imported] == [False, False]
    assert restorer.metrics.snapshot_rejected.labels(reason="peer_pinned")._value.get() == 1
    assert restorer.metrics.snapshot_peer_fetches.labels(result="fetched")._value.get() == 1
    # The snapshot now lives in the new pod's own directory, under the peer's name.
    [local] = list_snapshots(tmp_path / "new")
    assert local.name == list_snapshots(tmp_path / "peer")[0].name


def keys(*k: str) -> PeerKeys:
    return StaticSecret(*k).keys()


def test_the_peer_wants_the_peer_secret_not_the_api_key(tmp_path):
    with peer(tmp_path / "peer", [record(8, seed=1)]) as url:
        assert fetch_latest(url, tmp_path / "new", keys=keys("wrong-key-0123456789")).detail == \
            "peer answered 401"
        assert fetch_latest(url, tmp_path / "new", keys=keys(CLIENT_KEY)).detail == "peer answered 401"
        assert fetch_latest(url, tmp_path / "new").detail == "peer answered 401"
        assert fetch_latest(url, tmp_path / "new", keys=keys(KEY)).result == "fetched"
        assert fetch_latest(url, tmp_path / "new", keys=keys(KEY)).result == "present"


def test_a_rotated_peer_still_answers_the_previous_key(tmp_path):
    with peer(tmp_path / "peer", [record(8, seed=1)], secret=StaticSecret("new-0123456789abcdef", KEY)) as url:
        assert fetch_latest(url, tmp_path / "new", keys=keys(KEY)).result == "refused"  # signed under new
        assert fetch_latest(url, tmp_path / "b", keys=keys(KEY, "new-0123456789abcdef")).result == "fetched"


def test_a_pod_posing_as_a_peer_is_refused_at_the_signature(tmp_path):
    """A pod with the service's labels that accepts any token (here: ours) but does not
    hold our secret: what it sends is not signed under it, so nothing lands and the
    refusal is counted."""
    mine = "mine-0123456789abcdef"
    impostor = StaticSecret("impostor-0123456789abc", mine)  # signs with its own, accepts ours
    with peer(tmp_path / "peer", [record(8, seed=1, pinned=True)], secret=impostor) as url:
        restorer = Snapshotter(str(tmp_path / "new"), 1024, 0, Metrics(), peer_url=url,
                               peer_secret=StaticSecret(mine))
        assert restorer.restore(StandInAsyncEngine(StandInEngine(), "restoring")) == 0
    assert restorer.metrics.snapshot_peer_fetches.labels(result="refused")._value.get() == 1
    assert restorer.metrics.snapshot_rejected.labels(reason="bad_signature")._value.get() == 1
    assert list_snapshots(tmp_path / "new") == [] and list((tmp_path / "new").iterdir()) == []


def test_no_peer_and_a_peer_with_nothing_cached_mean_warming_cold(tmp_path):
    nobody = f"http://127.0.0.1:{free_port()}"
    assert fetch_latest(nobody, tmp_path / "a", timeout=2).result == "unreachable"
    with peer(tmp_path / "peer", []) as url:
        fetched = fetch_latest(url, tmp_path / "a", keys=keys(KEY))
    assert fetched.result == "none" and "404" in fetched.detail
    restorer = Snapshotter(str(tmp_path / "b"), 1024, 0, Metrics(), peer_url=nobody,
                           peer_timeout=2, peer_secret=SECRET)
    assert restorer.restore(StandInAsyncEngine(StandInEngine(), "restoring")) == 0
    assert restorer.metrics.snapshot_peer_fetches.labels(result="unreachable")._value.get() == 1


def test_a_tampered_snapshot_from_a_peer_is_refused_like_one_on_disk_and_removed(tmp_path):
    """The peer's newest snapshot has a flipped byte: the transfer is fine, the restore's
    own checks refuse it (the same checks as for a disk), the engine falls back to its own
    older snapshot, and the refused copy is removed so it never shadows that one again."""
    own = saved(tmp_path / "new", record(4, seed=3, pinned=True))
    src = saved(tmp_path / "peer", record(8, seed=1, pinned=True))
    tensor = next(src.glob("kv-*.safetensors"))
    data = bytearray(tensor.read_bytes())
    data[-1] ^= 0xFF
    tensor.write_bytes(bytes(data))
    with peer(tmp_path / "peer", []) as url:
        restorer = Snapshotter(str(tmp_path / "new"), 1024, 0, Metrics(), peer_url=url,
                               peer_secret=SECRET)
        target = StandInEngine()
        assert restorer.restore(StandInAsyncEngine(target, "restoring")) == 4
    assert restorer.metrics.snapshot_rejected.labels(reason="checksum_mismatch")._value.get() == 1
    assert list_snapshots(tmp_path / "new") == [own]
    assert load_latest_snapshot(tmp_path / "new", fingerprint()).path == own


def test_the_route_refuses_while_the_engine_is_not_serving(tmp_path):
    import httpx
    saved(tmp_path / "peer", record(8, seed=1))
    with peer(tmp_path / "peer", [], ready=False) as url:
        r = httpx.get(url + "/admin/snapshot/latest", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


# -- the shutdown snapshot's size -----------------------------------------------------------------

def test_the_shutdown_snapshot_is_sized_to_fit_its_deadline():
    per_token = kv_bytes_per_token(fingerprint())
    assert per_token == 2 * 2 * 2 * 4 * 2  # layers, K and V, kv heads, head dim, bfloat16
    assert shutdown_token_budget(1000, None, per_token, None) == 1000  # no deadline
    assert shutdown_token_budget(1000, 0, per_token, None) == 0
    # Unmeasured: the assumed speed; half the time for the write.
    assume = int(0.5 * 1e-4 * ASSUMED_WRITE_BYTES_PER_S / per_token)
    assert shutdown_token_budget(10**9, 1e-4, per_token, None) == assume
    # A measured slow disk shrinks it, a fast one lets the cap decide.
    assert shutdown_token_budget(10**6, 10, 1000, 100.0) == 0
    assert shutdown_token_budget(10**6, 10, 1000, 1e12) == 10**6


def test_a_shutdown_with_no_time_left_saves_nothing(tmp_path):
    saver = Snapshotter(str(tmp_path), 1024, 0, Metrics(), shutdown_timeout=0)
    saver._restored = True
    saver.save_at_shutdown(StandInAsyncEngine(StandInEngine([record(8, seed=1)])))
    assert list_snapshots(tmp_path) == []
    saver.shutdown_timeout = 30
    saver.save_at_shutdown(StandInAsyncEngine(StandInEngine([record(8, seed=1)])))
    assert len(list_snapshots(tmp_path)) == 1
    assert saver.write_bytes_per_s and saver.write_bytes_per_s > 0


def test_the_name_header_is_the_snapshot_directory(tmp_path):
    import httpx
    src = saved(tmp_path / "peer", record(8, seed=1))
    with peer(tmp_path / "peer", []) as url:
        r = httpx.get(url + "/admin/snapshot/latest", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers[NAME_HEADER] == src.name
    assert r.headers["content-type"] == "application/x-tar"
    shutil.rmtree(tmp_path / "peer")
