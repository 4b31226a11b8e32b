"""The engine's import rules, read from the folders' README.md files and checked over the source.

Each folder's README ends with a line `May import: `a`, `b`` naming the engine folders and
top-level modules (`config`, `runner`, ...) its modules may import, or `May import: nothing`.
`violations()` lists every import that breaks a folder's rule; `cycles()` lists every
import cycle between modules (imports that run when a module is imported: not those inside
functions or under `if TYPE_CHECKING:`). Both read the source with `ast`, import nothing, and
are what CI checks (tests/engine/test_import_rules.py), so a README's rule is never just
prose. A plain test rather than import-linter: the engine's package root is a folder mapped
onto `preheat.engine` (package-dir), which grimp's discovery does not follow.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"
PACKAGE = "preheat.engine"
RULE = re.compile(r"^May import:\s*(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module or package, dotted
    line: int
    at_import_time: bool  # False inside a function or under TYPE_CHECKING


def module_name(path: Path, root: Path = ENGINE) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGE, *parts])


def _targets(node: ast.Import | ast.ImportFrom, root: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith(PACKAGE)]
    if not node.module or not node.module.startswith(PACKAGE) or node.level:
        return []
    out = []
    for alias in node.names:  # `from preheat.engine.kv import pool`: the module, when it is one
        sub = f"{node.module}.{alias.name}"
        rel = Path(*sub.split(".")[2:])
        out.append(sub if (root / rel).with_suffix(".py").exists() or (root / rel).is_dir() else node.module)
    return out


def imports(root: Path = ENGINE) -> Iterator[Import]:
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        yield from _walk(tree, me, root, at_import_time=True)


def _walk(node: ast.AST, me: str, root: Path, at_import_time: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target in _targets(child, root):
                yield Import(me, target, child.lineno, at_import_time)
            continue
        lazy = at_import_time and (
            isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
        )
        yield from _walk(child, me, root, at_import_time and not lazy)


def unit(module: str) -> str:
    """The folder or top-level module a dotted name belongs to (`kv`, `config`, ...)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def rules(root: Path = ENGINE) -> dict[str, set[str]]:
    """Folder -> the units its README lets it import."""
    out = {}
    for readme in sorted(root.glob("*/README.md")):
        found = RULE.findall(readme.read_text())
        if len(found) != 1:
            raise ValueError(f"{readme}: needs exactly one 'May import:' line, found {len(found)}")
        names = {n.strip().strip("`") for n in found[0].split(",")} - {"", "nothing"}
        out[readme.parent.name] = names
    return out


def violations(root: Path = ENGINE) -> list[str]:
    allowed = rules(root)
    out = []
    for imp in imports(root):
        src, dst = unit(imp.module), unit(imp.target)
        if src in allowed and dst != src and dst not in allowed[src]:
            out.append(f"{imp.module}:{imp.line} imports {imp.target}: engine/{src}/README.md does not allow `{dst}`")
    return out


def cycles(root: Path = ENGINE) -> list[list[str]]:
    """Strongly connected components of more than one module, over import-time imports."""
    graph: dict[str, set[str]] = {}
    for imp in imports(root):
        graph.setdefault(imp.module, set())
        if imp.at_import_time and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
