"""Models from a Hugging Face hub (or a mirror: HF_ENDPOINT), through huggingface_hub.

huggingface_hub does the transfer: the hub cache layout in --download-dir (so HF_HUB_CACHE
is shared with other tools), `.incomplete` files renamed into place, resume by Range, size
checks, per-file locks, HF_TOKEN and HF_HUB_OFFLINE. Added here: which files to take (one
GGUF, or the safetensors checkpoint with its config and tokenizer — never pickles), one
hash check against the hub's published sha256 / git blob id, the completion marker (a
restart makes one revision call and nothing else), a lock per model, and progress.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
import os
from pathlib import Path

from preheat.engine.model.download import (
    DownloadFailed,
    ModelUnavailable,
    Progress,
    RemoteFile,
    mismatch,
    model_lock,
    read_marker,
    watch_disk,
    write_marker,
)
from preheat.engine.model.peer_fetch import ModelPeer, try_peer
from preheat.engine.model.uri import HubModel

log = logging.getLogger(__name__)

# Besides the weights, what a checkpoint folder needs: config, tokenizer, chat template.
SIDE_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
INDEX = "model.safetensors.index.json"


def choose_files(ref: HubModel, tree: dict[str, RemoteFile], index: dict | None) -> list[RemoteFile]:
    """The files to download: the named GGUF; else the safetensors the index names (or
    model.safetensors, or every top-level *.safetensors) plus the side files. Raises
    ModelUnavailable when the repository has nothing we can load."""
    name = _display(ref)
    if ref.filename:
        if ref.filename not in tree:
            raise ModelUnavailable(f"{name}: the repository has no file {ref.filename!r} "
                                   f"(GGUF files: {_ggufs(tree) or 'none'})")
        return [tree[ref.filename]]
    top = [p for p in tree if "/" not in p]
    if index is not None:
        weights = sorted(set((index.get("weight_map") or {}).values()))
        missing = [w for w in weights if w not in tree]
        if missing:
            raise ModelUnavailable(f"{name}: {INDEX} names files the repository lacks: {', '.join(missing)}")
    elif "model.safetensors" in tree:
        weights = ["model.safetensors"]
    else:
        weights = sorted(p for p in top if p.endswith(".safetensors") and not p.startswith("consolidated"))
    if not weights:
        ggufs = _ggufs(tree)
        hint = (f"name one of its GGUF files: hf://{ref.repo}/FILE.gguf ({ggufs})" if ggufs
                else "it has no *.safetensors or *.gguf files")
        raise ModelUnavailable(f"{name}: no safetensors checkpoint to load; {hint}")
    side = [p for p in top if any(fnmatch.fnmatch(p, pat) for pat in SIDE_FILES)]
    return [tree[p] for p in sorted(set(weights) | set(side))]


def _ggufs(tree: dict[str, RemoteFile]) -> str:
    return ", ".join(sorted(p for p in tree if p.endswith(".gguf"))[:8])


def _display(ref: HubModel) -> str:
    rev = f"@{ref.revision}" if ref.revision else ""
    return f"hf://{ref.repo}{rev}" + (f"/{ref.filename}" if ref.filename else "")


def fetch(ref: HubModel, download_dir: Path, progress: Progress, peer: ModelPeer | None = None) -> Path:
    """The local path of the model (the snapshot folder, or the GGUF file in it),
    downloading what is missing (from `peer` first, when given). Raises ModelUnavailable or
    DownloadFailed."""
    from huggingface_hub import errors

    try:
        return _fetch(ref, download_dir, progress, peer)
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise ModelUnavailable(f"{_display(ref)}: repository not found, or access refused "
                               f"(private or gated: set HF_TOKEN) [{_status(e)}]") from None
    except errors.RevisionNotFoundError:
        raise ModelUnavailable(f"{_display(ref)}: revision {ref.revision!r} not found") from None
    except errors.RemoteEntryNotFoundError as e:
        raise ModelUnavailable(f"{_display(ref)}: file not found ({e.response.url})") from None
    except errors.HfHubHTTPError as e:
        code = e.response.status_code if e.response is not None else 0
        if code in (401, 403):
            raise ModelUnavailable(f"{_display(ref)}: the hub refused the credentials "
                                   f"(HTTP {code}: check HF_TOKEN)") from None
        raise DownloadFailed(f"{_display(ref)}: the hub answered HTTP {code}") from None
    except errors.OfflineModeIsEnabled:
        raise DownloadFailed(f"{_display(ref)}: HF_HUB_OFFLINE is set and the model is not "
                             f"complete in {download_dir}") from None
    except (*_transport_errors(), errors.LocalEntryNotFoundError) as e:
        endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        raise DownloadFailed(f"{_display(ref)}: the hub at {endpoint} could not be reached "
                             f"({type(e).__name__})") from None


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's "could not reach" errors: huggingface_hub 2.x uses httpx2, 1.x httpx."""
    out: list[type[Exception]] = []
    for name in ("httpx2", "httpx"):
        try:
            out.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _status(e: Exception) -> str:
    response = getattr(e, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(e).__name__


def _fetch(ref: HubModel, download_dir: Path, progress: Progress, peer: ModelPeer | None) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    storage = download_dir / repo_folder_name(repo_id=ref.repo, repo_type="model")
    commit = _commit(HfApi(), ref, storage, constants.is_offline_mode())
    snapshot = storage / "snapshots" / commit
    result = snapshot / ref.filename if ref.filename else snapshot
    if (done := read_marker(download_dir, ref.key, commit, snapshot)) is not None:
        progress.start(sum(f.size for f in done), sum(f.size for f in done))
        log.info("download: %s complete in %s (commit %s)", _display(ref), download_dir, commit[:12])
        return result
    if constants.is_offline_mode():
        raise DownloadFailed(f"{_display(ref)}: HF_HUB_OFFLINE is set and the model is not "
                             f"complete in {download_dir}")
    tree = _tree(HfApi(), ref.repo, commit)
    with model_lock(download_dir, ref.key):
        if (done := read_marker(download_dir, ref.key, commit, snapshot)) is not None:
            progress.start(sum(f.size for f in done), sum(f.size for f in done))
            return result  # another process sharing the dir downloaded it meanwhile
        index = None
        if not ref.filename and INDEX in tree:
            index = json.loads(Path(hf_hub_download(ref.repo, INDEX, revision=commit,
                                                    cache_dir=download_dir)).read_text())
        files = choose_files(ref, tree, index)

        def on_disk() -> int:
            return sum(_present(storage, snapshot, f) for f in files)

        progress.start(sum(f.size for f in files), on_disk())
        log.info("download: %s (commit %s): %d files, %.1f MB, into %s", _display(ref),
                 commit[:12], len(files), progress.bytes_total / 1e6, download_dir)
        # A peer's files are each verified against the tree's digests as they arrive.
        if not try_peer(peer, ref.key, commit, files, snapshot, progress, origin="hub"):
            with watch_disk(progress, on_disk, counting=True):
                snapshot_download(ref.repo, revision=commit, cache_dir=download_dir,
                                  allow_patterns=[f.path for f in files])
            for f in files:
                if (why := mismatch(snapshot / f.path, f)) is not None:
                    (snapshot / f.path).resolve().unlink(missing_ok=True)  # the next start fetches it again
                    raise DownloadFailed(f"{_display(ref)}: {why}")
        write_marker(download_dir, ref.key, commit, files, root=snapshot)
        _write_ref(storage, ref.revision or "main", commit)
    log.info("download: %s verified and complete", _display(ref))
    return result


def _commit(api, ref: HubModel, storage: Path, offline: bool) -> str:
    """The commit the revision points at: asked of the hub (one call), or — offline —
    read from the cache's refs, as huggingface_hub does."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    revision = ref.revision or "main"
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    if not offline:
        try:
            return api.model_info(ref.repo, revision=ref.revision).sha
        except OfflineModeIsEnabled:
            pass
    refs = storage / "refs" / revision
    if refs.is_file():
        return refs.read_text().strip()
    raise OfflineModeIsEnabled(f"{ref.repo}: revision {revision} not in the cache")


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as huggingface_hub keeps it, so an offline start (or
    another tool) resolves the revision from the cache."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.tmp-{os.getpid()}")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def _tree(api, repo: str, commit: str) -> dict[str, RemoteFile]:
    from huggingface_hub.hf_api import RepoFile

    out = {}
    for f in api.list_repo_tree(repo, revision=commit, recursive=True):
        if isinstance(f, RepoFile):
            lfs = f.lfs
            out[f.path] = RemoteFile(f.path, lfs.size if lfs else f.size,
                                     sha256=lfs.sha256 if lfs else None,
                                     git_sha1=None if lfs else f.blob_id)
    return out


def _present(storage: Path, snapshot: Path, f: RemoteFile) -> int:
    """Bytes of `f` on disk: the whole file once in the snapshot, else its partial blob."""
    try:
        return (snapshot / f.path).stat().st_size
    except OSError:
        pass
    etag = f.sha256 or f.git_sha1
    try:
        return (storage / "blobs" / f"{etag}.incomplete").stat().st_size
    except OSError:
        return 0
