"""Fetching side of model files between pods (engine/model/peer_serve.py serves them): a
starting engine asks a Ready peer of its service for the model before asking the hub or
the bucket, and uses the source when no peer answers or a file does not verify.

Nothing from the peer is trusted but bytes: the files to take, their sizes and digests are
the SOURCE's listing (the hub's tree at the resolved commit, the bucket's listing — cheap
metadata calls the download makes anyway); the peer's listing must name the same version
and the same files, sizes and digests, or it is refused. Each file is streamed into a temp
file beside its place, at most its listed size, within one deadline for the whole fetch,
hashed on the way (sha256, compared with the listed sha256) or after (the git blob id, the
S3 MD5), fsynced and renamed into place. The completion marker is written by the caller,
after every file is there and verified — as for a download from the source.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from preheat.engine.model.download import CHUNK, Progress, RemoteFile, mismatch
from preheat.engine.model.peer_serve import FILE_PATH, FILES_PATH
from preheat.engine.peer.peer_http import peer_headers, peer_timeout
from preheat.engine.peer.peer_secret import PeerKeys

log = logging.getLogger(__name__)

MAX_LISTING_BYTES = 4 << 20
DIGESTS = ("sha256", "git_sha1", "md5")


@dataclass(frozen=True)
class ModelPeer:
    url: str  # --model-peer-url
    keys: Callable[[], PeerKeys | None]  # the current peer keys (re-read as the Secret rotates)
    timeout: float = 900.0  # the whole fetch


@dataclass(frozen=True)
class PeerResult:
    result: str  # fetched | none | unreachable | refused | timeout | error
    bytes: int = 0
    detail: str = ""


class _NoPeerModel(Exception):
    """The peer answered but has no complete download of this model (yet)."""


class _Refused(Exception):
    """The peer sent something other than what the source lists."""


class _Deadline(Exception):
    pass


def listing_problem(peer: Any, version: str, files: list[RemoteFile]) -> str | None:
    """Why the peer's listing is not the source's (None: it is). Pure."""
    if not isinstance(peer, dict) or not isinstance(peer.get("files"), list):
        return "not a listing"
    if peer.get("version") != version:
        return f"the peer has version {str(peer.get('version'))[:16]!r}, the source {version[:16]!r}"
    theirs = {f.get("path"): f for f in peer["files"] if isinstance(f, dict)}
    if set(theirs) != {f.path for f in files}:
        return "the peer lists other files than the source"
    for f in files:
        t = theirs[f.path]
        if t.get("size") != f.size:
            return f"{f.path}: the peer lists {t.get('size')} bytes, the source {f.size}"
        for d in DIGESTS:
            if getattr(f, d) and t.get(d) and t[d] != getattr(f, d):
                return f"{f.path}: the peer's {d} is not the source's"
    return None


def fetch_from_peer(peer: ModelPeer, key: str, version: str, files: list[RemoteFile],
                    root: Path, progress: Progress) -> PeerResult:
    """Places every file of `files` under `root` from the peer, verified; never raises.
    Files placed before a failure are verified ones (the source download keeps them)."""
    deadline = time.monotonic() + peer.timeout
    done = 0
    try:
        with httpx.Client(headers=peer_headers(peer.keys())) as client:
            _check_listing(client, peer, key, version, files, deadline)
            progress.source = "peer"
            for f in files:
                _fetch_file(client, peer, key, f, root / f.path, deadline, progress, done)
                done += f.size
    except _Refused as e:
        return PeerResult("refused", done, str(e))
    except _Deadline:
        return PeerResult("timeout", done, f"not every file within {peer.timeout:g}s")
    except _NoPeerModel as e:
        return PeerResult("none", 0, str(e))
    except httpx.TimeoutException as e:
        return PeerResult("timeout", done, type(e).__name__)
    except httpx.HTTPError as e:
        return PeerResult("unreachable", done, f"{type(e).__name__}: {e}")
    except OSError as e:
        return PeerResult("error", done, f"{type(e).__name__}: {e}")
    return PeerResult("fetched", done)


def _left(deadline: float) -> httpx.Timeout:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Deadline()
    return peer_timeout(left)


def _check_listing(client: httpx.Client, peer: ModelPeer, key: str, version: str,
                   files: list[RemoteFile], deadline: float) -> None:
    url = peer.url.rstrip("/") + FILES_PATH
    with client.stream("GET", url, params={"key": key}, timeout=_left(deadline)) as resp:
        if resp.status_code in (404, 503):
            raise _NoPeerModel(f"peer answered {resp.status_code}")
        if resp.status_code != 200:
            raise _Refused(f"peer answered {resp.status_code} to the listing")
        body = bytearray()
        for chunk in resp.iter_raw():
            body += chunk
            if len(body) > MAX_LISTING_BYTES:
                raise _Refused("the listing is too large")
            _left(deadline)
    try:
        listed = json.loads(bytes(body))
    except ValueError:
        raise _Refused("the listing is not JSON") from None
    if (why := listing_problem(listed, version, files)) is not None:
        raise _Refused(why)


def _fetch_file(client: httpx.Client, peer: ModelPeer, key: str, f: RemoteFile, target: Path,
                deadline: float, progress: Progress, done_before: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.peer-{secrets.token_hex(4)}")
    url = peer.url.rstrip("/") + FILE_PATH
    try:
        sha = hashlib.sha256()
        have = 0
        with client.stream("GET", url, params={"key": key, "path": f.path},
                           timeout=_left(deadline)) as resp, tmp.open("wb") as out:
            if resp.status_code != 200:
                raise _Refused(f"{f.path}: peer answered {resp.status_code}")
            for chunk in resp.iter_raw(CHUNK):
                have += len(chunk)
                if have > f.size:
                    raise _Refused(f"{f.path}: the peer sent more than the {f.size} bytes listed")
                out.write(chunk)
                sha.update(chunk)
                progress.advance(done_before + have, len(chunk))
                _left(deadline)
            out.flush()
            os.fsync(out.fileno())
        if have != f.size:
            raise _Refused(f"{f.path}: the peer sent {have} of {f.size} bytes")
        if f.sha256:
            if sha.hexdigest() != f.sha256:
                raise _Refused(f"{f.path}: sha256 {sha.hexdigest()}, the source says {f.sha256}")
        elif (why := mismatch(tmp, f)) is not None:
            raise _Refused(why)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def try_peer(peer: ModelPeer | None, key: str, version: str, files: list[RemoteFile],
             root: Path, progress: Progress, origin: str) -> bool:
    """True when every file came from the peer, verified; else the caller downloads what is
    missing from `origin` (the progress then says so)."""
    if peer is None:
        progress.source = origin
        return False
    got = fetch_from_peer(peer, key, version, files, root, progress)
    if got.result == "fetched":
        log.info("download: %s: %d files, %.1f MB from the peer %s", key, len(files),
                 got.bytes / 1e6, peer.url)
        return True
    log.info("download: %s: no model from the peer (%s: %s); using the %s", key, got.result,
             got.detail, origin)
    progress.source = origin
    return False
