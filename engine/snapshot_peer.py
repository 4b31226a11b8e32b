"""Hot-prefix snapshots between pods, over HTTP: a starting pod fetches the newest snapshot
from a ready peer, so restored prefixes survive scale-ups and failovers on any storage — no
volume shared between pods (the default on ReadWriteOnce-only clusters).

Serving side, `GET /admin/snapshot/latest?max_age=SECONDS`: the snapshot directory as an
uncompressed tar (manifest.json and kv-*.safetensors), its name in the X-Preheat-Snapshot
header. The newest snapshot on disk if it is younger than max_age (default 60 s), else one
saved now (the same code and lock as every save); 404 when nothing is cached. Only a ready
engine answers (503 otherwise); with an API key set, the request must carry it.

Fetching side, fetch_latest(): downloads into a temp dir inside the snapshot directory,
taking only plain files a snapshot may hold, within a byte cap and a deadline, and renames
it into place under the peer's snapshot name. Nothing in it is trusted: the restore that
follows (kv/snapshot.load_latest_snapshot) applies exactly the checks of a snapshot read
from disk, so a tampered, truncated or incompatible snapshot is refused, metered and the
engine warms cold.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse

from preheat.engine.api_errors import APIError

log = logging.getLogger(__name__)

PATH = "/admin/snapshot/latest"
NAME_HEADER = "X-Preheat-Snapshot"
DEFAULT_MAX_AGE_S = 60.0
CHUNK = 1 << 20


# --------------------------------------------------------------------------- serving


def created_seconds(name: str) -> float | None:
    """A snapshot's creation time, from its directory name (snap-<created ns>-...)."""
    parts = name.split("-")
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1]) / 1e9


def pick_or_save(snapshotter: Any, aengine: Any, max_age: float,
                 now: Callable[[], float] = time.time) -> Path | None:
    """The newest snapshot on disk if young enough, else a fresh one (blocking: run it in a
    thread). None when nothing is cached and nothing was ever saved."""
    from preheat.engine.kv.snapshot import list_snapshots

    existing = list_snapshots(snapshotter.directory)
    if existing:
        created = created_seconds(existing[0].name)
        if created is not None and now() - created <= max_age:
            return existing[0]
    saved = snapshotter.save(aengine)
    if saved.path is not None:
        return Path(saved.path)
    return existing[0] if existing else None


def tar_stream(directory: Path) -> Iterator[bytes]:
    """The snapshot's files as a tar, streamed. Every file is opened before the first byte
    goes out, so a prune that renames and deletes the snapshot meanwhile cannot cut it."""
    from preheat.engine.kv.snapshot import is_snapshot_file_name

    files = []
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if is_snapshot_file_name(name) and path.is_file() and not path.is_symlink():
            files.append((name, open(path, "rb")))
    try:
        for name, f in files:
            info = tarfile.TarInfo(name)
            info.size = os.fstat(f.fileno()).st_size
            info.mtime = int(time.time())
            info.mode = 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            left = info.size
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{name} shrank while being sent")
                left -= len(chunk)
                yield chunk
            pad = -info.size % tarfile.BLOCKSIZE
            if pad:
                yield b"\0" * pad
        yield b"\0" * (2 * tarfile.BLOCKSIZE)
    finally:
        for _, f in files:
            f.close()


def add_snapshot_peer_routes(app: Any, aengine: Any, snapshotter: Any,
                             check_auth: Callable[[Any], None]) -> None:
    @app.get(PATH)
    async def latest_snapshot(request: Request, max_age: float = DEFAULT_MAX_AGE_S) -> Any:
        """Streams the newest hot-prefix snapshot (saved now if none is recent) as a tar,
        for a starting peer to restore (docs/snapshots.md)."""
        check_auth(request)
        if snapshotter is None:
            raise APIError(404, "snapshots are off: start the server with --snapshot-dir",
                           code="snapshots_disabled")
        if aengine.engine is None or not aengine.is_ready:
            raise APIError(503, f"engine is not serving (phase: {aengine.phase})", code="not_ready")
        try:
            path = await asyncio.to_thread(pick_or_save, snapshotter, aengine, max(0.0, max_age))
        except Exception as e:
            log.error("snapshot for a peer failed: %s: %s", type(e).__name__, e)
            raise APIError(500, f"snapshot failed: {type(e).__name__}: {e}",
                           code="snapshot_failed") from None
        if path is None:
            raise APIError(404, "nothing cached yet: no snapshot to give", code="no_snapshot")
        stream = tar_stream(path)
        log.info("snapshot %s sent to a peer", path.name)
        return StreamingResponse(stream, media_type="application/x-tar",
                                 headers={NAME_HEADER: path.name})


# --------------------------------------------------------------------------- fetching


@dataclass(frozen=True)
class PeerFetch:
    result: str  # fetched | present | none | unreachable | refused | error
    path: Path | None = None
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""


class BadTransfer(ValueError):
    """The peer sent something that is not a snapshot directory's files."""


class _ChunkReader(io.RawIOBase):
    """A file object over an iterator of byte chunks (tarfile reads a stream from it)."""

    def __init__(self, chunks: Iterable[bytes], deadline: float) -> None:
        self._it = iter(chunks)
        self._buf = b""
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            if time.monotonic() > self._deadline:
                raise BadTransfer("deadline passed while downloading")
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def extract(chunks: Iterable[bytes], into: Path, max_bytes: int, deadline: float) -> int:
    """Writes the tar's members into `into`: regular files with a snapshot file's name only,
    each at most once, max_bytes in all. Returns bytes written; raises BadTransfer."""
    from preheat.engine.kv.snapshot import is_snapshot_file_name

    total = 0
    reader = io.BufferedReader(_ChunkReader(chunks, deadline), CHUNK)
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            for member in tar:
                if not member.isreg() or not is_snapshot_file_name(member.name):
                    raise BadTransfer(f"unexpected member {member.name!r}")
                total += member.size
                if total > max_bytes:
                    raise BadTransfer(f"more than {max_bytes} bytes")
                source = tar.extractfile(member)
                assert source is not None
                with open(into / member.name, "xb") as out:  # a repeated name fails here
                    shutil.copyfileobj(source, out, CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
    except (tarfile.TarError, FileExistsError, EOFError) as e:
        raise BadTransfer(f"not a valid transfer: {e}") from None
    return total


def fetch_latest(peer_url: str, directory: str | os.PathLike, *, api_key: str | None = None,
                 timeout: float = 60.0, max_bytes: int = 64 << 30) -> PeerFetch:
    """Fetches the peer's newest snapshot into `directory`. Never raises: a peer that is not
    there (the first pod of a service), says no, or sends garbage is a result, and the
    engine warms from what it has."""
    from preheat.engine.kv.snapshot import is_snapshot_name

    started = time.monotonic()
    deadline = started + timeout
    root = Path(directory)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = peer_url.rstrip("/") + PATH
    took = lambda: time.monotonic() - started  # noqa: E731
    try:
        with httpx.Client(timeout=httpx.Timeout(min(timeout, 30.0), connect=min(timeout, 3.0))) as c, \
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
            try:
                size = extract(resp.iter_bytes(CHUNK), tmp, max_bytes, deadline)
                fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except BadTransfer as e:
        return PeerFetch("refused", seconds=took(), detail=str(e))
    except httpx.HTTPError as e:
        return PeerFetch("unreachable", seconds=took(), detail=f"{type(e).__name__}: {e}")
    except OSError as e:
        return PeerFetch("error", seconds=took(), detail=f"{type(e).__name__}: {e}")
    return PeerFetch("fetched", final, size, took())
