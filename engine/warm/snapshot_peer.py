"""Hot-prefix snapshots between pods, over HTTP: a starting pod fetches the newest snapshot
from a ready peer, so restored prefixes survive scale-ups and failovers on any storage — no
volume shared between pods (the default on ReadWriteOnce-only clusters).

Serving side, `GET /admin/snapshot/latest?max_age=SECONDS`: the snapshot directory as an
uncompressed ustar stream (manifest.json, manifest.hmac and kv-*.safetensors; see
snapshot_transfer.py), its name in the X-Preheat-Snapshot header. The newest snapshot on
disk if it is younger than max_age (default 60 s, at least MIN_SAVE_INTERVAL_S: a peer
cannot make the engine save back to back) and signed under the service's peer secret,
else one saved now (the same code and lock as every save); 404 when nothing is cached. Only
a ready engine answers (503 otherwise); like every /admin/* route, only to the peer secret
(engine/serve/http_auth.py).

Fetching side, fetch_latest(): sends the current peer key, downloads into a temp dir
inside the snapshot directory, taking only plain files a snapshot may hold, within a byte
cap and one total deadline (a peer that trickles bytes is cut off at it), checks the
manifest's HMAC, and renames it into place under the peer's snapshot name. Nothing in it is
trusted: the restore that follows (kv/snapshot.load_latest_snapshot) applies exactly the
checks of a snapshot read from disk, so a tampered, truncated or incompatible snapshot is
refused, metered and the engine warms cold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse

from preheat.engine.peer.peer_http import peer_headers, peer_timeout
from preheat.engine.peer.peer_secret import PeerKeys
from preheat.engine.request.api_errors import APIError
from preheat.engine.warm.snapshot_transfer import END, BadTransfer, Extractor, member_header, padding

log = logging.getLogger(__name__)

PATH = "/admin/snapshot/latest"
NAME_HEADER = "X-Preheat-Snapshot"
DEFAULT_MAX_AGE_S = 60.0
# A snapshot younger than this is always served as it is: a GET with max_age=0 (or a
# POST /admin/snapshot) cannot force one save after another, each pausing decoding.
MIN_SAVE_INTERVAL_S = 10.0
CHUNK = 1 << 20

__all__ = ["BadTransfer", "PeerFetch", "add_snapshot_peer_routes", "extract", "fetch_latest",
           "pick_or_save", "tar_stream"]


# --------------------------------------------------------------------------- serving


def created_seconds(name: str) -> float | None:
    """A snapshot's creation time, from its directory name (snap-<created ns>-...)."""
    parts = name.split("-")
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1]) / 1e9


def _signed(path: Path, keys: PeerKeys | None) -> bool:
    """Whether the snapshot at `path` carries a manifest HMAC under `keys` (True without
    keys: a standalone engine serves nothing, /admin is off, but tests call this)."""
    if keys is None:
        return True
    from preheat.engine.kv.safe_read import open_dir, read_regular
    from preheat.engine.kv.snapshot import MANIFEST, MAX_MANIFEST_BYTES, manifest_signature_problem

    try:
        dfd = open_dir(path)
        try:
            raw = read_regular(MANIFEST, MAX_MANIFEST_BYTES, dir_fd=dfd)
            return manifest_signature_problem(raw, dfd, keys) is None
        finally:
            os.close(dfd)
    except OSError:
        return False


def pick_or_save(snapshotter: Any, aengine: Any, max_age: float,
                 now: Callable[[], float] = time.time) -> Path | None:
    """The newest snapshot on disk if young enough and signed by this service, else a fresh
    one (blocking: run it in a thread). None when nothing is cached and nothing was ever
    saved. Only a snapshot this service signed is ever handed on."""
    from preheat.engine.kv.snapshot import MAX_RESTORE_CANDIDATES, list_snapshots

    keys = snapshotter.keys()
    newest = list_snapshots(snapshotter.directory)[:MAX_RESTORE_CANDIDATES]
    existing = [p for p in newest if _signed(p, keys)]
    if existing:
        created = created_seconds(existing[0].name)
        if created is not None and now() - created <= max(max_age, MIN_SAVE_INTERVAL_S):
            return existing[0]
    saved = snapshotter.save(aengine)
    if saved.path is not None:
        return Path(saved.path)
    return existing[0] if existing else None


def tar_stream(directory: Path) -> Iterator[bytes]:
    """The snapshot's files as a ustar stream. Every file is opened (regular files only,
    kv/safe_read) before the first byte goes out, so a prune that renames and deletes the
    snapshot meanwhile cannot cut it."""
    from preheat.engine.kv.safe_read import UnsafeEntry, open_dir, open_regular
    from preheat.engine.kv.snapshot import is_snapshot_file_name

    files: list[tuple[str, int, int]] = []
    dfd = open_dir(directory)
    try:
        for name in sorted(os.listdir(dfd)):
            if not is_snapshot_file_name(name):
                continue
            try:
                fd, st = open_regular(name, dir_fd=dfd)
            except UnsafeEntry:
                continue  # never sent: the fetching side would refuse the whole transfer
            files.append((name, fd, st.st_size))
    except BaseException:
        for _, fd, _ in files:
            os.close(fd)
        raise
    finally:
        os.close(dfd)
    return _stream_files(files)


def _stream_files(files: list[tuple[str, int, int]]) -> Iterator[bytes]:
    try:
        mtime = int(time.time())
        for name, fd, size in files:
            yield member_header(name, size, mtime)
            left = size
            while left > 0:
                chunk = os.read(fd, min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{name} shrank while being sent")
                left -= len(chunk)
                yield chunk
            if pad := padding(size):
                yield pad
        yield END
    finally:
        for _, fd, _ in files:
            os.close(fd)


def add_snapshot_peer_routes(app: Any, aengine: Any, snapshotter: Any) -> None:
    """The peer route. Who may call it is engine/serve/http_auth.py's business (/admin/*: the
    peer secret only)."""

    @app.get(PATH)
    async def latest_snapshot(request: Request, max_age: float = DEFAULT_MAX_AGE_S) -> Any:
        """Streams the newest hot-prefix snapshot (saved now if none is recent) as a tar,
        for a starting peer to restore (docs/snapshots.md)."""
        if snapshotter is None:
            raise APIError(404, "snapshots are off: start the server with --snapshot-dir",
                           code="snapshots_disabled")
        if aengine.engine is None or not aengine.is_ready:
            raise APIError(503, f"engine is not serving (phase: {aengine.phase})", code="not_ready")
        try:
            path = await asyncio.to_thread(pick_or_save, snapshotter, aengine, max(0.0, max_age))
        except Exception as e:
            log.error("snapshot for a peer failed: %s: %s", type(e).__name__, e)
            raise APIError(500, f"snapshot failed: {type(e).__name__}", code="snapshot_failed") from None
        if path is None:
            raise APIError(404, "nothing cached yet: no snapshot to give", code="no_snapshot")
        stream = tar_stream(path)
        log.info("snapshot %s sent to a peer", path.name)
        return StreamingResponse(stream, media_type="application/x-tar",
                                 headers={NAME_HEADER: path.name})


# --------------------------------------------------------------------------- fetching


@dataclass(frozen=True)
class PeerFetch:
    result: str  # fetched | present | none | unreachable | refused | timeout | error
    path: Path | None = None
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""
    reason: str | None = None  # a REJECT_REASONS value when the snapshot itself was refused


def extract(chunks: Any, into: Path, max_bytes: int) -> int:
    """Writes a ustar stream's members (an iterable of chunks) into `into`: regular files
    with a snapshot file's name only, each at most once, max_bytes in all. Returns bytes
    written; raises BadTransfer."""
    from preheat.engine.kv.snapshot import is_snapshot_file_name

    extractor = Extractor(into, is_snapshot_file_name, max_bytes)
    for chunk in chunks:
        extractor.feed(chunk)
    return extractor.close()


def fetch_latest(peer_url: str, directory: str | os.PathLike, *, keys: PeerKeys | None = None,
                 timeout: float = 60.0, max_bytes: int = 64 << 30) -> PeerFetch:
    """Fetches the peer's newest snapshot into `directory`, all of it within `timeout`
    seconds. Never raises: a peer that is not there (the first pod of a service), says no,
    is too slow or sends garbage is a result, and the engine warms from what it has. Runs
    its own event loop: call it from a thread (the restore runs in one)."""
    started = time.monotonic()
    took = lambda: time.monotonic() - started  # noqa: E731
    try:
        return asyncio.run(asyncio.wait_for(
            _fetch(peer_url, Path(directory), keys, timeout, max_bytes, took), timeout))
    except (TimeoutError, asyncio.TimeoutError):
        return PeerFetch("timeout", seconds=took(), detail=f"no whole snapshot within {timeout:g}s")


async def _fetch(peer_url: str, root: Path, keys: PeerKeys | None, timeout: float,
                 max_bytes: int, took: Callable[[], float]) -> PeerFetch:
    from preheat.engine.kv.snapshot import is_snapshot_file_name, is_snapshot_name

    headers = peer_headers(keys)
    url = peer_url.rstrip("/") + PATH
    tmp: Path | None = None
    try:
        async with httpx.AsyncClient(timeout=peer_timeout(timeout)) as c, \
                c.stream("GET", url, headers=headers) as resp:
            if resp.status_code in (404, 503):
                return PeerFetch("none", seconds=took(), detail=f"peer answered {resp.status_code}")
            if resp.status_code != 200:
                return PeerFetch("error", seconds=took(), detail=f"peer answered {resp.status_code}")
            name = resp.headers.get(NAME_HEADER, "")
            if not is_snapshot_name(name):
                return PeerFetch("refused", seconds=took(), detail=f"bad snapshot name {name!r}")
            final = root / name
            if final.exists():
                return PeerFetch("present", final, seconds=took())
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".tmp-peer-{secrets.token_hex(4)}"
            tmp.mkdir()
            extractor = Extractor(tmp, is_snapshot_file_name, max_bytes)
            async for chunk in resp.aiter_raw(CHUNK):
                extractor.feed(chunk)
            size = extractor.close()
        if keys is not None and not _signed(tmp, keys):
            return PeerFetch("refused", seconds=took(), reason="bad_signature",
                             detail="the peer's snapshot is not signed under this service's peer secret")
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        tmp = None
    except BadTransfer as e:
        return PeerFetch("refused", seconds=took(), detail=str(e))
    except httpx.HTTPError as e:
        return PeerFetch("unreachable", seconds=took(), detail=f"{type(e).__name__}: {e}")
    except OSError as e:
        return PeerFetch("error", seconds=took(), detail=f"{type(e).__name__}: {e}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return PeerFetch("fetched", final, size, took())
