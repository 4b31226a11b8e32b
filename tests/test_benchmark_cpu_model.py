"""The CPU named in benchmark results: a VM reports a generic model name ("AMD EPYC"), and
hosts with that one name ran 512-bit dot products at different rates (Zen 4: one a cycle,
Zen 5: two), so the header names the core where family and flags tell it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bandwidth", Path(__file__).resolve().parents[1] / "benchmarks" / "bandwidth.py"
)
bandwidth = importlib.util.module_from_spec(_spec)
sys.modules["bandwidth"] = bandwidth  # its dataclasses look their module up
_spec.loader.exec_module(bandwidth)


def cpuinfo(tmp_path: Path, vendor: str, family: str, flags: str, name: str = "AMD EPYC") -> str:
    block = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel name\t: {name}\nflags\t\t: {flags}\n"
    path = tmp_path / "cpuinfo"
    path.write_text(block + "\n" + block.replace("processor\t: 0", "processor\t: 1"))
    return str(path)


def test_zen4_zen5_and_amx_named(tmp_path: Path) -> None:
    assert bandwidth.cpu_model(cpuinfo(tmp_path, "AuthenticAMD", "25", "fpu avx2 avx512f")) == "AMD EPYC (Zen 4)"
    assert bandwidth.cpu_model(cpuinfo(tmp_path, "AuthenticAMD", "26", "fpu avx2 avx512f")) == "AMD EPYC (Zen 5)"
    xeon = cpuinfo(tmp_path, "GenuineIntel", "6", "avx512f amx_tile amx_bf16", "Intel(R) Xeon(R) Processor")
    assert bandwidth.cpu_model(xeon) == "Intel(R) Xeon(R) Processor (AMX-BF16)"


def test_unknown_core_keeps_the_name(tmp_path: Path) -> None:
    assert bandwidth.cpu_model(cpuinfo(tmp_path, "AuthenticAMD", "25", "fpu avx2")) == "AMD EPYC"  # Zen 3: no AVX-512
    assert bandwidth.cpu_model(str(tmp_path / "missing")) == "unknown CPU"
