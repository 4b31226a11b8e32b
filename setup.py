"""Package discovery for the one `preheat` distribution (metadata lives in pyproject.toml).

The card's layout keeps each program in a top-level folder (`engine/`, `operator/`, ...)
mapped onto an import package (`preheat.engine`, `preheat.operator`, ...). setuptools'
`find` cannot map several folders onto one namespace, and a hand-kept `packages = [...]`
list silently drops a new sub-package (it once left `preheat.engine.distributed` out of
the wheel). So every folder below a program root is a package: one holding only data
(`engine/kernels/cpu/`, the C++ kernel sources) too, as setuptools asks of data folders.

operator/ has no `__init__.py` on purpose: a folder named "operator" on sys.path must never
shadow the standard library's `operator` module (an implicit namespace package loses to a
regular module), while `preheat.operator` still imports. Discovery therefore walks folders,
not `__init__.py` files.
"""

from __future__ import annotations

import os

from setuptools import setup

# import package -> folder, relative to this file. A new program adds one line here.
PROGRAM_DIRS: dict[str, str] = {
    "preheat": "cli",
    "preheat.engine": "engine",
    "preheat.operator": "operator",
    "preheat.router": "router",
}


def discover(package_dirs: dict[str, str]) -> list[str]:
    """Every folder under a program root (less caches and hidden ones), as a package name."""
    here = os.path.dirname(os.path.abspath(__file__))
    found: set[str] = set(package_dirs)
    for package, folder in package_dirs.items():
        root = os.path.join(here, folder)
        for dirpath, dirnames, _files in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            if dirpath != root:
                rel = os.path.relpath(dirpath, root).replace(os.sep, ".")
                found.add(f"{package}.{rel}")
    return sorted(found)


setup(packages=discover(PROGRAM_DIRS), package_dir=PROGRAM_DIRS)
