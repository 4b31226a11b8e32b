"""Which engine folders may import which, read from the source with `ast` (imports inside
functions count: a lazy import is still a dependency).

The directions (docs/engine-internals.md, "Import directions"):

- engine/kernels imports nothing else of the engine: the model and the kernel backends reach
  the kernels, never the reverse (RoPE's numerics live in kernels/rope.py for that reason);
- engine/model imports engine/kernels, never engine/distributed (the Sharder protocol is on the
  model side, engine/model/sharding.py) nor the runner or the engine that drive it;
- engine/distributed imports engine/model (it builds and drives shards of it);
- engine/kv imports neither the runner nor the engine (fp8 calibration is handed its prefill).
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
PREFIX = "preheat.engine."

# folder -> what it must not import ("*" = anything in preheat.engine outside the folder).
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"*"},
    "model": {"distributed", "runner", "engine", "cuda_graph", "llm", "async_engine"},
    "kv": {"runner", "engine", "cuda_graph", "llm", "async_engine"},
}
# Among these, the folder graph has no cycle, whatever the rules above allow.
ACYCLIC = ("kernels", "model", "distributed", "kv")


def imported_modules(path: Path) -> set[str]:
    """Every preheat.engine module a file names in an import statement, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from preheat.engine import kv`
    return {m for m in found if m.startswith(PREFIX)}


def top_name(module: str) -> str:
    """The engine folder or top-level module a dotted name lies in: preheat.engine.kv.pool -> kv."""
    return module[len(PREFIX):].split(".")[0]


def folder_edges() -> dict[str, dict[str, list[str]]]:
    """folder -> {imported folder or top-level module -> the files that import it}."""
    edges: dict[str, dict[str, list[str]]] = {}
    known = {p.name for p in ENGINE.iterdir() if p.is_dir()} | {p.stem for p in ENGINE.glob("*.py")}
    for folder in sorted(p for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        out = edges.setdefault(folder.name, {})
        for path in sorted(folder.rglob("*.py")):
            for target in {top_name(m) for m in imported_modules(path)} & known - {folder.name}:
                out.setdefault(target, []).append(str(path.relative_to(ENGINE)))
    return edges


def test_the_scanner_sees_imports_including_lazy_ones():
    """Guards the checks below from passing vacuously."""
    edges = folder_edges()
    assert "model" in edges["distributed"]  # e.g. distributed/driver.py
    assert "distributed/worker.py" in edges["distributed"]["kv"]  # imported inside run()
    assert top_name("preheat.engine.kv.pool") == "kv"


def test_no_folder_imports_what_its_direction_forbids():
    edges = folder_edges()
    problems = []
    for folder, forbidden in FORBIDDEN.items():
        for target, files in edges[folder].items():
            if "*" in forbidden or target in forbidden:
                problems.append(f"engine/{folder} imports engine/{target}: {', '.join(files)}")
    assert not problems, "\n".join(problems)


def test_kernels_model_distributed_and_kv_import_each_other_without_a_cycle():
    edges = folder_edges()
    graph = {f: [t for t in edges[f] if t in ACYCLIC] for f in ACYCLIC}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            assert state.get(nxt) != "open", "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for folder in ACYCLIC:
        if folder not in state:
            visit(folder, [])
