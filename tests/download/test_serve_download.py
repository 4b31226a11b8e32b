"""`preheat serve --model hf://...` end to end against the hub stand-in: /ready says
downloading with bytes, the counter counts, a restart reads the cache, and a missing model
ends the process at once with the reason in the termination message."""

from __future__ import annotations

import re

import httpx
from download_repos import TINY_REPO
from serve_process import start

FLAGS = ["--dtype", "float32", "--max-model-len", "64", "--max-total-tokens", "2048",
         "--page-size", "16", "--max-num-seqs", "4"]


def counter(text: str) -> float:
    m = re.search(r"^preheat_model_download_bytes_total (\S+)$", text, re.M)
    assert m, "preheat_model_download_bytes_total missing"
    return float(m.group(1))


def test_download_phase_then_ready_then_cached(hub, tmp_path):
    size = sum(p.stat().st_size for p in hub.repos[TINY_REPO].files.values())
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    flags = [*FLAGS, "--model", f"hf://{TINY_REPO}", "--download-dir", str(tmp_path / "dl"),
             "--weight-cache-dir", "off"]
    hub.rate = 2e6  # slow enough to see the phase a few times
    seen = []
    try:
        srv = start(tmp_path, flags, env=env)
        r = srv.wait_for(lambda r: (seen.append(r.json()) or r.status_code == 200), timeout=180)
    finally:
        hub.rate = None
    downloading = [b for b in seen if b.get("phase") == "downloading"]
    # bytes_total is 0 until the hub has listed the files, then their sum.
    assert downloading and {b["bytes_total"] for b in downloading} <= {0, size}
    assert {b["model"] for b in downloading} == {TINY_REPO}
    assert any(0 < b["bytes_done"] for b in downloading)
    assert [b["bytes_done"] for b in downloading] == sorted(b["bytes_done"] for b in downloading)
    assert r.json()["model"] == TINY_REPO  # the hub id is the served name, as in vLLM
    text = srv.metrics()
    assert counter(text) == size
    assert 'preheat_phase{phase="downloading"} 0.0' in text  # a phase of the gauge, over now
    out = httpx.post(srv.url + "/v1/completions", json={"model": TINY_REPO, "prompt": "hi", "max_tokens": 2},
                     timeout=60)
    assert out.status_code == 200
    assert srv.stop() == 0

    before = hub.bytes_served(TINY_REPO)
    srv = start(tmp_path, flags, env=env, name="restart")
    srv.wait_ready(180)
    assert counter(srv.metrics()) == 0 and hub.bytes_served(TINY_REPO) == before
    srv.stop()


def test_a_missing_model_ends_the_process_with_the_reason(hub, tmp_path):
    log = tmp_path / "termination-log"
    env = {"HF_ENDPOINT": hub.url, "PREHEAT_TERMINATION_MESSAGE_PATH": str(log)}
    srv = start(tmp_path, [*FLAGS, "--model", "test-org/no-such-model", "--download-dir", str(tmp_path / "dl")],
                env=env)
    assert srv.proc.wait(120) == 1
    message = log.read_text()
    assert message.startswith("ModelUnavailable: hf://test-org/no-such-model: repository not found"), message
