"""`preheat serve --tensor-parallel-size 2` as a user runs it: warmup templates run under
tensor parallelism before /ready, the openai SDK gets a chat answer, SIGTERM drains, writes a
snapshot that records the sharding and leaves no worker behind. A worker that dies makes
rank 0 fail loudly (/health 503, requests refused) instead of hanging, and a rank 0 killed
outright takes its workers with it (no orphans). A tiny random-weight Llama keeps each
server's start to a couple of seconds plus one worker process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import serve_process
import yaml
from tiny_models import build_tiny_model

FLAGS = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "512", "--max-total-tokens", "2048",
         "--max-num-seqs", "4", "--weight-cache-dir", "off", "--served-model-name", "tiny", "--log-level", "info"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE

    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_NAME)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-tp"), "llama", tokenizer)


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":  # ppid; a zombie has exited
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def start(tmp: Path, model: Path, *flags: str, name: str) -> serve_process.Server:
    server = serve_process.start(tmp, ["--model", str(model), *FLAGS, *flags], name=name)
    server.wait_ready(timeout=300)
    return server


def is_tp_worker(pid: int) -> bool:
    """A tensor-parallel rank (`python -m preheat.engine.distributed.worker`), not one of the
    engine's other children (the grammar compiler's forkserver and resource tracker, which
    the built-in warmup starts)."""
    try:
        return b"preheat.engine.distributed.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def only_worker(server: serve_process.Server) -> int:
    workers = [pid for pid in children(server.proc.pid) if is_tp_worker(pid)]
    assert len(workers) == 1, f"expected one worker process, found {workers}\n{server.log()}"
    return workers[0]


def test_serves_chat_after_warming_and_stops_cleanly_with_a_sharded_snapshot(tmp_path, tiny_model):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "chat.yaml").write_text(yaml.safe_dump({"templates": [
        {"name": "tp-chat", "system": "You are a terse assistant for a bicycle shop in Utrecht.",
         "conversations": [[{"role": "user", "content": "Do you repair tires?"}]],
         "concurrency": [1, 2], "max_tokens": 3},
    ]}))  # fmt: skip
    snapshots = tmp_path / "snapshots"
    server = start(tmp_path, tiny_model, "--warmup-templates", str(templates), "--snapshot-dir", str(snapshots),
                   "--snapshot-interval", "0", name="tp-serve")  # fmt: skip
    try:
        worker = only_worker(server)
        assert any(phase == "warming" for _, _, phase in server.phases) or "warming: templates" in server.log()
        warmed = re.search(r"^preheat_warmup_requests_total ([0-9.]+)$", server.metrics(), re.M)
        assert warmed and float(warmed.group(1)) >= 3  # the conversation at concurrency 1 and 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", max_tokens=5, temperature=0,
            messages=[{"role": "system", "content": "You are a terse assistant for a bicycle shop in Utrecht."},
                      {"role": "user", "content": "Do you sell bells?"}],
        )  # fmt: skip
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
        assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the warmed system prompt
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    assert not alive(worker), "the worker outlived rank 0's clean exit"
    (snapshot,) = [p for p in snapshots.iterdir() if p.name.startswith("snap-")]
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["sharding"]["tensor_parallel_size"] == 2 and manifest["prefixes"]


def test_a_dead_worker_makes_the_engine_dead_not_hung(tmp_path, tiny_model):
    server = start(tmp_path, tiny_model, name="tp-worker-dies")
    try:
        os.kill(only_worker(server), signal.SIGKILL)

        def dead() -> bool:
            return httpx.get(server.url + "/health", timeout=5).status_code == 503

        wait_until(dead, 30, "/health answers 503 after the worker died")
        # /health names the exception's type only (no raw text to clients: docs/security.md);
        # the log says which rank died.
        assert "TensorParallelFailure" in httpx.get(server.url + "/health", timeout=5).json()["error"]
        wait_until(lambda: "tensor-parallel worker rank 1" in server.log(), 10, "the log names the dead rank")
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       timeout=30)  # fmt: skip
        assert r.status_code >= 500 and "error" in r.json()
    finally:
        server.stop(signal.SIGKILL)


def test_workers_exit_when_rank_zero_is_killed(tmp_path, tiny_model):
    server = start(tmp_path, tiny_model, name="tp-rank0-dies")
    worker = only_worker(server)
    server.stop(signal.SIGKILL)
    wait_until(lambda: not alive(worker), 20, "the worker exits once rank 0 is gone")
