"""benchmarks/llama_server.py builds llama.cpp's server for the CPU it runs on: every GGML
instruction-set option on only where the CPU reports it. A fixed list with AVX-VNNI (the VEX
encoding) built a server that died with SIGILL on a Zen 4, which has only AVX-512 VNNI; and a
build made on one CPU is cached apart from another CPU's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "llama_server", Path(__file__).resolve().parents[1] / "benchmarks" / "llama_server.py"
)
llama_server = importlib.util.module_from_spec(_spec)
sys.modules["llama_server"] = llama_server
_spec.loader.exec_module(llama_server)

ZEN4 = set(
    "fpu avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16".split()
)
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_bf16"}
AVX2_LAPTOP = set("fpu avx avx2 fma f16c bmi2".split())


def options(flags: set[str]) -> dict[str, str]:
    return dict(f[2:].split("=") for f in llama_server.ggml_flags(flags))


def test_zen4_gets_avx512_vnni_but_not_avx_vnni() -> None:
    got = options(ZEN4)
    assert got["GGML_NATIVE"] == "OFF"
    assert got["GGML_AVX512_VNNI"] == "ON" and got["GGML_AVX512_BF16"] == "ON"
    assert got["GGML_AVX_VNNI"] == "OFF"


def test_avx2_cpu_gets_no_avx512() -> None:
    got = options(AVX2_LAPTOP)
    assert got["GGML_AVX2"] == "ON"
    assert all(got[o] == "OFF" for o in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX_VNNI"))


def test_avx512_needs_every_part() -> None:
    assert options(ZEN4 - {"avx512bw"})["GGML_AVX512"] == "OFF"
    assert options(SAPPHIRE_RAPIDS)["GGML_AVX_VNNI"] == "ON"


def test_cache_per_flag_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PREHEAT_LLAMA_SERVER_CACHE", raising=False)
    monkeypatch.setattr(llama_server.Path, "home", lambda: tmp_path)
    monkeypatch.setattr(llama_server, "read_cpu_flags", lambda: ZEN4)
    zen4 = llama_server.cache_dir()
    monkeypatch.setattr(llama_server, "read_cpu_flags", lambda: SAPPHIRE_RAPIDS)
    assert llama_server.cache_dir() != zen4
    assert zen4.parent == tmp_path / ".cache" / "preheat" / "llama-server"
    monkeypatch.setenv("PREHEAT_LLAMA_SERVER_CACHE", str(tmp_path / "mine"))
    assert llama_server.cache_dir() == tmp_path / "mine"

