"""Serving side of model files between pods: a Ready engine hands its completed download to
a starting peer of the same service, so in PodLocal model-cache mode (each pod its own
emptyDir) a refill, a scale-up or a rollout reads the weights from a neighbour, not the hub
or the bucket (engine/model/peer_fetch.py is the other side).

- `GET /admin/model/files?key=KEY`: the completion marker of this engine's own model
  (download.read_complete) as JSON — version (the hub commit, or the S3 listing's digest)
  and every file with its size and the digests its source published; 404 while the download
  is not complete (no marker: never a half-downloaded model), or for another model's key.
- `GET /admin/model/file?key=KEY&path=PATH`: one of those listed files, nothing else (the
  path must be in the marker: no traversal), at the size the marker records.
Like every /admin/* route only to the service's peer secret (engine/serve/http_auth.py; without
one they answer 404).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi.responses import FileResponse, JSONResponse

from preheat.engine.model.download import CompleteDownload, read_complete
from preheat.engine.model.uri import LocalModel, ModelURIError, parse_model
from preheat.engine.request.api_errors import APIError

FILES_PATH = "/admin/model/files"
FILE_PATH = "/admin/model/file"


def model_key(model: str | None) -> str | None:
    """The download key of a --model (None: a local model, nothing downloaded to hand on)."""
    try:
        ref = parse_model(model)
    except ModelURIError:
        return None
    return None if isinstance(ref, LocalModel) else ref.key


def listing(key: str, done: CompleteDownload) -> dict[str, Any]:
    return {"key": key, "version": done.version, "files": [asdict(f) for f in done.files]}


def add_model_peer_routes(app: Any, model: str | None, download_dir: Path | None) -> None:
    """`model`: the --model as given (before the download replaced it by a local path);
    `download_dir`: where its download lands (fetch.download_root)."""
    own_key = model_key(model)

    async def complete(key: str) -> CompleteDownload:
        if own_key is None or download_dir is None:
            raise APIError(404, "this engine serves a local model: no download to hand on",
                           code="no_model_download")
        if key != own_key:
            raise APIError(404, "this engine serves another model", code="other_model")
        done = await asyncio.to_thread(read_complete, download_dir, key)
        if done is None:
            raise APIError(404, "the model's download is not complete here", code="model_not_downloaded")
        return done

    @app.get(FILES_PATH)
    async def model_files(key: str) -> Any:
        """The files of this engine's completed model download, with the sizes and digests
        the source published (for a starting peer: docs/operator.md, model cache)."""
        return JSONResponse(listing(key, await complete(key)))

    @app.get(FILE_PATH)
    async def model_file(key: str, path: str) -> Any:
        """One listed file of the completed download."""
        done = await complete(key)
        listed = {f.path: f for f in done.files}
        if path not in listed:
            raise APIError(404, "no such file in the model's download", code="no_such_file")
        target = Path(os.path.realpath(done.root / path))  # hub snapshots link to blobs/
        try:
            st = await asyncio.to_thread(target.stat)
        except OSError:
            raise APIError(404, "the file is gone", code="no_such_file") from None
        if not target.is_file() or st.st_size != listed[path].size:
            raise APIError(409, "the file is not at its recorded size", code="file_changed")
        return FileResponse(target, stat_result=st, media_type="application/octet-stream")
