"""Which attention backend a process picks, and why."""

from __future__ import annotations

import pytest

from preheat.engine.kernels.backend import choose_backend, select_attention_backend

AVAILABLE = lambda: None  # noqa: E731  (the CPU kernels run here)
UNAVAILABLE = lambda: "the CPU lacks avx512_bf16"  # noqa: E731


@pytest.mark.parametrize(
    "device,triton,cpu_kernels,expected",
    [
        ("cuda", True, AVAILABLE, "triton"),
        ("cuda", False, AVAILABLE, "torch"),  # no Triton: still serve, on the reference
        ("cpu", True, AVAILABLE, "cpu"),
        ("cpu", True, UNAVAILABLE, "torch"),  # no AVX-512 BF16 (or no compiler): the reference
        ("mps", True, AVAILABLE, "torch"),
    ],
)
def test_triton_on_cuda_and_our_kernels_on_a_capable_cpu(device, triton, cpu_kernels, expected):
    assert choose_backend(device, triton, None, False, cpu_kernels=cpu_kernels)[0] == expected


def test_a_gpu_process_never_builds_the_cpu_kernels():
    def forbidden():
        raise AssertionError("asked for the CPU kernels")

    assert choose_backend("cuda", True, None, False, cpu_kernels=forbidden)[0] == "triton"
    assert choose_backend("cpu", True, "torch", False, cpu_kernels=forbidden)[0] == "torch"


def test_a_caller_without_cpu_kernels_keeps_the_old_choices():
    """The MoE experts share this decision but have no CPU kernel: no "cpu" for them."""
    assert choose_backend("cpu", True, None, False)[0] == "torch"
    with pytest.raises(ValueError, match="expected one of torch, triton$"):
        choose_backend("cpu", True, "cpu", False)


def test_why_the_cpu_kernels_are_not_used_is_given():
    assert choose_backend("cpu", False, None, False, cpu_kernels=UNAVAILABLE) == (
        "torch", "device is cpu; CPU kernels unavailable: the CPU lacks avx512_bf16",
    )


def test_override_can_force_the_reference_on_a_gpu():
    assert choose_backend("cuda", True, "torch", interpreting=False) == (
        "torch", "PREHEAT_ATTENTION_BACKEND=torch",
    )


@pytest.mark.parametrize(
    "device,triton,override,interpreting,message",
    [
        ("cuda", True, "flash", False, "expected one of torch, triton, cpu"),
        ("cuda", False, "triton", False, "not installed"),
        ("cpu", True, "triton", False, "TRITON_INTERPRET=1"),
        ("cuda", True, "cpu", False, "cpu on a cuda device"),
    ],
)
def test_an_override_that_cannot_be_honoured_is_refused(device, triton, override, interpreting, message):
    with pytest.raises(ValueError, match=message):
        choose_backend(device, triton, override, interpreting, cpu_kernels=AVAILABLE)


def test_forcing_the_cpu_kernels_where_they_cannot_run_is_refused():
    with pytest.raises(ValueError, match="CPU kernels are unavailable: the CPU lacks avx512_bf16"):
        choose_backend("cpu", True, "cpu", False, cpu_kernels=UNAVAILABLE)


def test_triton_on_cpu_is_allowed_under_the_interpreter():
    assert choose_backend("cpu", True, "triton", interpreting=True)[0] == "triton"


def test_this_cpu_process_uses_its_kernels_and_the_override_restores_the_reference(monkeypatch, caplog):
    """CI's CPU has AVX-512 VNNI/BF16 (and AVX2): the kernels are built (scripts/setup did) and used."""
    from preheat.engine.kernels import cpu_ext

    monkeypatch.delenv("PREHEAT_ATTENTION_BACKEND", raising=False)
    if not cpu_ext.runnable_isas(cpu_ext.read_cpu_flags()):
        pytest.skip("this CPU runs neither build of the kernels")
    with caplog.at_level("INFO", logger="preheat.engine.kernels.backend"):
        assert select_attention_backend("cpu") == "cpu"
    assert "attention backend: cpu (the CPU runs Preheat's CPU kernels)" in caplog.text
    monkeypatch.setenv("PREHEAT_ATTENTION_BACKEND", "torch")
    assert select_attention_backend("cpu") == "torch"
