"""benchmarks/before_after.py measures the revisions it is given: a worktree left by an
earlier run under a name that has since moved (HEAD, a branch) is brought to the commit the
name means now, not measured as it was."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("before_after", REPO / "benchmarks" / "before_after.py")
before_after = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(before_after)
git = before_after.git


@pytest.fixture
def workdir(tmp_path: Path):
    yield tmp_path
    tree = tmp_path / "tree-HEAD"
    if tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def test_a_stale_tree_under_a_moving_name_is_moved_to_the_commit_it_names(workdir: Path):
    if git("rev-list", "--count", "HEAD") == "1":
        pytest.fail("the test needs the repository's history (a clone with at least two commits)")
    head = git("rev-parse", "HEAD")
    tree = before_after.checkout("HEAD", workdir)
    assert git("rev-parse", "HEAD", cwd=tree) == head
    assert (workdir / "pkg-HEAD" / "preheat" / "engine").resolve() == (tree / "engine").resolve()

    git("checkout", "--detach", "-q", "HEAD~1", cwd=tree)  # what an earlier run's tree looks like
    assert git("rev-parse", "HEAD", cwd=tree) != head
    assert before_after.checkout("HEAD", workdir) == tree
    assert git("rev-parse", "HEAD", cwd=tree) == head
