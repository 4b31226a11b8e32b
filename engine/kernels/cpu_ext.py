"""Builds (once) and loads Preheat's CPU kernels, a C++ extension in engine/kernels/cpu/.

The extension holds two builds of every kernel (engine/kernels/cpu/kernels.h): `avx512`
(AVX-512 with VNNI and BF16: Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and
later) and `avx2` (AVX2 + FMA + F16C: every x86-64 CPU since Haswell / Zen 1, most laptops
and many cloud instances). `load()` picks the best one the CPU reports (`choose_isa`);
PREHEAT_CPU_KERNELS=avx2 forces the AVX2 build on an AVX-512 CPU (tests and benchmarks
compare the two on one machine; an operator can step around a kernel), `avx512` insists on
it, `auto` (the default) chooses. They are compiled just in time with torch.utils.cpp_extension into a
cache directory keyed by the sources, torch's version and the compiler flags (see
`cache_dirs`), so a build happens once per machine image: `scripts/setup` builds them, the
engine image builds them at `docker build`, and an engine that finds no build makes one at
start, before `/ready`.

Whatever goes wrong — no compiler, a failed build, a CPU without the instructions — the
engine logs why and runs the PyTorch reference instead; it never stops serving over it.
PREHEAT_ATTENTION_BACKEND=torch turns the kernels off (to compare, or to step around a bad
kernel); PREHEAT_KERNEL_CACHE sets the build cache (default: the Python environment's
share/preheat/kernels, else ~/.cache/preheat/kernels).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = ("bindings.cpp", "attention_avx512.cpp", "extend_attention_avx512.cpp", "gemm_bf16_avx512.cpp", "gemm_bf16_amx.cpp", "gemm_f32_avx512.cpp", "gemm_int8_avx512.cpp",
           "elementwise_avx512.cpp", "attention_avx2.cpp", "extend_attention_avx2.cpp", "gemm_avx2.cpp", "elementwise_avx2.cpp")
# Each instruction set's code generation is switched on inside its kernel files (#pragma
# GCC target); the flags here hold for every file, so the module loads on any x86-64 CPU.
CFLAGS = ("-O3", "-fopenmp", "-std=c++17")
LDFLAGS = ("-fopenmp",)
# /proc/cpuinfo names of what each build executes, best build first.
ISA_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}
REQUIRED_CPU_FLAGS = ISA_CPU_FLAGS["avx512"]  # the best build's (missing_cpu_flags' default)
ENV_CACHE = "PREHEAT_KERNEL_CACHE"
ENV_ISA = "PREHEAT_CPU_KERNELS"
ISA_CHOICES = ("auto", *ISA_CPU_FLAGS)

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
unavailable_reason: str | None = None


def missing_cpu_flags(flags: set[str], isa: str = "avx512") -> list[str]:
    """Pure: the instruction-set flags a CPU lacks for one build (default: AVX-512)."""
    return [f for f in ISA_CPU_FLAGS[isa] if f not in flags]


def runnable_isas(flags: set[str]) -> list[str]:
    """Pure: the builds a CPU with these flags runs, best first."""
    return [isa for isa in ISA_CPU_FLAGS if not missing_cpu_flags(flags, isa)]


# Rows from which a long prompt's product is cheaper through dense rows and the library GEMM
# (oneDNN on AMX-BF16 tiles) than through the skinny kernels, per packed kind, measured on
# Sapphire Rapids (benchmarks/long_prompt_matmul.py, results/long_prompt_matmul.md): for a
# 1536 x 576 matrix the bf16 kernel takes 0.24 ms at 32 rows against 0.16 ms unpacked + oneDNN
# (3.8 vs 0.5 ms at 512); dequantizing int8 / 4-bit codes costs ~0.3 ms, so those switch
# only from ~160 rows (4-bit: 0.49 vs 0.46 ms at 128, 2.0 vs 0.67 ms at 512).
DENSE_PREFILL_ROWS = {"bf16": 32, "int8": 160}
# The same where our kernels multiply on AMX tiles themselves (the avx512 build's `amx()`,
# gemm_bf16_amx.cpp): measured on the Xeon host (2 cores), SmolLM2's four products of a layer,
# the tiles against unpacked / dequantized rows + oneDNN: bf16 0.17 vs 0.89 ms at 32 rows,
# 1.95 vs 2.39 at 512, 4.0 vs 4.4 at 1024, 7.0 vs 4.9 at 1536; 4-bit codes (dequantized into a
# bf16 panel, then the tiles) 0.23 vs 1.89 at 32, 4.4 vs 5.9 at 1024, 8.3 vs 6.3 at 1536.
DENSE_PREFILL_ROWS_AMX_KERNELS = {"bf16": 1024, "int8": 1024}


def dense_prefill_rows(flags: set[str], isa: str, amx_kernels: bool = False) -> dict[str, int]:
    """Pure: per packed kind, the row count from which `linear.apply` multiplies through dense
    rows; empty (never) without AMX-BF16 or on the AVX2 build (an AVX2 CPU's library bf16
    GEMM is slower than our kernel at every size: benchmarks/results/cpu_builds.md).
    `amx_kernels`: the kernels multiply bf16 on AMX tiles themselves, up to a thousand rows
    faster than unpacking for the library."""
    if isa != "avx512" or "amx_bf16" not in flags:
        return {}
    return dict(DENSE_PREFILL_ROWS_AMX_KERNELS if amx_kernels else DENSE_PREFILL_ROWS)


def choose_isa(flags: set[str], override: str | None) -> tuple[str | None, str]:
    """Pure: (build, why) for a CPU's flags and the PREHEAT_CPU_KERNELS value; build None
    when no build runs here (why says what is missing). An override the CPU cannot run is
    refused the same way rather than crashing on an illegal instruction later."""
    override = (override or "auto").strip().lower()
    if override not in ISA_CHOICES:
        raise ValueError(f"{ENV_ISA}={override!r}: expected one of {', '.join(ISA_CHOICES)}")
    if override != "auto":
        if missing := missing_cpu_flags(flags, override):
            return None, f"{ENV_ISA}={override} but the CPU lacks " + ", ".join(missing)
        return override, f"{ENV_ISA}={override}"
    for isa in ISA_CPU_FLAGS:
        if not missing_cpu_flags(flags, isa):
            return isa, f"the CPU has {', '.join(ISA_CPU_FLAGS[isa])}"
    return None, "the CPU lacks " + ", ".join(missing_cpu_flags(flags, "avx2"))


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_key(sources: dict[str, bytes], torch_version: str, flags: tuple[str, ...]) -> str:
    """Pure: what a build depends on, hashed; names the build directory and the module."""
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name] + b"\0")
    h.update(torch_version.encode() + b"\0" + " ".join(flags).encode())
    return h.hexdigest()[:16]


def cache_dirs(environ: dict[str, str] | None = None, prefix: str | None = None) -> list[Path]:
    """Where builds are looked for, in order; a build goes to the first writable one.

    PREHEAT_KERNEL_CACHE when set (the engine image sets it), else the Python environment's
    own `share/preheat/kernels` (scripts/setup builds there: every process of that
    environment finds it whatever its HOME, e.g. engine pods whose cache directory is a
    fresh volume), then the user cache (~/.cache/preheat/kernels)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_CACHE):
        return [Path(environ[ENV_CACHE])]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or Path.home(), ".cache")
    return [Path(prefix or sys.prefix) / "share" / "preheat" / "kernels", Path(base) / "preheat" / "kernels"]


def default_cache_dir() -> Path:
    """The first cache directory a build can be written to."""
    dirs = cache_dirs()
    for d in dirs:
        if _writable(d):
            return d
    return dirs[-1]


def _writable(directory: Path) -> bool:
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.access(probe, os.W_OK)


def _read_sources() -> dict[str, bytes]:
    files = {name: (SOURCE_DIR / name).read_bytes() for name in SOURCES}
    for header in sorted(SOURCE_DIR.glob("*.h")):
        files[header.name] = header.read_bytes()
    return files


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build(cache_dir: Path | None = None, verbose: bool = False) -> ModuleType:
    """Compiles (or finds the cached build) and imports the extension. Raises on failure.
    Importing is safe on any x86-64 CPU; calling a kernel is not (see `load`): the module's
    `avx512` and `avx2` submodules hold the two builds, `isas()` the ones this CPU runs.

    A finished build is imported directly: its name carries the hash of everything it was
    built from, so it cannot be stale, and a read-only cache (the engine image's) works."""
    key = build_key(_read_sources(), torch.__version__, CFLAGS + LDFLAGS)
    name = f"preheat_cpu_{key}"
    if name in sys.modules:
        return sys.modules[name]
    for candidate in [cache_dir] if cache_dir else cache_dirs():
        built = candidate / name / f"{name}.so"
        if built.is_file():
            return _import(built, name)
    directory = (cache_dir or default_cache_dir()) / name
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    log.info("CPU kernels: building %s (once per machine image; about a minute)", name)
    return cpp_extension.load(
        name=name,
        sources=[str(SOURCE_DIR / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(SOURCE_DIR)],
        build_directory=str(directory),
        verbose=verbose,
    )


def load() -> ModuleType | None:
    """The kernels this process uses — the extension's submodule of the build `choose_isa`
    picks (`.isa` names it) — else None (the reason is logged once and kept in
    `unavailable_reason`). Thread-safe; builds at most once per process."""
    global unavailable_reason
    with _lock:
        if "module" in _loaded:
            return _loaded["module"]
        module = None
        try:
            isa, why = choose_isa(read_cpu_flags(), os.environ.get(ENV_ISA))
        except ValueError as exc:  # a misspelt override: said loudly, served on the reference
            isa, why = None, str(exc)
        if isa is None:
            unavailable_reason = why
        else:
            try:
                extension = build()
                if isa not in extension.isas():
                    unavailable_reason = f"the CPU lacks what the {isa} kernels execute (runtime check)"
                else:
                    module = getattr(extension, isa)
            except Exception as exc:  # no compiler, a failed build: serve on the reference
                lines = str(exc).strip().splitlines()
                unavailable_reason = f"build failed: {lines[-1] if lines else repr(exc)}"
        if module is None:
            log.warning("CPU kernels unavailable (%s); using the PyTorch reference", unavailable_reason)
        else:
            unavailable_reason = None
            log.info("CPU kernels: %s, %s build (%s)", extension.__name__, isa, why)
        _loaded["module"] = module
        return module


def main() -> int:
    """`python -m preheat.engine.kernels.cpu_ext`: builds into the cache (setup scripts and
    the image build run this), whatever this machine's CPU is."""
    logging.basicConfig(level=logging.INFO)
    module = build(cache_dir=default_cache_dir(), verbose="-v" in sys.argv)
    print(f"CPU kernels: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
