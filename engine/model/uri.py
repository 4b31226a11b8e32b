"""What a `--model` names, parsed without touching the network: a pure function.

- empty: the embedded default model;
- an existing local path (folder or .gguf): loaded as it is — a local path always wins,
  so a folder called `org/name` is not mistaken for a hub id (as in vLLM);
- `ORG/NAME` (not an existing path) or `hf://ORG/NAME[@REVISION][/PATH.gguf]`: a Hugging Face
  hub repository (a GGUF repository holds many files: name one, or its safetensors are
  taken). REVISION is a branch, tag or commit and holds no `/`;
- `s3://BUCKET/PREFIX`: the objects under PREFIX (a folder), or one `.gguf` object;
- `pvc://CLAIM/PATH` is an InferenceService form (the operator mounts the claim): refused here
  with a message that says so.
Anything else is a local path, and the loader says it does not exist.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^{_NAME}/{_NAME}$")
_HF_URI = re.compile(rf"^hf://(?P<repo>{_NAME}/{_NAME})(@(?P<rev>[^/@]+))?(/(?P<file>.+))?$")
_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(?P<prefix>.*))?$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://")


class ModelURIError(ValueError):
    """A --model value that names nothing we can fetch; the message is one line."""


@dataclass(frozen=True)
class LocalModel:
    path: str | None  # None: the embedded default


@dataclass(frozen=True)
class HubModel:
    repo: str  # ORG/NAME
    revision: str | None = None  # None: the repository's default branch
    filename: str | None = None  # one .gguf file in the repository; None: the safetensors

    @property
    def key(self) -> str:
        """Names this model in file names (locks, completion markers)."""
        return "hf--" + "--".join([self.repo.replace("/", "--"), self.revision or "default",
                                   (self.filename or "safetensors").replace("/", "--")])


@dataclass(frozen=True)
class S3Model:
    bucket: str
    prefix: str  # "" = the whole bucket; ends in .gguf = one object

    @property
    def single_object(self) -> bool:
        return self.prefix.endswith(".gguf")

    @property
    def key(self) -> str:
        return "s3--" + "--".join([self.bucket, *[p for p in self.prefix.split("/") if p]])


ModelRef = LocalModel | HubModel | S3Model


def parse_model(text: str | None, exists: Callable[[str], bool] = lambda p: Path(p).exists()) -> ModelRef:
    """Classifies a --model value. `exists` is injectable so tests need no files."""
    if not text:
        return LocalModel(None)
    if text.startswith("hf://"):
        m = _HF_URI.match(text)
        if not m:
            raise ModelURIError(f"--model {text!r}: expected hf://ORG/NAME[@REVISION][/FILE.gguf]")
        filename = m.group("file")
        if filename is not None and not filename.endswith(".gguf"):
            raise ModelURIError(f"--model {text!r}: a file in a hub repository must be a .gguf "
                                "(leave it out to load the repository's safetensors)")
        return HubModel(m.group("repo"), m.group("rev"), filename)
    if text.startswith("s3://"):
        m = _S3_URI.match(text)
        if not m:
            raise ModelURIError(f"--model {text!r}: expected s3://BUCKET/PREFIX")
        return S3Model(m.group("bucket"), (m.group("prefix") or "").strip("/"))
    if text.startswith("pvc://"):
        raise ModelURIError(f"--model {text!r}: pvc:// is an InferenceService form (the operator "
                            "mounts the claim and passes the local path); give the engine a path")
    if _SCHEME.match(text):
        raise ModelURIError(f"--model {text!r}: unsupported scheme; use a local path, ORG/NAME, "
                            "hf://ORG/NAME or s3://BUCKET/PREFIX")
    if not exists(text) and _HUB_ID.match(text):
        return HubModel(text)
    return LocalModel(text)


def served_name(ref: ModelRef) -> str | None:
    """The name clients send when --served-model-name is not given: the hub id (as vLLM),
    or the last part of an S3 prefix; None for a local model (the loader derives it)."""
    if isinstance(ref, HubModel):
        return ref.repo
    if isinstance(ref, S3Model):
        last = ref.prefix.rstrip("/").rsplit("/", 1)[-1] or ref.bucket
        return last.removesuffix(".gguf")
    return None
