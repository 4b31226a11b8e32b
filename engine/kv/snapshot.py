"""Hot-prefix KV snapshots: save to and restore from a directory shared by a service's pods.

Layout of the snapshot root (format in docs/snapshots.md):

    <root>/snap-<created_ns:020d>-<writer>-<rand>/manifest.json
    <root>/snap-.../manifest.hmac                 HMAC of manifest.json under the peer secret
    <root>/snap-.../kv-00000.safetensors          KV of one or more prefixes
    <root>/.tmp-<writer>-<rand>/                  a snapshot being written (never read)
    <root>/.trash-<rand>/                         an old snapshot being deleted (never read)

A snapshot is untrusted input: the volume is shared, pods crash mid-write, disks flip bits,
and a model upgrade leaves old snapshots behind. So it is never unpickled (JSON + safetensors
only), every byte that is used is checked against the manifest and its sha256, the
manifest itself against its HMAC when the service has a peer secret (so only the
service's own engines can write what another restores), every file is opened through
kv/safe_read (regular files only, bounded reads), and every problem becomes a `Rejection`
with a machine-readable reason — never an exception — so the engine warms cold and still
turns ready.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from preheat.engine.dtypes import KV_DTYPES, SAFETENSORS_CODES, dtype_name
from preheat.engine.kv.checksum import tensor_sha256, tensors_sha256
from preheat.engine.kv.safe_read import TooLarge, UnsafeEntry, fd_path, open_dir, open_regular, read_regular
from preheat.engine.peer.peer_secret import PeerKeys

log = logging.getLogger(__name__)

FORMAT = "preheat-kv-snapshot"
FORMAT_VERSION = 2  # 2: a prefix may store only the KV after an earlier prefix (kv_start)
MANIFEST = "manifest.json"
SIGNATURE = "manifest.hmac"  # {"alg": "hmac-sha256", "mac": hex} over manifest.json's bytes
DEFAULT_KEEP = 3
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_SIGNATURE_BYTES = 1024
# A name dated later than now + this is ignored (a writer's clock may run a little ahead):
# it would otherwise stay "the newest" and be tried first forever.
FUTURE_SKEW_SECONDS = 300.0
# Snapshots one restore reads at most before warming cold: each refused one costs a read.
MAX_RESTORE_CANDIDATES = 4
# A model fingerprint no pod has saved for this long is dropped whole by pruning (a
# rollout to new weights leaves the old model's snapshots behind otherwise, forever).
STALE_FINGERPRINT_SECONDS = 7 * 86400.0
DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024  # few files (few fsyncs on NFS), none huge
STALE_TEMP_SECONDS = 3600.0  # a temp dir this old belongs to a writer that died
# How long a restore may take to read the snapshot it chose. A snapshot superseded less than
# this long ago may still be being read by a pod that listed it while it was the newest, so
# pruning leaves it until then (a reader used to see manifest_missing / file_missing).
RESTORE_GRACE_SECONDS = 600.0

# Machine-readable reasons, the label values of preheat_snapshot_rejected_total{reason}.
REJECT_REASONS = (
    "manifest_missing",     # no manifest.json in the snapshot directory
    "manifest_unparsable",  # not JSON, or not a JSON object
    "unknown_version",      # a format version this engine does not read
    "manifest_invalid",     # fields missing / wrong types / inconsistent (e.g. pages vs tokens)
    "fingerprint_mismatch", # another model, dtype, page size or tokenizer
    "unsafe_path",          # a file name escaping the directory, a symlink, a non-regular file
    "file_missing",         # a tensor file the manifest lists is absent
    "truncated",            # a tensor file is shorter than the manifest says
    "size_mismatch",        # a file longer than declared, or a tensor's shape/dtype differs
    "unreadable",           # safetensors refuses the file (corrupt header)
    "checksum_mismatch",    # the tensor bytes do not hash to the manifest's sha256
    "io_error",             # the filesystem failed while reading
    "unsigned",             # a peer secret is set and the snapshot has no manifest.hmac
    "bad_signature",        # manifest.hmac does not verify under any peer key
    "future_dated",         # its name is dated after now + FUTURE_SKEW_SECONDS: ignored
    "peer_pinned",          # pinned prefixes from another pod: restored, but not pinned
)  # fmt: skip

_SNAPSHOT_NAME = re.compile(r"^snap-(\d{20})-([A-Za-z0-9_.-]{1,64})-([0-9a-f]{8})$")
_TENSOR_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}\.safetensors$")


def is_snapshot_name(name: str) -> bool:
    """A complete snapshot directory's name (what list_snapshots reads)."""
    return bool(_SNAPSHOT_NAME.match(name))


def is_snapshot_file_name(name: str) -> bool:
    """A file a snapshot directory may hold: the manifest, its signature or a plainly named
    tensor file."""
    return name in (MANIFEST, SIGNATURE) or bool(_TENSOR_FILE.match(name))


# --------------------------------------------------------------------------- records


@dataclass
class PrefixRecord:
    """A hot prefix (docs/engine-internals.md). len(token_ids) is a multiple of the page size.
    kv holds tokens [kv_start, len(token_ids)): [num_layers, 2, n - kv_start, kvh, hd]. A
    record with kv_start > 0 extends an earlier record of the same snapshot whose tokens are
    its first kv_start tokens, so a shared system prompt is stored once, not once per leaf."""

    token_ids: list[int]
    kv: torch.Tensor
    hits: int = 0
    pinned: bool = False
    kv_start: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stored_tokens(self) -> int:
        return len(self.token_ids) - self.kv_start


@dataclass(frozen=True)
class Rejection:
    path: str
    reason: str  # one of REJECT_REASONS
    detail: str


@dataclass
class LoadResult:
    records: list[PrefixRecord] = field(default_factory=list)
    path: Path | None = None  # the snapshot restored, None when none was usable
    rejected: list[Rejection] = field(default_factory=list)
    writer_id: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of KV restored (a shared prefix counts once)."""
        return sum(r.stored_tokens for r in self.records)


# --------------------------------------------------------------------------- fingerprint


def tokenizer_hash(
    vocab: Mapping[str, int],
    *,
    merges: Sequence[Any] | None = None,
    special_tokens: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> str:
    """sha256 over what decides token ids: the vocabulary, BPE merges when known, special
    tokens (bos/eos/pad...) and the chat template (it decides the ids of a chat prefix)."""
    doc = {
        "vocab": sorted((str(k), int(v)) for k, v in vocab.items()),
        "merges": [list(m) if isinstance(m, (list, tuple)) else str(m) for m in merges] if merges else None,
        "special": {str(k): v for k, v in sorted((special_tokens or {}).items())},
        "chat_template": chat_template,
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def model_fingerprint(
    *,
    architecture: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str | torch.dtype,
    page_size: int,
    tokenizer_hash: str,
    model_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """What must match for a snapshot's KV to be valid here. `dtype` is the KV cache dtype.
    `model_id` should identify the weights (e.g. the weight-cache source hash): two fine-tunes
    of one architecture share every shape but not their KV. `extra` (JSON values) is compared
    too, e.g. fp8 KV scales."""
    fp = {
        "architecture": str(architecture),
        "num_layers": int(num_layers),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "dtype": dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype),
        "page_size": int(page_size),
        "tokenizer_hash": str(tokenizer_hash),
        "model_id": model_id,
        **extra,
    }
    if fp["dtype"] not in KV_DTYPES:
        raise ValueError(f"unsupported KV dtype for snapshots: {fp['dtype']}")
    return json.loads(json.dumps(fp))  # normalise to what a manifest round-trip gives


def fingerprint_from_hf_config(
    config: Mapping[str, Any], *, dtype: str | torch.dtype, page_size: int, tokenizer_hash: str,
    model_id: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """model_fingerprint from a Hugging Face config.json dict (Llama-family key names)."""
    heads = int(config["num_attention_heads"])
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    return model_fingerprint(
        architecture=str(archs[0]),
        num_layers=int(config["num_hidden_layers"]),
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        dtype=dtype, page_size=page_size, tokenizer_hash=tokenizer_hash, model_id=model_id,
    )  # fmt: skip


def fingerprint_difference(expected: Mapping[str, Any], actual: Any) -> str | None:
    """None when equal, else a short description of the first difference (for the log)."""
    if not isinstance(actual, dict):
        return "fingerprint is not an object"
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key) != actual.get(key):
            return f"{key}: snapshot has {actual.get(key)!r}, this engine {expected.get(key)!r}"
    return None


def expected_kv_shape(fingerprint: Mapping[str, Any], n_tokens: int) -> list[int]:
    return [fingerprint["num_layers"], 2, n_tokens, fingerprint["num_kv_heads"], fingerprint["head_dim"]]


# --------------------------------------------------------------------------- selection

_R = TypeVar("_R")


def choose_records(records: Iterable[_R], max_tokens: int | None, *, tokens=None, pinned=None, score=None) -> list[_R]:
    """Pinned first, then highest `score` (default: hits; the engine passes hits x recency),
    greedily within `max_tokens`; a prefix that does not fit is skipped and smaller ones may
    still fit. Stable: equal scores keep the caller's order. Works on PrefixRecords or on
    manifest entries (pass the accessors)."""
    tokens = tokens or (lambda r: r.num_tokens)
    pinned = pinned or (lambda r: r.pinned)
    score = score or (lambda r: r.hits)
    ordered = sorted(records, key=lambda r: (not pinned(r), -score(r)))
    if max_tokens is None:
        return ordered
    out, used = [], 0
    for r in ordered:
        if used + tokens(r) <= max_tokens:
            out.append(r)
            used += tokens(r)
    return out


def _extends_earlier(token_ids: Sequence[int], kv_start: int, earlier: Iterable[Sequence[int]]) -> bool:
    head = list(token_ids[:kv_start])
    return any(len(t) >= kv_start and list(t[:kv_start]) == head for t in earlier)


def choose_restorable(entries: Sequence[dict], max_tokens: int | None) -> list[dict]:
    """Manifest entries to restore: pinned first, then most hits (manifest order breaks ties),
    within max_tokens of stored KV. An entry that extends another (kv_start > 0) is taken only
    after that one: its KV alone is not usable. The result is in restore order."""
    pending = sorted(entries, key=lambda e: (not e["pinned"], -e["hits"]))
    chosen: list[dict] = []
    used = 0
    progress = True
    while pending and progress:
        progress = False
        for e in list(pending):
            stored = e["num_tokens"] - e["kv_start"]
            if max_tokens is not None and used + stored > max_tokens:
                pending.remove(e)
                continue
            if e["kv_start"] and not _extends_earlier(e["token_ids"], e["kv_start"], [c["token_ids"] for c in chosen]):
                continue  # its prefix may still be taken later in this pass or the next
            chosen.append(e)
            pending.remove(e)
            used += stored
            progress = True
    return chosen


# --------------------------------------------------------------------------- saving


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _safe_writer_id(writer_id: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", writer_id)[:64].strip(".") or "writer"
    return cleaned


def _check_record(fingerprint: Mapping[str, Any], r: PrefixRecord, i: int) -> None:
    page = fingerprint["page_size"]
    n = len(r.token_ids)
    if n == 0 or n % page:
        raise ValueError(f"record {i}: {n} tokens is not a positive multiple of the page size {page}")
    if not 0 <= r.kv_start < n or r.kv_start % page:
        raise ValueError(f"record {i}: kv_start {r.kv_start} must be a page multiple below {n}")
    if list(r.kv.shape) != expected_kv_shape(fingerprint, n - r.kv_start):
        raise ValueError(
            f"record {i}: kv shape {list(r.kv.shape)} != {expected_kv_shape(fingerprint, n - r.kv_start)}"
        )
    if dtype_name(r.kv.dtype) != fingerprint["dtype"]:
        raise ValueError(f"record {i}: kv dtype {r.kv.dtype} != fingerprint dtype {fingerprint['dtype']}")


def save_snapshot(
    root: str | os.PathLike,
    fingerprint: Mapping[str, Any],
    records: Sequence[PrefixRecord],
    writer_id: str,
    *,
    keep: int = DEFAULT_KEEP,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    sharding: Mapping[str, Any] | None = None,
    grace_seconds: float = RESTORE_GRACE_SECONDS,
    keys: PeerKeys | None = None,
    max_bytes: int | None = None,
) -> Path:
    """Writes a snapshot atomically and returns its directory; then prunes (see
    prune_snapshots: the newest `keep` per model fingerprint stay, and none a restore may
    still be reading; with `max_bytes`, the oldest go until the directory fits). Raises
    ValueError for records that do not match the fingerprint (a caller bug) and OSError when
    the filesystem fails; a failed write leaves no partial snapshot behind. With `keys`, the
    manifest is signed (manifest.hmac) under the current peer key.

    `sharding` records how the writing engine was sharded (its tensor-parallel size). It is
    informational, not part of the fingerprint: records always hold every KV head (a
    tensor-parallel engine gathers them), so a snapshot restores at any tensor-parallel size,
    resharded by head on the way into the pool."""
    fingerprint = json.loads(json.dumps(dict(fingerprint)))
    for i, r in enumerate(records):
        _check_record(fingerprint, r, i)
        if r.kv_start and not _extends_earlier(r.token_ids, r.kv_start, [q.token_ids for q in records[:i]]):
            raise ValueError(f"record {i}: kv_start {r.kv_start} but no earlier record holds its first tokens")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    writer = _safe_writer_id(writer_id)
    # Per-writer temp dir inside the root: same filesystem, so the final rename is atomic,
    # and a unique name, so two pods writing at once never touch each other's files.
    tmp = root / f".tmp-{writer}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        entries, files = _write_tensor_files(tmp, records, fingerprint["page_size"], max_file_bytes)
        created_ns = time.time_ns()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "created_at": created_ns / 1e9,
            "writer_id": writer_id,
            "sharding": dict(sharding or {"tensor_parallel_size": 1}),
            "files": files,
            "prefixes": entries,
        }
        raw = json.dumps(manifest, separators=(",", ":")).encode("utf-8")
        _write_durably(tmp / MANIFEST, raw)
        if keys is not None:
            mac = {"alg": "hmac-sha256", "mac": keys.sign_manifest(raw)}
            _write_durably(tmp / SIGNATURE, json.dumps(mac).encode())
        _fsync_path(tmp, directory=True)
        final = root / f"snap-{created_ns:020d}-{writer}-{secrets.token_hex(4)}"
        os.rename(tmp, final)
        _fsync_path(root, directory=True)  # make the rename itself durable
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokens = sum(r.stored_tokens for r in records)
    log.info("snapshot saved: path=%s prefixes=%d tokens=%d", final, len(records), tokens)
    try:
        prune_snapshots(root, keep=keep, grace_seconds=grace_seconds, max_bytes=max_bytes)
    except OSError as e:  # pruning is housekeeping; the snapshot is already safe
        log.warning("snapshot pruning failed in %s: %s", root, e)
    return final


def _write_tensor_files(
    tmp: Path, records: Sequence[PrefixRecord], page_size: int, max_file_bytes: int
) -> tuple[list[dict], dict[str, dict]]:
    entries: list[dict] = []
    files: dict[str, dict] = {}
    batch: dict[str, torch.Tensor] = {}
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        name = f"kv-{len(files):05d}.safetensors"
        save_file(batch, str(tmp / name), metadata={"format": FORMAT})
        _fsync_path(tmp / name)
        files[name] = {"size": (tmp / name).stat().st_size}
        batch, batch_bytes = {}, 0

    for i, r in enumerate(records):
        # A copy on the CPU: the pool's pages keep changing while we write.
        kv = r.kv.detach().to("cpu", copy=True).contiguous()
        nbytes = kv.numel() * kv.element_size()
        if batch and batch_bytes + nbytes > max_file_bytes:
            flush()
        tensor = f"prefix.{i}"
        batch[tensor] = kv
        batch_bytes += nbytes
        entries.append(
            {
                "token_ids": [int(t) for t in r.token_ids],
                "num_tokens": len(r.token_ids),
                "kv_start": int(r.kv_start),
                "pages": len(r.token_ids) // page_size,
                "hits": int(r.hits),
                "pinned": bool(r.pinned),
                "file": f"kv-{len(files):05d}.safetensors",
                "tensor": tensor,
                "shape": list(kv.shape),
                "dtype": dtype_name(kv.dtype),
                "sha256": tensor_sha256(kv),
            }
        )
    flush()
    return entries, files


# --------------------------------------------------------------------------- pruning


def list_snapshots(root: str | os.PathLike, now_ns: int | None = None) -> list[Path]:
    """Complete snapshot directories (by name), newest first. Temp and trash dirs are
    skipped, and so are names dated after now + FUTURE_SKEW_SECONDS (future_dated lists
    them): such a name would shadow every real snapshot."""
    limit = _future_limit_ns(now_ns)
    return [p for p in _all_snapshots(root) if snapshot_created_ns(p) <= limit]


def future_dated(root: str | os.PathLike, now_ns: int | None = None) -> list[Path]:
    """Snapshot names dated after now + FUTURE_SKEW_SECONDS: never read, pruned."""
    limit = _future_limit_ns(now_ns)
    return [p for p in _all_snapshots(root) if snapshot_created_ns(p) > limit]


def _future_limit_ns(now_ns: int | None) -> int:
    return (time.time_ns() if now_ns is None else now_ns) + int(FUTURE_SKEW_SECONDS * 1e9)


def _all_snapshots(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _SNAPSHOT_NAME.match(n))]
    return [root / n for _, n in sorted(found, reverse=True)]


def snapshot_created_ns(path: Path) -> int:
    """The creation time a snapshot's name carries (nanoseconds since the epoch)."""
    m = _SNAPSHOT_NAME.match(path.name)
    return int(m.group(1)) if m else 0


def _fingerprint_key(path: Path) -> str:
    """Which model a snapshot belongs to, for pruning; every unreadable manifest shares one
    key (they are pruned among themselves). Read like every snapshot file (safe_read): a
    FIFO or a link to /dev/zero is "unreadable", never a hang or a MemoryError."""
    try:
        dfd = open_dir(path)
        try:
            fp = json.loads(read_regular(MANIFEST, MAX_MANIFEST_BYTES, dir_fd=dfd)).get("fingerprint")
        finally:
            os.close(dfd)
        return json.dumps(fp, sort_keys=True, separators=(",", ":"))
    except (OSError, ValueError, AttributeError):
        return "?"


def _snapshot_bytes(path: Path) -> int:
    """Bytes a snapshot takes on disk: its entries' sizes by lstat (nothing is opened)."""
    total = 0
    try:
        with os.scandir(path) as entries:
            for e in entries:
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    except OSError:
        return 0
    return total


@dataclass(frozen=True)
class SnapshotInfo:
    """What pruning knows of one snapshot: its model, its name's date, its size."""
    key: str
    created_ns: int
    nbytes: int = 0


def snapshots_to_prune(
    snapshots: Sequence[SnapshotInfo | tuple[str, int]], keep: int, grace_seconds: float, now_ns: int,
    *, max_bytes: int | None = None, stale_seconds: float = STALE_FINGERPRINT_SECONDS,
) -> list[int]:  # fmt: skip
    """Which snapshots pruning deletes (indices).

    Per fingerprint, the newest `keep` stay: pods of two models sharing a volume never
    prune each other's only snapshot. An older one goes only once the snapshot that
    superseded it (the next newer of its model) is older than `grace_seconds`: a pod that
    chose it while it was the newest has had that long to read it. A fingerprint whose
    newest snapshot is older than `stale_seconds` goes whole: no pod runs that model any
    more. Then, with `max_bytes`, the oldest of what is left go until the rest fits, except
    the newest snapshot overall (just written: the one a restore needs most)."""
    infos = [s if isinstance(s, SnapshotInfo) else SnapshotInfo(*s) for s in snapshots]
    by_model: dict[str, list[tuple[int, int]]] = {}
    for i, info in enumerate(infos):
        by_model.setdefault(info.key, []).append((info.created_ns, i))
    doomed: set[int] = set()
    for entries in by_model.values():
        entries.sort(reverse=True)  # newest first
        if now_ns - entries[0][0] >= stale_seconds * 1e9:
            doomed.update(i for _, i in entries)
            continue
        for rank in range(max(keep, 1), len(entries)):
            superseded_at = entries[rank - 1][0]
            if now_ns - superseded_at >= grace_seconds * 1e9:
                doomed.add(entries[rank][1])
    if max_bytes is not None:
        left = sorted((i for i in range(len(infos)) if i not in doomed),
                      key=lambda i: infos[i].created_ns)  # oldest first
        used = sum(infos[i].nbytes for i in left)
        for i in left[:-1]:  # the newest stays whatever its size
            if used <= max_bytes:
                break
            doomed.add(i)
            used -= infos[i].nbytes
    return sorted(doomed)


def prune_snapshots(
    root: str | os.PathLike, keep: int = DEFAULT_KEEP, *, stale_seconds: float = STALE_TEMP_SECONDS,
    grace_seconds: float = RESTORE_GRACE_SECONDS, now: float | None = None,
    max_bytes: int | None = None, stale_fingerprint_seconds: float = STALE_FINGERPRINT_SECONDS,
) -> list[Path]:  # fmt: skip
    """Deletes old snapshots (snapshots_to_prune: the newest `keep` per model fingerprint
    stay, and none a restore may still be reading; models unused for
    `stale_fingerprint_seconds` go; then the oldest until `max_bytes` fits), future-dated
    names, and temp dirs of writers that died; returns what it removed. Safe to run from
    several pods at once: a snapshot is first renamed to a trash name (atomic, so exactly
    one pruner wins and readers never list a half-deleted snapshot), then removed. A temp
    dir younger than `stale_seconds` may be a live writer's."""
    root = Path(root)
    now = time.time() if now is None else now
    now_ns = int(now * 1e9)
    removed: list[Path] = []
    snapshots = list_snapshots(root, now_ns)
    infos = [SnapshotInfo(_fingerprint_key(p), snapshot_created_ns(p),
                          _snapshot_bytes(p) if max_bytes is not None else 0) for p in snapshots]
    doomed = [snapshots[i] for i in snapshots_to_prune(
        infos, keep, grace_seconds, now_ns, max_bytes=max_bytes,
        stale_seconds=stale_fingerprint_seconds)]
    for old in doomed + future_dated(root, now_ns):
        trash = root / f".trash-{secrets.token_hex(6)}"
        try:
            os.rename(old, trash)
        except FileNotFoundError:
            continue  # another pod pruned it first
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(old)
    for name in os.listdir(root):
        if not (name.startswith(".tmp-") or name.startswith(".trash-")):
            continue
        path = root / name
        try:
            if now - path.lstat().st_mtime > stale_seconds:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except FileNotFoundError:
            continue
    return removed


# --------------------------------------------------------------------------- loading


class SnapshotRefused(Exception):
    """A snapshot is not usable; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def load_latest_snapshot(
    root: str | os.PathLike, fingerprint: Mapping[str, Any], max_tokens: int | None = None,
    *, keys: PeerKeys | None = None, max_candidates: int = MAX_RESTORE_CANDIDATES,
    now_ns: int | None = None,
) -> LoadResult:  # fmt: skip
    """Restores the newest snapshot that passes every check; older ones are not read once one
    passes, and at most `max_candidates` are read in all. With `keys` (the service's peer
    secret), only a snapshot whose manifest.hmac verifies is read; without, every snapshot
    in `root` is trusted as the engine's own. Names dated in the future are skipped (and
    listed as rejected). Each refused snapshot is logged and listed in `rejected`. Never
    raises for anything found on disk: no usable snapshot means `records == []` and a cold
    warmup."""
    result = LoadResult()
    try:
        candidates = list_snapshots(root, now_ns)
        for path in future_dated(root, now_ns):
            result.rejected.append(_refusal(path, SnapshotRefused(
                "future_dated", f"named {snapshot_created_ns(path) / 1e9:.0f}, later than now + "
                f"{FUTURE_SKEW_SECONDS:.0f}s: ignored")))
    except OSError as e:  # e.g. the root is a file, or the volume is gone
        result.rejected.append(_refusal(Path(root), SnapshotRefused("io_error", f"cannot list: {e}")))
        return result
    if len(candidates) > max_candidates:
        log.info("snapshot: %d candidates in %s, reading at most the newest %d",
                 len(candidates), root, max_candidates)
    for path in candidates[:max(1, max_candidates)]:
        try:
            records, manifest = read_snapshot(path, fingerprint, max_tokens, keys=keys)
        except SnapshotRefused as refused:
            result.rejected.append(_refusal(path, refused))
            continue
        result.records, result.path = records, path
        result.writer_id = manifest.get("writer_id")
        log.info("snapshot restored: path=%s prefixes=%d tokens=%d", path, len(records), result.num_tokens)
        break
    return result


def _refusal(path: Path, refused: SnapshotRefused) -> Rejection:
    log.warning("snapshot refused: path=%s reason=%s detail=%s", path, refused.reason, refused.detail)
    return Rejection(str(path), refused.reason, refused.detail)


def read_snapshot(
    path: str | os.PathLike, fingerprint: Mapping[str, Any], max_tokens: int | None = None,
    *, keys: PeerKeys | None = None,
) -> tuple[list[PrefixRecord], dict[str, Any]]:  # fmt: skip
    """Reads and checks one snapshot directory: returns (records, manifest) or raises
    SnapshotRefused. With `max_tokens`, only the chosen prefixes' tensors are read; with
    `keys`, the manifest must carry a valid HMAC under one of them."""
    path = Path(path)
    try:
        dfd = open_dir(path)
    except UnsafeEntry:
        raise SnapshotRefused("unsafe_path", "snapshot entry is not a directory (a symlink?)") from None
    except FileNotFoundError as e:
        raise SnapshotRefused("file_missing", f"disappeared while reading: {e}") from None
    except OSError as e:
        raise SnapshotRefused("io_error", str(e)) from None
    try:
        return _read_snapshot(path, dfd, json.loads(json.dumps(dict(fingerprint))), max_tokens, keys)
    except SnapshotRefused:
        raise
    except UnsafeEntry as e:
        raise SnapshotRefused("unsafe_path", e.strerror or str(e)) from None
    except FileNotFoundError as e:  # deleted under us, e.g. pruned by another pod
        raise SnapshotRefused("file_missing", f"disappeared while reading: {e}") from None
    except OSError as e:
        raise SnapshotRefused("io_error", str(e)) from None
    finally:
        os.close(dfd)


def manifest_signature_problem(raw: bytes, dfd: int, keys: PeerKeys) -> SnapshotRefused | None:
    """None when manifest.hmac (read through `dfd`) verifies `raw` under one of `keys`."""
    try:
        sig = json.loads(read_regular(SIGNATURE, MAX_SIGNATURE_BYTES, dir_fd=dfd))
    except FileNotFoundError:
        return SnapshotRefused("unsigned", f"no {SIGNATURE}: not written by this service's engines")
    except UnsafeEntry as e:
        return SnapshotRefused("unsafe_path", e.strerror or str(e))
    except TooLarge:
        return SnapshotRefused("bad_signature", f"{SIGNATURE} is larger than {MAX_SIGNATURE_BYTES} bytes")
    except (ValueError, UnicodeDecodeError):
        return SnapshotRefused("bad_signature", f"{SIGNATURE} is not JSON")
    mac = sig.get("mac") if isinstance(sig, dict) else None
    if not isinstance(sig, dict) or sig.get("alg") != "hmac-sha256" or not isinstance(mac, str):
        return SnapshotRefused("bad_signature", f"{SIGNATURE} is not an hmac-sha256 signature")
    if not keys.verify_manifest(raw, mac):
        return SnapshotRefused("bad_signature", "the manifest's HMAC does not verify under any peer key")
    return None


def _read_manifest(dfd: int, keys: PeerKeys | None) -> dict[str, Any]:
    try:
        raw = read_regular(MANIFEST, MAX_MANIFEST_BYTES, dir_fd=dfd)
    except FileNotFoundError:
        raise SnapshotRefused("manifest_missing", f"{MANIFEST} is missing") from None
    except TooLarge as e:
        raise SnapshotRefused("manifest_invalid", e.strerror or str(e)) from None
    if keys is not None:  # before parsing: an unsigned manifest is never parsed
        problem = manifest_signature_problem(raw, dfd, keys)
        if problem is not None:
            raise problem
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotRefused("manifest_unparsable", str(e)[:200]) from None
    if not isinstance(manifest, dict):
        raise SnapshotRefused("manifest_unparsable", "manifest is not a JSON object")
    version = manifest.get("format_version")
    if manifest.get("format") != FORMAT:
        raise SnapshotRefused("manifest_invalid", f"format is {manifest.get('format')!r}, not {FORMAT!r}")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise SnapshotRefused("unknown_version", f"format_version {version!r}; this engine reads {FORMAT_VERSION}")
    return manifest


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _check_entries(manifest: dict[str, Any], fp: dict[str, Any]) -> tuple[dict[str, int], list[dict]]:
    """Structural and internal-consistency checks of a manifest, before any tensor is read."""
    files, entries = manifest.get("files"), manifest.get("prefixes")
    if not isinstance(files, dict) or not isinstance(entries, list):
        raise SnapshotRefused("manifest_invalid", "'files' must be an object and 'prefixes' a list")
    sizes: dict[str, int] = {}
    for name, info in files.items():
        if not _TENSOR_FILE.match(name):
            raise SnapshotRefused("unsafe_path", f"file name {name!r} is not a plain .safetensors name")
        if not isinstance(info, dict) or not _is_int(info.get("size")):
            raise SnapshotRefused("manifest_invalid", f"files[{name!r}].size must be an integer")
        sizes[name] = info["size"]
    page, seen = fp["page_size"], set()
    for i, e in enumerate(entries):
        where = f"prefixes[{i}]"
        if not isinstance(e, dict):
            raise SnapshotRefused("manifest_invalid", f"{where} is not an object")
        name = e.get("file")
        if isinstance(name, str) and not _TENSOR_FILE.match(name):
            raise SnapshotRefused("unsafe_path", f"{where}.file {name!r} is not a plain .safetensors name")
        ids, n = e.get("token_ids"), e.get("num_tokens")
        problem = None
        if name not in sizes:
            problem = f"file {name!r} is not listed in 'files'"
        elif not isinstance(ids, list) or not all(_is_int(t) and t < 2**31 for t in ids):
            problem = "token_ids must be a list of token ids"
        elif not _is_int(n, 1) or n != len(ids) or n % page:
            problem = f"num_tokens {n!r} must equal len(token_ids)={len(ids)} and be a multiple of {page}"
        elif e.get("pages") != n // page:
            problem = f"pages {e.get('pages')!r} != num_tokens / page_size = {n // page}"
        elif not _is_int(e.get("kv_start")) or e["kv_start"] >= n or e["kv_start"] % page:
            problem = f"kv_start {e.get('kv_start')!r} must be a multiple of {page} below num_tokens {n}"
        elif e.get("shape") != expected_kv_shape(fp, n - e["kv_start"]):
            problem = f"shape {e.get('shape')!r} != {expected_kv_shape(fp, n - e['kv_start'])} for this model"
        elif e.get("dtype") != fp["dtype"]:
            problem = f"dtype {e.get('dtype')!r} != {fp['dtype']!r}"
        elif not _is_int(e.get("hits")) or not isinstance(e.get("pinned"), bool):
            problem = "hits must be a non-negative integer and pinned a boolean"
        elif not isinstance(e.get("tensor"), str) or (name, e["tensor"]) in seen:
            problem = "tensor must be a name, unique within its file"
        elif not isinstance(e.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", e["sha256"]):
            problem = "sha256 must be 64 hex digits"
        if problem:
            raise SnapshotRefused("manifest_invalid", f"{where}: {problem}")
        seen.add((name, e["tensor"]))
    return sizes, entries


def _read_snapshot(
    path: Path, dfd: int, fp: dict[str, Any], max_tokens: int | None, keys: PeerKeys | None
) -> tuple[list[PrefixRecord], dict[str, Any]]:
    manifest = _read_manifest(dfd, keys)
    diff = fingerprint_difference(fp, manifest.get("fingerprint"))
    if diff:
        raise SnapshotRefused("fingerprint_mismatch", diff)
    sizes, entries = _check_entries(manifest, fp)
    chosen = choose_restorable(entries, max_tokens)
    by_file: dict[str, list[dict]] = {}
    for e in chosen:
        by_file.setdefault(e["file"], []).append(e)
    loaded: dict[int, PrefixRecord] = {}
    for name, file_entries in by_file.items():
        try:
            fd, st = open_regular(name, dir_fd=dfd)
        except FileNotFoundError:
            raise SnapshotRefused("file_missing", f"{name} is missing") from None
        try:
            if st.st_size < sizes[name]:
                raise SnapshotRefused("truncated", f"{name} is {st.st_size} bytes, manifest says {sizes[name]}")
            if st.st_size > sizes[name]:
                raise SnapshotRefused("size_mismatch", f"{name} is {st.st_size} bytes, manifest says {sizes[name]}")
            # safetensors opens a path: the descriptor's own (/proc/self/fd), so what it
            # maps is the regular file just checked, whatever the name points to now.
            for e, kv in _read_tensors(fd_path(fd, path / name), name, file_entries):
                loaded[id(e)] = PrefixRecord([int(t) for t in e["token_ids"]], kv, e["hits"], e["pinned"],
                                             e["kv_start"])
        finally:
            os.close(fd)
    return [loaded[id(e)] for e in chosen], manifest


def _read_tensors(file: str, name: str, entries: list[dict]) -> list[tuple[dict, torch.Tensor]]:
    out = []
    try:
        with safe_open(file, framework="pt") as f:
            names = set(f.keys())
            for e in entries:
                if e["tensor"] not in names:
                    raise SnapshotRefused("size_mismatch", f"{name} has no tensor {e['tensor']!r}")
                sl = f.get_slice(e["tensor"])
                shape, dtype = list(sl.get_shape()), sl.get_dtype()
                if shape != e["shape"] or dtype != SAFETENSORS_CODES[e["dtype"]]:
                    raise SnapshotRefused(
                        "size_mismatch", f"{e['tensor']} is {dtype}{shape}, manifest says {e['dtype']}{e['shape']}"
                    )
                out.append((e, f.get_tensor(e["tensor"])))
        for (e, _), digest in zip(out, tensors_sha256([kv for _, kv in out]), strict=True):
            if digest != e["sha256"]:
                raise SnapshotRefused("checksum_mismatch", f"{name}:{e['tensor']} does not match its sha256")
    except SnapshotRefused:
        raise
    except OSError:
        raise
    except Exception as err:  # safetensors raises its own error type for a corrupt header
        raise SnapshotRefused("unreadable", f"{name}: {err}"[:300]) from None
    return out
