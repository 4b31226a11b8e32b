"""Triton for the kernel modules, or a stand-in that fails only when a kernel is used.

Triton is an optional extra (`pip install "preheat[gpu]"`). The kernel modules define their
kernels with `@triton.jit` at import time; importing them must still work without it (a CPU
install imports every module: tooling, docs, `preheat serve --help`), and only launching a
kernel, or any other use of Triton, raises an ImportError that says how to install it.
backend.py never picks the Triton backend when Triton is missing.
"""

from __future__ import annotations

from typing import Any, NoReturn

INSTALL_HINT = 'Triton is not installed: pip install "preheat[gpu]" (or pip install triton)'


class _MissingTriton:
    """Stands in for the `triton` and `triton.language` modules when Triton is missing."""

    def __init__(self, name: str, cause: BaseException) -> None:
        self._name = name
        self._cause = cause

    def _fail(self, *_: Any, **__: Any) -> NoReturn:
        raise ImportError(INSTALL_HINT) from self._cause

    def jit(self, fn: Any = None, **_: Any) -> Any:
        """`@triton.jit` and `@triton.jit(...)`: a kernel that raises when launched."""
        if fn is None:
            return self.jit
        return _MissingKernel(fn.__name__, self._fail)

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._fail()


class _MissingKernel:
    def __init__(self, name: str, fail: Any) -> None:
        self.__name__ = name
        self._fail = fail

    def __getitem__(self, grid: Any) -> Any:
        return self._fail

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._fail()


try:
    import triton
    import triton.language as tl

    available = True
except ImportError as e:
    triton = _MissingTriton("triton", e)  # type: ignore[assignment]
    tl = _MissingTriton("triton.language", e)  # type: ignore[assignment]
    available = False

__all__ = ["INSTALL_HINT", "available", "tl", "triton"]
