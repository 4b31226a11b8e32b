"""TEST STAND-IN for the Hugging Face hub's file API — not the hub, and not for production.

What it models (checked against huggingface_hub 2.x: `hf_api.py` model_info / list_repo_tree,
`file_download.py` get_hf_file_metadata / http_get, `utils/_http.py` hf_raise_for_status,
`constants.py` header names), enough for `HfApi`, `snapshot_download` and `hf_hub_download`
pointed at it with HF_ENDPOINT:

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: `{"id", "sha", "siblings"}`;
- `GET /api/models/{repo}/tree/{rev}` (`recursive`): files as the hub lists them — `oid` the
  git blob id (sha1 of `blob <size>\\0<bytes>`), `size`, `path`, and for LFS files (weights:
  *.safetensors, *.gguf) `lfs: {oid: sha256, size, pointerSize}`;
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: the bytes, with `X-Repo-Commit`, `ETag` (the
  sha256 for LFS files, the git blob id otherwise), `X-Linked-Etag`/`X-Linked-Size` on LFS
  files, `Content-Length`, `Accept-Ranges`, and `Range: bytes=N-` answered 206 (resume);
- errors as the hub sends them: 404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound` /
  `EntryNotFound`; a private repo without a token: 401 `X-Error-Code: RepoNotFound`; a wrong
  token: 401 `X-Error-Message: Invalid credentials in Authorization header`.

What it does not: LFS files are served directly (the hub redirects them to a CDN, 302 with
the X-Linked-* headers — huggingface_hub reads the same headers either way), no Xet
storage, no pagination (`Link` headers), no uploads, one branch per repo (`main`) plus
commit ids, gated repos. It counts bytes served per file (`served`) so tests can tell a
download from a cache hit, and can throttle (`rate`) or cut a transfer (`cut_after`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class Repo:
    files: dict[str, Path]  # path in repo -> file on disk
    commit: str = ""
    token: str | None = None  # private: this token is needed

    def __post_init__(self) -> None:
        if not self.commit:
            h = hashlib.sha1()
            for p in sorted(self.files):
                h.update(p.encode() + str(self.files[p].stat().st_size).encode())
            self.commit = h.hexdigest()


@dataclass
class FileInfo:
    size: int
    sha256: str
    git_sha1: str
    lfs: bool


def _info(path: Path, name: str) -> FileInfo:
    data_sha256, git = hashlib.sha256(), hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            data_sha256.update(block)
            git.update(block)
    return FileInfo(path.stat().st_size, data_sha256.hexdigest(), git.hexdigest(), name.endswith(LFS_SUFFIXES))


@dataclass
class HubStandIn:
    repos: dict[str, Repo] = field(default_factory=dict)
    rate: float | None = None  # bytes per second per transfer; None: as fast as it goes
    cut_after: int | None = None  # close the next file transfer after this many bytes (once)
    served: dict[tuple[str, str], int] = field(default_factory=dict)  # (repo, path) -> bytes
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    ranges: list[int] = field(default_factory=list)  # the start of every Range request

    def __post_init__(self) -> None:
        self._infos: dict[tuple[str, str], FileInfo] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo: str, files: dict[str, Path], token: str | None = None) -> Repo:
        r = self.repos[repo] = Repo(files, token=token)
        for name, path in files.items():
            self._infos[(repo, name)] = _info(path, name)
        return r

    def bytes_served(self, repo: str | None = None) -> int:
        with self._lock:
            return sum(n for (r, _), n in self.served.items() if repo is None or r == repo)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubStandIn:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    # -- what the handler asks --

    def count(self, repo: str, path: str, n: int) -> None:
        with self._lock:
            self.served[(repo, path)] = self.served.get((repo, path), 0) + n

    def take_cut(self) -> int | None:
        with self._lock:
            cut, self.cut_after = self.cut_after, None
            return cut


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(/(?P<kind>revision|tree)/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _error(self, status: int, code: str | None, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _repo(self, name: str, rev: str | None) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            auth = self.headers.get("Authorization", "")
            if repo.token is not None and auth != f"Bearer {repo.token}":
                if auth:
                    self._error(401, None, "Invalid credentials in Authorization header")
                else:
                    self._error(401, "RepoNotFound", "Repository not found")
                return None
            if rev not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def _json(self, obj: object) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _route(self, body: bool) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.requests.append((self.command, path))
            if m := _API.match(path):
                repo = self._repo(m.group("repo"), m.group("rev"))
                if repo is None:
                    return
                if m.group("kind") == "tree":
                    recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                    return self._json(self._tree(m.group("repo"), repo, recursive))
                return self._json({"id": m.group("repo"), "modelId": m.group("repo"), "sha": repo.commit,
                                   "private": repo.token is not None,
                                   "siblings": [{"rfilename": p} for p in sorted(repo.files)]})
            if m := _RESOLVE.match(path):
                repo = self._repo(m.group("repo"), m.group("rev"))
                if repo is None:
                    return
                name = m.group("path")
                if name not in repo.files:
                    return self._error(404, "EntryNotFound", f"{name} does not exist on main")
                return self._file(m.group("repo"), repo, name, body)
            self._error(404, None, "Not found")

        def _tree(self, name: str, repo: Repo, recursive: bool) -> list[dict]:
            out, dirs = [], set()
            for p in sorted(repo.files):
                if "/" in p and not recursive:
                    dirs.add(p.split("/", 1)[0])
                    continue
                for i in range(1, p.count("/") + 1):
                    dirs.add("/".join(p.split("/")[:i]))
                info = hub._infos[(name, p)]
                entry = {"type": "file", "oid": info.git_sha1, "size": info.size, "path": p}
                if info.lfs:  # the pointer's blob is what git holds; the tree says so
                    entry["lfs"] = {"oid": info.sha256, "size": info.size, "pointerSize": 134}
                out.append(entry)
            out += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                    for d in sorted(dirs)]
            return out

        def _file(self, name: str, repo: Repo, path: str, body: bool) -> None:
            info = hub._infos[(name, path)]
            etag = info.sha256 if info.lfs else info.git_sha1
            start = 0
            rng = self.headers.get("Range")
            if rng and (m := re.match(r"bytes=(\d+)-$", rng)):
                start = int(m.group(1))
                hub.ranges.append(start)
            if start > info.size:
                return self._error(416, None, "Range Not Satisfiable")
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{etag}"')
            if info.lfs:
                self.send_header("X-Linked-Etag", f'"{info.sha256}"')
                self.send_header("X-Linked-Size", str(info.size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(info.size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{info.size - 1}/{info.size}")
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if not body:
                return
            cut = hub.take_cut()
            sent, began = 0, time.monotonic()
            with repo.files[path].open("rb") as f:
                f.seek(start)
                while block := f.read(1 << 16):
                    if cut is not None and sent + len(block) > cut:
                        block = block[:max(0, cut - sent)]
                        self.wfile.write(block)
                        hub.count(name, path, len(block))
                        self.close_connection = True
                        return  # the connection drops mid-transfer
                    self.wfile.write(block)
                    sent += len(block)
                    hub.count(name, path, len(block))
                    if hub.rate:
                        ahead = sent / hub.rate - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)

    return Handler
