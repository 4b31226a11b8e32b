"""S3 downloads through boto3 against moto's S3 server: once, verified, resumed, and
refused quickly when the bucket or the credentials are wrong (engine/model/s3.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.engine.model.download import ModelUnavailable, Progress
from preheat.engine.model.fetch import fetch_model
from preheat.engine.model.loader import DEFAULT_GGUF_NAME


def fetch(model, tmp_path, progress=None):
    return fetch_model(model, str(tmp_path / "dl"), None, progress or Progress())


def test_folder_once_then_from_the_marker(s3_env, tiny_dir, tmp_path):
    progress = Progress()
    got = fetch("s3://models/tiny-llama", tmp_path, progress)
    files = sorted(p.name for p in tiny_dir.iterdir() if p.is_file())
    assert sorted(p.name for p in Path(got.path).iterdir()) == files
    for name in files:
        assert (Path(got.path) / name).read_bytes() == (tiny_dir / name).read_bytes()
    total = sum((tiny_dir / n).stat().st_size for n in files)
    assert progress.fetched == total and progress.as_dict() == {"bytes_done": total, "bytes_total": total, "source": "s3"}
    assert got.served_name == "tiny-llama"
    again = Progress()
    assert fetch("s3://models/tiny-llama", tmp_path, again).path == got.path
    assert again.fetched == 0  # listed, found complete: no object read


def test_one_gguf_object_uploaded_in_parts_resumes(s3_env, tmp_path):
    """The GGUF is above boto3's multipart threshold: its ETag is not an MD5, so the size
    is the check. A partial file left by a killed process is continued, not restarted."""
    from download_repos import embedded_gguf

    source = embedded_gguf()
    target = tmp_path / "dl" / "s3" / "models" / "gguf" / DEFAULT_GGUF_NAME
    target.parent.mkdir(parents=True)
    have = source.stat().st_size // 2
    with source.open("rb") as f:
        (target.parent / (DEFAULT_GGUF_NAME + ".incomplete")).write_bytes(f.read(have))
    progress = Progress()
    got = fetch(f"s3://models/gguf/{DEFAULT_GGUF_NAME}", tmp_path, progress)
    assert got.path == str(target)
    assert progress.fetched == source.stat().st_size - have
    assert target.stat().st_size == source.stat().st_size
    assert not (target.parent / (DEFAULT_GGUF_NAME + ".incomplete")).exists()


@pytest.mark.parametrize("model, says", [
    ("s3://no-such-bucket/x", "not found"),
    ("s3://models/no-such-prefix", "no objects"),
])
def test_missing_models_end_quickly(s3_env, tmp_path, model, says):
    with pytest.raises(ModelUnavailable, match=says) as e:
        fetch(model, tmp_path)
    assert model in str(e.value)


def test_refused_credentials(s3_env, tmp_path, monkeypatch):
    """moto checks signatures once authentication is on (INITIAL_NO_AUTH_ACTION_COUNT=0):
    an unknown access key is InvalidAccessKeyId, as on AWS."""
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    with pytest.raises(ModelUnavailable, match="refused the credentials"):
        fetch("s3://models/tiny-llama", tmp_path)
