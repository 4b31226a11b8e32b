"""What every model download shares, whatever the source (hub.py, s3.py).

- errors: ModelUnavailable (the model does not exist or the credentials were refused: a
  restart will not help, the process ends with a message naming the model and why) and
  DownloadFailed (the source could not be reached or sent something else than it
  published: the next start tries again);
- a lock per model in the download dir, so pods sharing the dir (a ReadWriteMany claim, a
  node's hostPath) download once: the others wait, then find it complete;
- verification once, against the sizes and hashes the source publishes, then a completion
  marker; a restart that finds the marker (and every file at its size) neither downloads
  nor hashes;
- progress (bytes done / total) for /ready and the bytes counter.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK = 1 << 20
STATE_DIR = ".preheat"  # inside the download dir: locks/ and complete/


class ModelUnavailable(RuntimeError):
    """The model does not exist at its source, or the source refused the credentials."""


class DownloadFailed(RuntimeError):
    """The source could not be reached, or a file did not match what the source published."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model as its source publishes it; the digests are those it gives."""
    path: str  # relative to the model's folder
    size: int
    sha256: str | None = None  # hub LFS files
    git_sha1: str | None = None  # hub files kept in git (the blob id)
    md5: str | None = None  # S3 objects uploaded in one part (their ETag)


def default_download_dir(weight_cache_dir: str | None, environ: dict[str, str] | None = None) -> Path:
    """--download-dir when not given: the hub cache when HF_HUB_CACHE (or HF_HOME) says where
    it is, so files other tools downloaded are reused; else <weight cache>/downloads."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    from preheat.engine.model.locations import default_weight_cache_dir

    base = Path(weight_cache_dir) if weight_cache_dir and weight_cache_dir != "off" else default_weight_cache_dir()
    return base / "downloads"


class Progress:
    """Bytes of the model present on disk out of its total; `fetched` counts the bytes this
    process itself brought over the network (the metric). Thread-safe: the download thread
    writes, /ready reads."""

    def __init__(self, on_fetched: Callable[[int], None] | None = None) -> None:
        self._lock = threading.Lock()
        self.bytes_total = 0
        self.bytes_done = 0
        self.fetched = 0
        self.source = ""  # where the bytes come from now: "peer", or the origin ("hub", "s3")
        self._on_fetched = on_fetched

    def start(self, total: int, done: int) -> None:
        with self._lock:
            self.bytes_total, self.bytes_done = total, done

    def advance(self, done: int, fetched: int = 0) -> None:
        with self._lock:
            self.bytes_done = min(max(done, self.bytes_done), self.bytes_total or done)
            self.fetched += fetched
        if fetched and self._on_fetched is not None:
            self._on_fetched(fetched)

    def as_dict(self) -> dict[str, int | str]:
        with self._lock:
            out: dict[str, int | str] = {"bytes_done": self.bytes_done, "bytes_total": self.bytes_total}
            if self.source:
                out["source"] = self.source
            return out


@contextlib.contextmanager
def watch_disk(progress: Progress, measure: Callable[[], int], counting: bool,
               period_s: float = 0.25) -> Iterator[None]:
    """Polls `measure()` (bytes of the model on disk, finished and partial files) while the
    body runs — for a library (huggingface_hub) that writes the files itself. Growth counts
    as fetched only when `counting` (this process holds the lock and so is the writer)."""
    stop = threading.Event()
    last = [measure()]

    def poll() -> None:
        while not stop.wait(period_s):
            now = measure()
            progress.advance(now, max(0, now - last[0]) if counting else 0)
            last[0] = max(last[0], now)

    thread = threading.Thread(target=poll, name="download-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        now = measure()
        progress.advance(now, max(0, now - last[0]) if counting else 0)


@contextlib.contextmanager
def model_lock(download_dir: Path, key: str) -> Iterator[None]:
    """An exclusive lock on one model in the download dir (flock: released if the holder
    dies; works on NFS v4 and node-local disks)."""
    from filelock import FileLock, Timeout

    locks = download_dir / STATE_DIR / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("download: %s is being downloaded by another process; waiting for it", key)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _marker_path(download_dir: Path, key: str) -> Path:
    return download_dir / STATE_DIR / "complete" / f"{key}.json"


def read_marker(download_dir: Path, key: str, version: str, root: Path) -> list[RemoteFile] | None:
    """The files of a complete, verified download of `version` under `root`, or None. Only
    sizes are checked (a stat, no hashing): the files were hashed when the marker was written."""
    try:
        data = json.loads(_marker_path(download_dir, key).read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != version:
        return None
    files = [RemoteFile(**f) for f in data.get("files") or []]
    for f in files:
        try:
            if (root / f.path).stat().st_size != f.size:
                return None
        except OSError:
            return None
    return files


@dataclass(frozen=True)
class CompleteDownload:
    """A marker as a peer serves it (engine/model/peer_serve.py): the version, the folder the
    files are in and the files with the digests their source published."""
    version: str
    root: Path
    files: list[RemoteFile]


def read_complete(download_dir: Path, key: str) -> CompleteDownload | None:
    """The complete download of `key`, whatever its version, or None (no marker, a marker
    from before it recorded its folder, or a file no longer at its size)."""
    try:
        data = json.loads(_marker_path(download_dir, key).read_text())
        version, root = str(data["version"]), Path(data["root"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = read_marker(download_dir, key, version, root)
    return None if files is None else CompleteDownload(version, root, files)


def write_marker(download_dir: Path, key: str, version: str, files: list[RemoteFile],
                 root: Path | None = None) -> None:
    """`root`: the folder the files are in, so a peer can serve them (read_complete)."""
    path = _marker_path(download_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    record = {"version": version, "created": time.time(), "files": [asdict(f) for f in files]}
    if root is not None:
        record["root"] = str(root)
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def mismatch(path: Path, f: RemoteFile) -> str | None:
    """Why the file at `path` is not the one the source published (None: it is)."""
    size = path.stat().st_size
    if size != f.size:
        return f"{f.path}: {size} bytes, the source says {f.size}"
    if f.sha256:
        h, want = hashlib.sha256(), f.sha256
    elif f.git_sha1:
        h, want = hashlib.sha1(f"blob {size}\0".encode()), f.git_sha1  # git's blob id
    elif f.md5:
        h, want = hashlib.md5(), f.md5
    else:
        return None
    with path.open("rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    got = h.hexdigest()
    return None if got == want else f"{f.path}: digest {got}, the source says {want}"
