"""`preheat serve` as a pod sees it: flags, readiness phases, SIGTERM drain, disconnects."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_process import MODEL, start_server, wait_for
from test_metrics import scrape

pytestmark = pytest.mark.slow


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preheat", "serve", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    "args, env, reason",
    [
        (["--port", "abc"], {}, "--port: 'abc' is not a valid int"),
        (["--port", "0"], {}, "--port: 0 is below the minimum 1"),
        (["--dtype", "float8"], {}, "--dtype: 'float8' is not one of"),
        (["--mem-fraction-static", "1.5"], {}, "--mem-fraction-static: 1.5 is above the maximum"),
        ([], {"PREHEAT_MAX_NUM_SEQS": "many"}, "PREHEAT_MAX_NUM_SEQS: 'many' is not a valid int"),
        # An empty key used to switch authentication off without a word.
        (["--api-key", ""], {}, "--api-key: the key is empty"),
        ([], {"PREHEAT_API_KEY": ""}, "--api-key: the key is empty"),
        (["--api-key", "   "], {}, "--api-key: the key is empty"),
        (["--max-queue-len", "0"], {}, "--max-queue-len: 0 is below the minimum 1"),
        (["--grammar-compile-timeout", "0"], {}, "--grammar-compile-timeout: 0.0 must be greater than 0.0"),
    ],
)
def test_bad_setting_fails_at_start_with_one_line(args, env, reason):
    r = run_cli(*args, env=env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], r.stderr


def test_unknown_flag_exits_2():
    r = run_cli("--no-such-flag")
    assert r.returncode == 2 and "--no-such-flag" in r.stderr


def test_help_names_every_flag_and_its_env_var():
    r = run_cli("--help")
    assert r.returncode == 0
    for flag in ["--model", "--served-model-name", "--host", "--port", "--dtype", "--page-size",
                 "--mem-fraction-static", "--max-num-seqs", "--max-model-len",
                 "--chunked-prefill-size", "--disable-radix-cache", "--api-key", "--log-level",
                 "--shutdown-timeout", "--max-request-body-bytes", "--max-queue-len",
                 "--max-request-prompt-tokens", "--grammar-compile-timeout"]:
        assert flag in r.stdout
        assert "PREHEAT_" + flag[2:].replace("-", "_").upper() in r.stdout


def stream_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """Runs one streamed completion in a thread; result["events"] collects its SSE data."""
    result: dict = {"events": [], "first": threading.Event()}

    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(line[6:])
                        result["first"].set()
        except httpx.HTTPError as e:
            result["error"] = repr(e)
        finally:
            result["first"].set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def finish_reasons(events: list[str]) -> list[str]:
    return [c["finish_reason"] for e in events if e != "[DONE]"
            for c in json.loads(e)["choices"] if c["finish_reason"]]


def test_loading_then_ready_then_drain_on_sigterm(tmp_path):
    server = start_server(tmp_path, "--shutdown-timeout", "60", wait_ready=False)
    try:
        first = wait_for(server, lambda r: True, timeout=60)
        # uvicorn answers before the model is loaded: live, not ready
        assert first.status_code == 503 and first.json()["phase"] == "loading", first.text
        assert httpx.get(server.url + "/health").status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"

        wait_for(server, lambda r: r.status_code == 200)
        thread, result = stream_in_background(
            server.url, {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 40,
                         "ignore_eos": True, "stream": True})
        assert result["first"].wait(60) and result["events"], result
        server.proc.send_signal(signal.SIGTERM)

        draining = wait_for(server, lambda r: r.json()["phase"] == "draining", timeout=10)
        assert draining.status_code == 503
        late = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert late.status_code == 503
        # ... and closes its connection: a kept-alive client's retry then opens a new one,
        # which the Service sends to a pod still serving (engine/serve/connection_close.py).
        assert late.headers.get("connection") == "close"
        assert r.headers.get("connection") != "close"  # before draining: kept alive

        thread.join(60)
        assert result["events"][-1] == "[DONE]"
        assert finish_reasons(result["events"]) == ["length"]  # the in-flight stream finished
        assert server.proc.wait(30) == 0
        log = server.log()
        assert "draining" in log and "all requests finished" in log
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_while_the_model_loads_exits_0_at_once(tmp_path):
    """A pod deleted during its start-up: the process exits 0 without waiting for the load
    (which would outlive the grace period) and without aborting in the loader's thread."""
    server = start_server(tmp_path, wait_ready=False)
    try:
        first = wait_for(server, lambda r: True, timeout=60)
        assert first.json()["phase"] == "loading", first.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        log = server.log()
        assert "terminate called" not in log and "Aborted" not in log
        assert "exiting during start-up" in log or "ready in" in log, log[-2000:]
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path):
    server = start_server(tmp_path, "--shutdown-timeout", "1")
    try:
        thread, result = stream_in_background(
            server.url, {"model": MODEL, "prompt": "Go on forever.", "max_tokens": 480,
                         "ignore_eos": True, "stream": True})
        assert result["first"].wait(60) and result["events"], result
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - start < 15
        thread.join(10)
        assert finish_reasons(result["events"]) == ["abort"]
        assert "aborting 1 in-flight request" in server.log()
    finally:
        server.stop(signal.SIGKILL)


def test_client_disconnect_aborts_the_request_at_once(server, http):
    before = scrape(server.url)
    with http.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 480,
        "ignore_eos": True, "stream": True,
    }) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # the connection is closed here, long before 480 tokens

    def settled() -> dict:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            m = scrape(server.url)
            if m["preheat_num_requests_running"] == 0 and m["preheat_kv_cache_request_pages"] == 0:
                return m
            time.sleep(0.05)
        pytest.fail(f"request still running 5s after the client left: {m}")

    m1 = settled()
    assert m1["preheat_requests_total{finish_reason=abort}"] == before.get(
        "preheat_requests_total{finish_reason=abort}", 0) + 1
    time.sleep(1.0)
    m2 = scrape(server.url)
    assert m2["preheat_generation_tokens_total"] == m1["preheat_generation_tokens_total"]
    assert m2["preheat_generation_tokens_total"] - before["preheat_generation_tokens_total"] < 200
    assert httpx.get(server.url + "/ready").json()["in_flight"] == 0
