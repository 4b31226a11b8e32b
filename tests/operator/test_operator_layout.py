"""Issue 26: the operator stays walkable. No function in operator/ over 100 lines (split a
long one by what it does, as reconcile is observe -> decide -> act -> report), and a pure
decision and its I/O shell are named alike (scale_decide.py / scale_reconcile.py, as
decide.py / reconcile.py), not two letters apart."""

from __future__ import annotations

from pathlib import Path

from code_shape import oversized

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def test_no_operator_function_is_over_100_lines():
    long = oversized(OPERATOR.glob("*.py"), OPERATOR, classes=False)
    assert not long, long


def test_the_autoscaler_pair_is_named_like_decide_and_reconcile():
    names = {p.stem for p in OPERATOR.glob("*.py")}
    assert {"decide", "reconcile", "scale_decide", "scale_reconcile"} <= names
    assert not names & {"autoscale", "autoscaler"}
