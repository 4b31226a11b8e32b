"""The import rules each engine folder's README states hold, and no modules import each other
in a cycle (engine/import_rules.py reads both from the source)."""

from __future__ import annotations

from pathlib import Path

import import_rules
import pytest


def test_every_folder_import_is_one_its_readme_allows() -> None:
    assert import_rules.violations() == []


def test_no_module_import_cycles() -> None:
    assert import_rules.cycles() == []


def test_every_engine_folder_states_its_rule() -> None:
    folders = {p.name for p in import_rules.ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(import_rules.rules())


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_back_edge_is_reported_with_the_readme_that_forbids_it(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "low/__init__.py": "", "low/README.md": "May import: nothing\n",
        "low/a.py": "def f():\n    from preheat.engine.high import b\n",  # lazy: still a violation
        "high/__init__.py": "", "high/README.md": "May import: `low`\n",
        "high/b.py": "from preheat.engine.low import a\n",
    })
    found = import_rules.violations(root)
    assert len(found) == 1 and "preheat.engine.low.a:2" in found[0] and "`high`" in found[0]


def test_a_cycle_at_import_time_is_found_and_a_lazy_one_is_not(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "x.py": "from preheat.engine import y\n",
        "y.py": "from preheat.engine.x import f\n",
        "p.py": "from preheat.engine import q\n",
        "q.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from preheat.engine import p\n",
    })
    assert import_rules.cycles(root) == [["preheat.engine.x", "preheat.engine.y"]]


def test_a_readme_without_a_rule_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"f/__init__.py": "", "f/README.md": "# f\n"})
    with pytest.raises(ValueError, match="May import"):
        import_rules.rules(root)
