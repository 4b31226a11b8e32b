"""The serving layer's seam to the engine (engine/engine_client.py): AsyncEngine and
Engine offer every member the Protocols name, with the same parameters, and the serving
layer reaches the engine through the Protocols only, not through the classes.

A type checker checks the same conformance (server_main.py hands an AsyncEngine to
create_app); this test needs none and also catches a member renamed on one side only."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from fake_engine import FakeEngine

from preheat.engine.async_engine import AsyncEngine, RequestStream
from preheat.engine.engine import Engine
from preheat.engine.engine_client import EngineClient, OutputStream, ServedEngine
from preheat.engine.metrics import Metrics

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def members(proto: type) -> tuple[set[str], set[str]]:
    """(data members, methods and properties) a Protocol declares."""
    data = set(proto.__dict__.get("__annotations__", {}))
    calls = {n for n, v in vars(proto).items()
             if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}
    calls |= {"__aiter__"} & set(vars(proto))
    return data, calls


def assert_same_parameters(proto: type, cls: type, name: str) -> None:
    want = getattr(proto, name)
    got = getattr(cls, name)
    if isinstance(want, property):
        assert isinstance(got, property), f"{cls.__name__}.{name} should be a property"
        return
    want_params = [(p.name, p.kind, p.default is inspect.Parameter.empty)
                   for p in inspect.signature(want).parameters.values()]
    got_params = [(p.name, p.kind, p.default is inspect.Parameter.empty)
                  for p in inspect.signature(got).parameters.values()]
    assert got_params == want_params, f"{cls.__name__}.{name}{inspect.signature(got)} != {inspect.signature(want)}"


def test_async_engine_offers_every_member_of_engine_client() -> None:
    data, calls = members(EngineClient)
    assert {"submit_sequences", "run_in_engine", "phase", "engine"} <= calls
    aengine = AsyncEngine(Metrics(), FakeEngine())
    for name in data | calls:
        assert hasattr(aengine, name), f"AsyncEngine has no {name}"
    for name in calls - {"engine"}:  # AsyncEngine.engine is a plain attribute: read-only here
        assert_same_parameters(EngineClient, AsyncEngine, name)


def test_request_stream_is_an_output_stream() -> None:
    data, calls = members(OutputStream)
    for name in calls:
        assert_same_parameters(OutputStream, RequestStream, name)
    stream = RequestStream(AsyncEngine(Metrics(), FakeEngine()), "r-1", None)  # type: ignore[arg-type]
    for name in data:
        assert hasattr(stream, name), f"RequestStream has no {name}"


def _engine_attributes() -> set[str]:
    """What an Engine instance has: its class's names and every `self.x = ...` in it."""
    tree = ast.parse((ENGINE / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    names = set(dir(Engine))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:  # `self.a, self.b = ...` too
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def test_engine_offers_every_member_of_served_engine() -> None:
    data, calls = members(ServedEngine)
    have = _engine_attributes()
    for name in data | calls:
        assert name in have, f"Engine has no {name}"
    for name in calls:
        assert_same_parameters(ServedEngine, Engine, name)


# The serving layer (what the HTTP routes run). Of async_engine.py it may import the
# exceptions of admission (refusals.py maps them to HTTP): they are part of the contract.
SERVING = ["api", "sglang", "serve/server.py", "serve/probes.py", "serve/admin_routes.py",
           "serve/error_handlers.py", "serve/connection_close.py"]
ALLOWED = {"preheat.engine.async_engine": {"EngineDead", "EngineNotReady"}}


def _serving_files() -> list[Path]:
    files: list[Path] = []
    for part in SERVING:
        path = ENGINE / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_the_serving_layer_reaches_the_engine_through_the_protocol_only() -> None:
    files = _serving_files()
    assert len(files) > 10
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("preheat.engine.engine",
                                                                     "preheat.engine.async_engine"):
                names = {a.name for a in node.names}
                extra = names - ALLOWED.get(node.module, set())
                assert not extra, f"{f.relative_to(ENGINE)} imports {sorted(extra)} from {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name in ("preheat.engine.engine", "preheat.engine.async_engine")
                               for a in node.names), f"{f.relative_to(ENGINE)} imports the engine module"
