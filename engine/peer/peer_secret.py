"""The per-service peer secret (`--peer-secret-file`): what `/admin/*` asks for and what
signs snapshots. It is not a client credential: clients get `--api-key`, engines of one
InferenceService share this one (the operator creates it and mounts it), so a client that
may chat can still not pull another client's conversations out of the prefix cache.

The path is a file (one key per line; the first is current) or a directory, as a Secret
volume mounts it: the file `current` is the current key, every other plain entry (e.g.
`previous`) a key that still verifies. The current key signs and is sent to peers; every
key is accepted, so a rotation (new `current`, old one moved to `previous`) never makes
the pods of a rollout refuse each other. The keys are re-read at most every
RELOAD_SECONDS: the kubelet updates a mounted Secret in place.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CURRENT = "current"
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096
RELOAD_SECONDS = 10.0
# Domain separation: a manifest MAC can never be replayed as something else.
_MANIFEST_CONTEXT = b"preheat-kv-snapshot-manifest\0"


class PeerSecretError(ValueError):
    """The peer secret cannot be read or is unusable (one line)."""


@dataclass(frozen=True)
class PeerKeys:
    current: bytes
    accepted: tuple[bytes, ...]  # current first

    def matches(self, token: str) -> bool:
        """Whether a bearer token is one of the keys (constant time per key)."""
        given = token.encode()
        return any(hmac.compare_digest(given, k) for k in self.accepted)

    def sign_manifest(self, manifest: bytes) -> str:
        return _mac(self.current, manifest)

    def verify_manifest(self, manifest: bytes, mac: str) -> bool:
        return any(hmac.compare_digest(_mac(k, manifest), mac) for k in self.accepted)


def _mac(key: bytes, manifest: bytes) -> str:
    return hmac.new(key, _MANIFEST_CONTEXT + manifest, hashlib.sha256).hexdigest()


def _read_key_file(path: Path) -> list[bytes]:
    # Secret volumes are symlinks into ..data/: follow them (unlike snapshot files), but
    # read only a small regular file.
    try:
        with open(path, "rb") as f:
            if not os.path.isfile(path):
                raise PeerSecretError(f"{path} is not a regular file")
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise PeerSecretError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise PeerSecretError(f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes")
    return [line.strip() for line in data.splitlines() if line.strip()]


def load_peer_keys(path: str | os.PathLike) -> PeerKeys:
    """Raises PeerSecretError when there is no usable current key."""
    path = Path(path)
    if path.is_dir():
        keys = _read_key_file(path / CURRENT)[:1]
        if not keys:
            raise PeerSecretError(f"{path / CURRENT} holds no key")
        for entry in sorted(path.iterdir()):
            if entry.name != CURRENT and not entry.name.startswith(".") and entry.is_file():
                keys += _read_key_file(entry)
    else:
        keys = _read_key_file(path)
    if not keys:
        raise PeerSecretError(f"{path} holds no key")
    short = [k for k in keys if len(k) < MIN_KEY_BYTES]
    if short:
        raise PeerSecretError(f"{path}: a key shorter than {MIN_KEY_BYTES} bytes is too easy to guess")
    return PeerKeys(keys[0], tuple(dict.fromkeys(keys)))


class PeerSecret:
    """The keys at `path`, re-read at most every `reload_seconds`; the last good ones stay
    when a re-read fails (a Secret update is never half-applied by the kubelet, but a
    removed mount must not lock the peers out mid-flight)."""

    def __init__(self, path: str | os.PathLike, reload_seconds: float = RELOAD_SECONDS) -> None:
        self.path = Path(path)
        self.reload_seconds = reload_seconds
        self._keys = load_peer_keys(self.path)
        self._loaded = time.monotonic()
        self._lock = threading.Lock()

    def keys(self) -> PeerKeys:
        with self._lock:
            if time.monotonic() - self._loaded >= self.reload_seconds:
                try:
                    self._keys = load_peer_keys(self.path)
                except PeerSecretError:
                    pass
                self._loaded = time.monotonic()
            return self._keys
