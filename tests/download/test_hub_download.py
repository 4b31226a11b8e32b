"""Hub downloads through huggingface_hub against the hub stand-in: once, verified, resumed,
locked, and refused quickly when the model is not there (engine/model/hub.py)."""

from __future__ import annotations

import threading
import time

import pytest
from download_repos import GGUF_REPO, PRIVATE_REPO, TINY_REPO, TOKEN

from preheat.engine.model.download import DownloadFailed, ModelUnavailable, Progress
from preheat.engine.model.fetch import fetch_model
from preheat.engine.model.loader import DEFAULT_GGUF_NAME


def fetch(model, tmp_path, progress=None):
    return fetch_model(model, str(tmp_path / "dl"), None, progress or Progress())


def repo_size(hub, repo, names=None):
    return sum(p.stat().st_size for n, p in hub.repos[repo].files.items() if names is None or n in names)


def test_gguf_once_then_from_the_marker(hub_endpoint, hub, tmp_path):
    fetched_bytes = []
    progress = Progress(on_fetched=fetched_bytes.append)
    before = hub.bytes_served(GGUF_REPO)
    got = fetch(f"hf://{GGUF_REPO}/{DEFAULT_GGUF_NAME}", tmp_path, progress)
    size = repo_size(hub, GGUF_REPO, {DEFAULT_GGUF_NAME})
    assert got.path.endswith(DEFAULT_GGUF_NAME) and got.served_name == GGUF_REPO
    assert hub.bytes_served(GGUF_REPO) - before == size  # only the named file, once
    assert progress.as_dict() == {"bytes_done": size, "bytes_total": size, "source": "hub"}
    assert sum(fetched_bytes) == size == progress.fetched

    # A restart: one revision call, no tree listing, no file bytes.
    requests = len(hub.requests)
    again = Progress()
    assert fetch(f"hf://{GGUF_REPO}/{DEFAULT_GGUF_NAME}", tmp_path, again).path == got.path
    assert hub.bytes_served(GGUF_REPO) - before == size
    assert [p for _, p in hub.requests[requests:]] == [f"/api/models/{GGUF_REPO}"]
    assert again.fetched == 0 and again.as_dict()["bytes_done"] == size


def test_safetensors_repo_takes_weights_config_and_tokenizer(hub_endpoint, hub, tmp_path):
    got = fetch(TINY_REPO, tmp_path)
    names = {p.name for p in __import__("pathlib").Path(got.path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert got.served_name == TINY_REPO


def test_interrupted_download_resumes(hub_endpoint, hub, tmp_path):
    size = repo_size(hub, GGUF_REPO, {DEFAULT_GGUF_NAME})
    cut = hub.cut_after = size // 3  # the connection drops a third of the way
    before = hub.bytes_served(GGUF_REPO)
    fetch(f"hf://{GGUF_REPO}/{DEFAULT_GGUF_NAME}", tmp_path)
    assert hub.cut_after is None
    # huggingface_hub asked again with a Range from what it had written (its last buffer
    # may be lost with the connection), not from zero.
    assert hub.ranges and 0 < hub.ranges[-1] <= cut
    assert size < hub.bytes_served(GGUF_REPO) - before < size + cut


def test_a_damaged_file_is_caught_once_and_fetched_again(hub_endpoint, hub, tmp_path):
    got = fetch(TINY_REPO, tmp_path)
    weights = __import__("pathlib").Path(got.path) / "model.safetensors"
    blob = weights.resolve()
    for marker in (tmp_path / "dl" / ".preheat" / "complete").iterdir():
        marker.unlink()  # as if the process died after writing, before the marker
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(DownloadFailed, match="digest"):
        fetch(TINY_REPO, tmp_path)
    before = hub.bytes_served(TINY_REPO)
    fetch(TINY_REPO, tmp_path)  # the next start downloads it again, and it checks out
    assert hub.bytes_served(TINY_REPO) - before == blob.stat().st_size


def test_two_processes_sharing_the_dir_download_once(hub_endpoint, hub, tmp_path):
    before = hub.bytes_served(GGUF_REPO)
    hub.rate = 40e6  # long enough for the second to arrive while the first downloads
    results, errors = [], []

    def run():
        try:
            results.append(fetch(f"hf://{GGUF_REPO}/{DEFAULT_GGUF_NAME}", tmp_path).path)
        except Exception as e:  # reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        hub.rate = None
    assert not errors and len(set(results)) == 1
    assert hub.bytes_served(GGUF_REPO) - before == repo_size(hub, GGUF_REPO, {DEFAULT_GGUF_NAME})


@pytest.mark.parametrize("model, says", [
    ("test-org/no-such-model", "repository not found"),
    (f"hf://{GGUF_REPO}/missing.gguf", "no file 'missing.gguf'"),
    (f"hf://{GGUF_REPO}@no-such-branch/{DEFAULT_GGUF_NAME}", "revision 'no-such-branch' not found"),
    (f"hf://{GGUF_REPO}", "name one of its GGUF files"),
    (PRIVATE_REPO, "repository not found, or access refused"),
])
def test_missing_models_end_quickly_naming_the_model(hub_endpoint, hub, tmp_path, model, says):
    started = len(hub.requests)
    with pytest.raises(ModelUnavailable, match=says) as e:
        fetch(model, tmp_path)
    assert model.removeprefix("hf://").split("/")[1].split("@")[0] in str(e.value)
    assert len(hub.requests) - started <= 3  # no retry storm


def test_private_repo_with_a_token_and_a_wrong_one(hub_endpoint, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ModelUnavailable, match="refused the credentials"):
        fetch(PRIVATE_REPO, tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert fetch(PRIVATE_REPO, tmp_path).served_name == PRIVATE_REPO


def test_offline_uses_the_complete_copy_and_refuses_a_missing_one(hub_endpoint, hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    got = fetch(TINY_REPO, tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.requests)
    assert fetch(TINY_REPO, tmp_path).path == got.path
    assert len(hub.requests) == requests  # not one call
    with pytest.raises(DownloadFailed, match="HF_HUB_OFFLINE"):
        fetch(f"hf://{GGUF_REPO}/{DEFAULT_GGUF_NAME}", tmp_path)


def test_an_unreachable_hub_fails_fast(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    t = time.monotonic()
    with pytest.raises(DownloadFailed, match="could not be reached"):
        fetch(TINY_REPO, tmp_path)
    assert time.monotonic() - t < 60


def test_the_python_api_takes_a_hub_id(hub_endpoint, hub, tmp_path):
    from preheat.engine.llm import LLM
    from preheat.engine.request.sampling_params import SamplingParams

    with LLM(model=TINY_REPO, download_dir=str(tmp_path / "dl"), weight_cache_dir="off", dtype="float32",
             page_size=4, max_total_tokens=256, max_model_len=64) as llm:
        [out] = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0))
        assert len(out.outputs[0].token_ids) == 3
