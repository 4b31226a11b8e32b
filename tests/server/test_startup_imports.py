"""`preheat serve` listens before it imports torch (issue 27): importing torch (and safetensors,
transformers) on the main thread before uvicorn started kept /health and /ready from
answering for seconds on a small CPU, and put the engine's imports in the "process" start-up
step. Run in a fresh interpreter: the server's own start, with its socket replaced by a probe
of what the interpreter imported by then."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from preheat.engine.serve import draining_server, server_main

async def listen(self, *args, **kwargs):
    heavy = sorted(m for m in ("torch", "transformers", "safetensors", "xgrammar") if m in sys.modules)
    print("IMPORTED AT LISTEN:", ",".join(heavy) or "none", flush=True)

draining_server.DrainingServer.serve = listen
server_main.main(sys.argv[1:])
"""


def test_the_server_listens_before_torch_transformers_or_xgrammar_are_imported(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "--port", "1", "--warmup-templates", str(REPO / "warmup_templates"),
         "--snapshot-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("IMPORTED AT LISTEN:")]
    assert lines == ["IMPORTED AT LISTEN: none"], (done.stdout[-2000:], done.stderr[-3000:])
