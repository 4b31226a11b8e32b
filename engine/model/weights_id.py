"""The identity of a model's weights, as snapshots fingerprint it (`model_id`).

A snapshot's KV is only valid for the exact weights that computed it. Two fine-tunes of one
base share every shape and often their leading tensors (the embeddings), so the identity is
a sha256 over the FULL weight files: hashing a prefix of each file (what was done before)
let a fine-tune restore its base model's KV. Hashing gigabytes takes seconds, so it is done
once and the result kept in a small JSON file in the weight cache, where the converted
weights live (or, with the cache off, beside the weights), valid while the files' names,
sizes and modification times stay the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def full_digest(files: list[Path]) -> str:
    """"sha256:<hex>" over every byte of the files: one file's digest is its bytes' (so a
    GGUF keeps the id it always had), several files' is over their names and digests."""
    files = sorted(files, key=lambda f: f.name)
    if len(files) == 1:
        return "sha256:" + file_digest(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_digest(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def _signature(files: list[Path]) -> list[list]:
    out = []
    for f in sorted(files, key=lambda f: f.name):
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def sidecar_path(files: list[Path], cache_root: Path) -> Path:
    """Where the id of these files is kept: in the weight cache, beside the converted
    weights, keyed by the files' real location (a model directory is never written to)."""
    folder = Path(files[0]).parent.resolve()
    name = hashlib.sha256(str(folder).encode()).hexdigest()[:32]
    return cache_root / "weights-ids" / f"{name}-{Path(files[0]).name}.json"


def weights_id(files: list[Path], cache_root: Path | None = None) -> str:
    """The full-content digest of the weight files, read from the weight cache when an
    earlier start computed it and the files have not changed since, else computed (and
    kept there). With no weight cache (`--weight-cache-dir off`) it is computed at every
    start."""
    files = [Path(f) for f in files]
    if cache_root is None:
        return full_digest(files)
    signature = _signature(files)
    place = sidecar_path(files, cache_root)
    try:
        data = json.loads(place.read_text())
        if data.get("format") == FORMAT and data.get("files") == signature:
            return str(data["weights_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    digest = full_digest(files)
    if not write_atomically(place, json.dumps({"format": FORMAT, "files": signature, "weights_id": digest})):
        log.info("weights: cannot keep the weights id in %s; it is hashed again at every start", place.parent)
    return digest


def write_atomically(place: Path, text: str) -> bool:
    """Writes a small sidecar atomically (temp file + rename: readers on a shared volume see
    all or none); False when it cannot be written (the caller recomputes next time)."""
    try:
        place.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=place.parent)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, place)
        return True
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False


def write_entry(target: Path, fill: Callable[[Path], None], replace_unusable: bool = False) -> None:
    """Writes a cache entry (a directory that `fill(tmp)` fills, a DONE file last) next to
    `target` and renames it into place, so a crash or a concurrent writer never leaves a
    half-written entry that looks complete. The cache may sit on a volume shared by many pods
    that start together: a complete entry that appeared meanwhile is kept (another pod may be
    reading it), unless this process found it unusable (`replace_unusable`); an incomplete one
    is replaced. Raises what writing raises (OSError), after removing its temp dir."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        fill(tmp)
        if (target / "DONE").is_file() and not replace_unusable:
            shutil.rmtree(tmp, ignore_errors=True)  # another writer finished first
            return
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "DONE").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost the rename race to a complete entry
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
