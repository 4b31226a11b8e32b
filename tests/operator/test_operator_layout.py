"""Issue 26: the operator stays walkable. No function in operator/ over 100 lines (split a
long one by what it does, as reconcile is observe -> decide -> act -> report), and a pure
decision and its I/O shell are named alike (scale_decide.py / scale_reconcile.py, as
decide.py / reconcile.py), not two letters apart."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
MAX_LINES = 100


def test_no_operator_function_is_over_100_lines():
    long = []
    for path in sorted(OPERATOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_autoscaler_pair_is_named_like_decide_and_reconcile():
    names = {p.stem for p in OPERATOR.glob("*.py")}
    assert {"decide", "reconcile", "scale_decide", "scale_reconcile"} <= names
    assert not names & {"autoscale", "autoscaler"}
