"""Models from an S3-compatible store (AWS, MinIO, Ceph RGW), through boto3.

boto3 brings the standard credential chain (env, shared files, web identity / IRSA, the
instance role) and AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 for other stores; with no
credentials at all the request goes unsigned (a public bucket). The transfer is ours, kept
small: each object goes to `<file>.incomplete`, is resumed from its size with a Range read
pinned to the listed ETag (If-Match), is checked against its size and — for an object
uploaded in one part, whose ETag is its MD5 — its digest, and is renamed into place; the
folder gets the completion marker (download.py) under the model's lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from preheat.engine.model.download import (
    CHUNK,
    DownloadFailed,
    ModelUnavailable,
    Progress,
    RemoteFile,
    mismatch,
    model_lock,
    read_marker,
    write_marker,
)
from preheat.engine.model.peer_fetch import ModelPeer, try_peer
from preheat.engine.model.uri import S3Model

log = logging.getLogger(__name__)

REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
           "ExpiredToken", "AllAccessDisabled", "403", "401"}
MISSING = {"NoSuchBucket", "NoSuchKey", "404"}


def _display(ref: S3Model) -> str:
    return f"s3://{ref.bucket}/{ref.prefix}"


def local_dir(download_dir: Path, ref: S3Model) -> Path:
    """Where the objects land: <download dir>/s3/<bucket>/<prefix>/ (a GGUF: its folder)."""
    folder = ref.prefix.rsplit("/", 1)[0] if ref.single_object and "/" in ref.prefix else (
        "" if ref.single_object else ref.prefix)
    return download_dir / "s3" / ref.bucket / folder


def client() -> Any:
    import boto3
    import botocore
    from botocore.config import Config

    config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60)
    session = boto3.session.Session()
    if session.get_credentials() is None:
        config = config.merge(Config(signature_version=botocore.UNSIGNED))
    return session.client("s3", config=config)


def fetch(ref: S3Model, download_dir: Path, progress: Progress, s3: Any = None,
          peer: ModelPeer | None = None) -> Path:
    """The local folder (or .gguf file) of the model, downloading what is missing (from
    `peer` first, when given)."""
    import botocore.exceptions as bx

    try:
        return _fetch(ref, download_dir, progress, s3 or client(), peer)
    except bx.ClientError as e:
        err = e.response.get("Error") or {}
        code = str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        if code in MISSING:
            raise ModelUnavailable(f"{_display(ref)}: not found ({code})") from None
        if code in REFUSED:
            raise ModelUnavailable(f"{_display(ref)}: the store refused the credentials ({code}: "
                                   "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
        raise DownloadFailed(f"{_display(ref)}: {code} {err.get('Message', '')}".strip()) from None
    except (bx.EndpointConnectionError, bx.ConnectionError, bx.ReadTimeoutError) as e:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
        raise DownloadFailed(f"{_display(ref)}: {endpoint} could not be reached ({type(e).__name__})") from None


def list_objects(ref: S3Model, s3: Any) -> list[tuple[str, RemoteFile, str]]:
    """(key, file relative to the model folder, ETag) of every object of the model."""
    prefix = ref.prefix if ref.single_object or not ref.prefix else ref.prefix + "/"
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ref.bucket, Prefix=prefix):
        for obj in page.get("Contents") or []:
            key = obj["Key"]
            if key.endswith("/") or (ref.single_object and key != ref.prefix):
                continue
            etag = obj["ETag"].strip('"')
            rel = key.rsplit("/", 1)[-1] if ref.single_object else key[len(prefix):]
            single_part = "-" not in etag and len(etag) == 32
            out.append((key, RemoteFile(rel, int(obj["Size"]), md5=etag if single_part else None), etag))
    if not out:
        raise ModelUnavailable(f"{_display(ref)}: no objects under this prefix")
    return sorted(out, key=lambda o: o[0])


def _fetch(ref: S3Model, download_dir: Path, progress: Progress, s3: Any, peer: ModelPeer | None) -> Path:
    objects = list_objects(ref, s3)
    files = [f for _, f, _ in objects]
    version = hashlib.sha256(repr([(k, f.size, e) for k, f, e in objects]).encode()).hexdigest()
    root = local_dir(download_dir, ref)
    result = root / files[0].path if ref.single_object else root
    total = sum(f.size for f in files)
    if read_marker(download_dir, ref.key, version, root) is not None:
        progress.start(total, total)
        return result
    with model_lock(download_dir, ref.key):
        if read_marker(download_dir, ref.key, version, root) is not None:
            progress.start(total, total)
            return result
        progress.start(total, 0)
        log.info("download: %s: %d objects, %.1f MB, into %s", _display(ref), len(objects), total / 1e6, root)
        # What the peer placed is verified; the loop below checks it again (a stat and a
        # hash, no transfer) and fetches from the store what is still missing.
        try_peer(peer, ref.key, version, files, root, progress, origin="s3")
        done = 0
        for key, f, etag in objects:
            target = root / f.path
            if not (target.is_file() and mismatch(target, f) is None):
                _get(s3, ref, key, etag, target, f, progress, done)
            done += f.size
            progress.advance(done)
        write_marker(download_dir, ref.key, version, files, root=root)
    log.info("download: %s verified and complete", _display(ref))
    return result


def _get(s3: Any, ref: S3Model, key: str, etag: str, target: Path, f: RemoteFile,
         progress: Progress, done_before: int) -> None:
    """One object into place: append to `.incomplete` from where it stopped, check, rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".incomplete")
    have = partial.stat().st_size if partial.exists() else 0
    if have > f.size:
        partial.unlink()
        have = 0
    if have < f.size:
        extra = {"Range": f"bytes={have}-"} if have else {}
        body = s3.get_object(Bucket=ref.bucket, Key=key, IfMatch=etag, **extra)["Body"]
        with partial.open("ab") as out:
            while block := body.read(CHUNK):
                out.write(block)
                have += len(block)
                progress.advance(done_before + have, len(block))
            out.flush()
            os.fsync(out.fileno())
    if (why := mismatch(partial, f)) is not None:
        partial.unlink(missing_ok=True)
        raise DownloadFailed(f"{_display(ref)}: {why}")
    os.replace(partial, target)
