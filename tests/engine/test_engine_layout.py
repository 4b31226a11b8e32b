"""Issue 26: the engine stays walkable. At most 15 files at the top of engine/ (every concept
is a folder with a README.md), no function over 100 lines and no class over 25 methods."""

from __future__ import annotations

from pathlib import Path

from code_shape import oversized

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _sources() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_top_of_engine_holds_at_most_15_files() -> None:
    files = [p.name for p in ENGINE.iterdir() if p.is_file() and not p.name.startswith(".")]
    assert len(files) <= 15, sorted(files)


def test_every_engine_folder_has_a_readme() -> None:
    folders = [p for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert [p.name for p in folders if not (p / "README.md").exists()] == []


def test_no_function_over_100_lines_and_no_class_over_25_methods() -> None:
    assert oversized(_sources(), ENGINE) == []
