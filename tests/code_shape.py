"""Size limits on the product code (issue 26), read with `ast`: the engine's and the
operator's layout tests share them."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

MAX_FUNCTION_LINES = 100
MAX_CLASS_METHODS = 25


def oversized(paths: Iterable[Path], root: Path, classes: bool = True) -> list[str]:
    """Every function over MAX_FUNCTION_LINES lines and (with `classes`) every class over
    MAX_CLASS_METHODS methods."""
    found = []
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root)}:{node.lineno}" if hasattr(node, "lineno") else ""
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{where} {node.name} ({lines} lines)")
            elif classes and isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if methods > MAX_CLASS_METHODS:
                    found.append(f"{where} class {node.name} ({methods} methods)")
    return found
