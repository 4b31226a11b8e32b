"""--model to a local path: the one entry point the start-up uses (engine/lifecycle.py).

A local path (or the embedded default) needs nothing; a hub or S3 model is downloaded into
--download-dir first (hub.py, s3.py), and the engine then loads the local copy as if it had
been given that path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from preheat.engine.model.download import Progress, default_download_dir
from preheat.engine.model.peer_fetch import ModelPeer
from preheat.engine.model.uri import HubModel, LocalModel, ModelRef, S3Model, parse_model, served_name


@dataclass(frozen=True)
class Fetched:
    path: str  # a local folder or .gguf file
    served_name: str | None


def needs_download(model: str | None) -> bool:
    return not isinstance(parse_model(model), LocalModel)


def download_root(download_dir: str | None, weight_cache_dir: str | None) -> Path:
    """--download-dir, or its default."""
    return Path(download_dir) if download_dir else default_download_dir(weight_cache_dir)


def fetch_model(model: str | None, download_dir: str | None, weight_cache_dir: str | None,
                progress: Progress, peer: ModelPeer | None = None) -> Fetched:
    """`peer`: a Ready engine of the same service to take the files from first
    (engine/model/peer_fetch.py)."""
    ref: ModelRef = parse_model(model)
    if isinstance(ref, LocalModel):
        return Fetched(model or "", None)
    root = download_root(download_dir, weight_cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(ref, HubModel):
        from preheat.engine.model import hub

        path = hub.fetch(ref, root, progress, peer)
    else:
        assert isinstance(ref, S3Model)
        from preheat.engine.model import s3

        path = s3.fetch(ref, root, progress, peer=peer)
    return Fetched(str(path), served_name(ref))
