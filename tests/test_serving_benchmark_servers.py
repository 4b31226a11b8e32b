"""benchmarks/serving_vs_peers.py takes a comma-separated `--servers`: a name it does not
know (a typo, or one split at a comma) is refused before anything starts, where it used to
be dropped without a word and a 30-minute run came back without that server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "serving_vs_peers", Path(__file__).resolve().parents[1] / "benchmarks" / "serving_vs_peers.py"
)
serving_vs_peers = importlib.util.module_from_spec(_spec)
sys.modules["serving_vs_peers"] = serving_vs_peers
_spec.loader.exec_module(serving_vs_peers)


def test_an_unknown_server_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        serving_vs_peers.main(["--servers", "preheat int8,preheat GGUF, 8-bit", "--workdir", str(tmp_path),
                               "--out", str(tmp_path / "out.md")])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown ['preheat GGUF', '8-bit']" in err
    assert not (tmp_path / "out.md").exists() and not any(tmp_path.iterdir())


def test_every_named_server_is_one_the_benchmark_can_start(tmp_path: Path) -> None:
    names = serving_vs_peers.ALL_SERVERS
    assert all("," not in n for n in names) and len(set(names)) == len(names)
    built = serving_vs_peers.servers(tmp_path, 8000, 16, 4096, [n for n in names if n != serving_vs_peers.LLAMA])
    assert sorted(s.name for s in built) == sorted(n for n in names if n != serving_vs_peers.LLAMA)
    act8 = next(s for s in built if s.name == serving_vs_peers.GGUF_ACT8)
    assert act8.argv[-2:] == ["--int8-activation-bits", "8"]
