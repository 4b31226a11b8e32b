"""How the CPU kernels are found, built and refused: pure decisions, and the fallback when a
build fails (the engine must still serve, on the PyTorch reference)."""

from __future__ import annotations

import logging

import pytest

from preheat.engine.kernels import cpu_ext
from preheat.engine.kernels.backend import select_attention_backend


def test_the_cpu_check_names_what_is_missing():
    full = set(cpu_ext.REQUIRED_CPU_FLAGS) | {"sse4_2"}
    assert cpu_ext.missing_cpu_flags(full) == []
    assert cpu_ext.missing_cpu_flags(full - {"avx512_bf16", "avx512_vnni"}) == ["avx512_vnni", "avx512_bf16"]
    assert cpu_ext.missing_cpu_flags(set()) == list(cpu_ext.REQUIRED_CPU_FLAGS)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\nbugs\t\t: none\n")
    assert cpu_ext.read_cpu_flags(str(info)) == {"fpu", "avx512f", "avx512_bf16"}
    assert cpu_ext.read_cpu_flags(str(tmp_path / "missing")) == set()


def test_the_build_key_changes_with_sources_torch_and_flags():
    key = cpu_ext.build_key({"a.cpp": b"int x;"}, "2.13.0", ("-O3",))
    assert key == cpu_ext.build_key({"a.cpp": b"int x;"}, "2.13.0", ("-O3",))
    assert key != cpu_ext.build_key({"a.cpp": b"int y;"}, "2.13.0", ("-O3",))
    assert key != cpu_ext.build_key({"a.cpp": b"int x;"}, "2.14.0", ("-O3",))
    assert key != cpu_ext.build_key({"a.cpp": b"int x;"}, "2.13.0", ("-O2",))


def test_a_failed_build_falls_back_to_the_reference(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'preheat_cpu'\ng++: command not found")

    monkeypatch.setattr(cpu_ext, "_loaded", {})
    monkeypatch.setattr(cpu_ext, "read_cpu_flags", lambda: set(cpu_ext.REQUIRED_CPU_FLAGS))
    monkeypatch.setattr(cpu_ext, "build", broken)
    monkeypatch.delenv("PREHEAT_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, logger="preheat.engine.kernels.cpu_ext"):
        assert cpu_ext.load() is None
    assert cpu_ext.unavailable_reason == "build failed: g++: command not found"
    assert "using the PyTorch reference" in caplog.text
    assert select_attention_backend("cpu") == "torch"


def test_a_cpu_without_the_instructions_never_builds(monkeypatch):
    monkeypatch.setattr(cpu_ext, "_loaded", {})
    monkeypatch.setattr(cpu_ext, "read_cpu_flags", lambda: {"sse4_2", "avx", "fma"})
    monkeypatch.setattr(cpu_ext, "build", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    monkeypatch.delenv(cpu_ext.ENV_ISA, raising=False)
    assert cpu_ext.load() is None
    assert cpu_ext.unavailable_reason == "the CPU lacks avx2, f16c"


AVX2_LAPTOP = {"sse4_2", "avx", "avx2", "fma", "f16c"}
SAPPHIRE_RAPIDS = AVX2_LAPTOP | set(cpu_ext.ISA_CPU_FLAGS["avx512"])


def test_the_best_build_the_cpu_runs_is_chosen_and_an_override_must_be_runnable():
    assert cpu_ext.runnable_isas(SAPPHIRE_RAPIDS) == ["avx512", "avx2"]
    assert cpu_ext.runnable_isas(AVX2_LAPTOP) == ["avx2"]
    assert cpu_ext.runnable_isas({"sse4_2"}) == []
    assert cpu_ext.choose_isa(SAPPHIRE_RAPIDS, None)[0] == "avx512"
    assert cpu_ext.choose_isa(AVX2_LAPTOP, "auto") == ("avx2", "the CPU has avx2, fma, f16c")
    assert cpu_ext.choose_isa(SAPPHIRE_RAPIDS, "AVX2") == ("avx2", "PREHEAT_CPU_KERNELS=avx2")
    assert cpu_ext.choose_isa(AVX2_LAPTOP, "avx512") == (
        None, "PREHEAT_CPU_KERNELS=avx512 but the CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni, "
        "avx512_bf16",
    )
    with pytest.raises(ValueError, match="PREHEAT_CPU_KERNELS='sse': expected one of auto, avx512, avx2"):
        cpu_ext.choose_isa(SAPPHIRE_RAPIDS, "sse")


def test_an_avx2_only_cpu_loads_the_avx2_build(monkeypatch):
    """What an AVX2-only laptop does, forced on this machine: the extension's avx2 submodule
    is the one handed out, and it is the one whose kernels run (their `isa` says so)."""
    extension = cpu_ext.build()
    if "avx2" not in extension.isas():
        pytest.skip("this CPU runs no AVX2 code")
    monkeypatch.setattr(cpu_ext, "_loaded", {})
    monkeypatch.setattr(cpu_ext, "read_cpu_flags", lambda: AVX2_LAPTOP)
    monkeypatch.delenv(cpu_ext.ENV_ISA, raising=False)
    module = cpu_ext.load()
    assert module is extension.avx2 and module.isa == "avx2"
    monkeypatch.setattr(cpu_ext, "_loaded", {})
    monkeypatch.setattr(cpu_ext, "read_cpu_flags", lambda: AVX2_LAPTOP)
    monkeypatch.setenv(cpu_ext.ENV_ISA, "avx512")  # insisting on a build the CPU lacks: the reference
    assert cpu_ext.load() is None and cpu_ext.unavailable_reason.startswith("PREHEAT_CPU_KERNELS=avx512 but")


def test_builds_are_found_in_the_environment_before_the_user_cache(tmp_path):
    """An engine pod's HOME and cache directory are fresh volumes: the build scripts/setup
    made in the Python environment must still be found there."""
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert cpu_ext.cache_dirs(env, prefix="/opt/venv") == [
        cpu_ext.Path("/opt/venv/share/preheat/kernels"), tmp_path / "xdg" / "preheat" / "kernels",
    ]
    assert cpu_ext.cache_dirs({**env, "PREHEAT_KERNEL_CACHE": "/k"}, prefix="/opt/venv") == [cpu_ext.Path("/k")]


def test_long_prompts_go_dense_only_where_the_library_gemm_has_amx():
    assert cpu_ext.dense_prefill_rows(SAPPHIRE_RAPIDS | {"amx_bf16"}, "avx512") == cpu_ext.DENSE_PREFILL_ROWS
    # Kernels on AMX tiles themselves keep prompts of up to a thousand rows.
    amx = cpu_ext.dense_prefill_rows(SAPPHIRE_RAPIDS | {"amx_bf16"}, "avx512", amx_kernels=True)
    assert amx == cpu_ext.DENSE_PREFILL_ROWS_AMX_KERNELS and all(amx[k] > cpu_ext.DENSE_PREFILL_ROWS[k] for k in amx)
    assert cpu_ext.dense_prefill_rows(SAPPHIRE_RAPIDS, "avx512", amx_kernels=True) == {}
    assert cpu_ext.dense_prefill_rows(SAPPHIRE_RAPIDS, "avx512") == {}  # e.g. Zen 4: not measured, kernels
    assert cpu_ext.dense_prefill_rows(SAPPHIRE_RAPIDS | {"amx_bf16"}, "avx2") == {}  # an AVX2 CPU has no AMX
