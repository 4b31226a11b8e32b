"""Which attention backend a process picks, and why."""

from __future__ import annotations

import pytest

from preheat.engine.kernels.backend import choose_backend, select_attention_backend


@pytest.mark.parametrize(
    "device,triton,expected",
    [
        ("cuda", True, "triton"),
        ("cuda", False, "torch"),  # no Triton: still serve, on the reference
        ("cpu", True, "torch"),
        ("mps", True, "torch"),
    ],
)
def test_triton_only_on_cuda_with_triton_installed(device, triton, expected):
    assert choose_backend(device, triton, None, interpreting=False)[0] == expected


def test_override_can_force_the_reference_on_a_gpu():
    assert choose_backend("cuda", True, "torch", interpreting=False) == (
        "torch", "PREHEAT_ATTENTION_BACKEND=torch",
    )


@pytest.mark.parametrize(
    "device,triton,override,interpreting,message",
    [
        ("cuda", True, "flash", False, "expected one of torch, triton"),
        ("cuda", False, "triton", False, "not installed"),
        ("cpu", True, "triton", False, "TRITON_INTERPRET=1"),
    ],
)
def test_an_override_that_cannot_be_honoured_is_refused(device, triton, override, interpreting, message):
    with pytest.raises(ValueError, match=message):
        choose_backend(device, triton, override, interpreting)


def test_triton_on_cpu_is_allowed_under_the_interpreter():
    assert choose_backend("cpu", True, "triton", interpreting=True)[0] == "triton"


def test_this_cpu_process_uses_the_reference(monkeypatch, caplog):
    monkeypatch.delenv("PREHEAT_ATTENTION_BACKEND", raising=False)
    with caplog.at_level("INFO", logger="preheat.engine.kernels.backend"):
        assert select_attention_backend("cpu") == "torch"
    assert "attention backend: torch (device is cpu)" in caplog.text
