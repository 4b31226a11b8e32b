"""Hot-prefix KV snapshots: round trip, newest-valid-wins, every refusal, shared directories."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from preheat.engine.kv import snapshot as snap
from preheat.engine.kv.checksum import tensor_sha256
from preheat.engine.kv.snapshot import (
    REJECT_REASONS,
    PrefixRecord,
    choose_records,
    fingerprint_from_hf_config,
    list_snapshots,
    load_latest_snapshot,
    prune_snapshots,
    save_snapshot,
    tokenizer_hash,
)

from .snapshot_helpers import fingerprint, manifest, record, write_manifest, writer_process

FP = fingerprint()


def same(a: list[PrefixRecord], b: list[PrefixRecord]) -> bool:
    return [(r.token_ids, r.hits, r.pinned) for r in a] == [(r.token_ids, r.hits, r.pinned) for r in b] and all(
        x.kv.dtype == y.kv.dtype and torch.equal(x.kv, y.kv) for x, y in zip(a, b)
    )


# --------------------------------------------------------------------------- round trip


def test_a_saved_snapshot_restores_bit_identical_pinned_first_then_by_hits(tmp_path):
    records = [record(8, 1, hits=2), record(4, 2, hits=1, pinned=True), record(12, 3, hits=9)]
    path = save_snapshot(tmp_path, FP, records, "pod-a")
    result = load_latest_snapshot(tmp_path, FP)
    assert result.path == path and result.rejected == [] and result.writer_id == "pod-a"
    assert same(result.records, [records[1], records[2], records[0]])
    assert result.num_tokens == 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_every_kv_dtype_round_trips(tmp_path, dtype):
    fp = fingerprint(dtype=snap.dtype_name(dtype))
    records = [record(4, 5, dtype=dtype)]
    save_snapshot(tmp_path, fp, records, "w")
    assert same(load_latest_snapshot(tmp_path, fp).records, records)


def test_the_manifest_describes_every_prefix(tmp_path):
    path = save_snapshot(tmp_path, FP, [record(8, 1, hits=3, pinned=True)], "pod-a")
    m = manifest(path)
    assert (m["format"], m["format_version"], m["fingerprint"], m["writer_id"]) == (snap.FORMAT, 2, FP, "pod-a")
    assert abs(m["created_at"] - time.time()) < 60
    (e,) = m["prefixes"]
    assert (e["num_tokens"], e["kv_start"], e["pages"], e["hits"], e["pinned"]) == (8, 0, 2, 3, True)
    assert (e["shape"], e["dtype"], len(e["sha256"])) == ([2, 2, 8, 2, 4], "bfloat16", 64)
    assert m["files"][e["file"]]["size"] == (path / e["file"]).stat().st_size
    assert sorted(p.name for p in path.iterdir()) == sorted(["manifest.json", e["file"]])


def test_large_snapshots_are_split_into_several_files(tmp_path):
    records = [record(8, i) for i in range(5)]
    path = save_snapshot(tmp_path, FP, records, "w", max_file_bytes=2 * records[0].kv.numel() * 2)
    assert len(manifest(path)["files"]) == 3
    assert same(load_latest_snapshot(tmp_path, FP).records, records)


def test_max_tokens_restores_pinned_then_hottest_that_fit(tmp_path):
    records = [record(8, 1, hits=50), record(4, 2, pinned=True), record(12, 3, hits=90), record(4, 4, hits=1)]
    save_snapshot(tmp_path, FP, records, "w")
    got = load_latest_snapshot(tmp_path, FP, max_tokens=17).records
    # pinned (4) + hottest 12 = 16; the 8-token prefix does not fit, the 4-token one would not either
    assert [r.token_ids for r in got] == [records[1].token_ids, records[2].token_ids]


def test_choose_records_skips_what_does_not_fit_and_keeps_caller_order_on_ties():
    a, b, c = record(8, 1, hits=5), record(8, 2, hits=5), record(4, 3, hits=1)
    assert choose_records([a, b, c], max_tokens=12) == [a, c]
    assert choose_records([b, a, c], None) == [b, a, c]
    assert choose_records([a, b, c], None, score=lambda r: -r.hits) == [c, a, b]


def test_records_that_do_not_match_the_fingerprint_are_a_caller_error(tmp_path):
    with pytest.raises(ValueError, match="multiple of the page size"):
        save_snapshot(tmp_path, FP, [PrefixRecord([1, 2, 3], torch.zeros(2, 2, 3, 2, 4, dtype=torch.bfloat16))], "w")
    with pytest.raises(ValueError, match="dtype"):
        save_snapshot(tmp_path, FP, [record(4, 1, dtype=torch.float32)], "w")
    with pytest.raises(ValueError, match="shape"):
        save_snapshot(tmp_path, FP, [PrefixRecord([1] * 4, torch.zeros(3, 2, 4, 2, 4, dtype=torch.bfloat16))], "w")
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    save_snapshot(tmp_path, FP, [record(4, 1)], "w")

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snap, "save_file", disk_full)
    with pytest.raises(OSError):
        save_snapshot(tmp_path, FP, [record(4, 2)], "w")
    assert len(os.listdir(tmp_path)) == 1
    assert same(load_latest_snapshot(tmp_path, FP).records, [record(4, 1)])


def test_an_empty_or_missing_root_restores_nothing_without_complaint(tmp_path):
    assert load_latest_snapshot(tmp_path / "absent", FP).records == []
    result = load_latest_snapshot(tmp_path, FP)
    assert (result.records, result.path, result.rejected) == ([], None, [])


def test_an_empty_snapshot_is_valid(tmp_path):
    path = save_snapshot(tmp_path, FP, [], "w")
    result = load_latest_snapshot(tmp_path, FP)
    assert (result.path, result.records, result.rejected) == (path, [], [])


# --------------------------------------------------------------------------- newest valid wins


def test_the_newest_snapshot_wins(tmp_path):
    save_snapshot(tmp_path, FP, [record(4, 1)], "a")
    save_snapshot(tmp_path, FP, [record(4, 2)], "b")
    assert same(load_latest_snapshot(tmp_path, FP).records, [record(4, 2)])


def test_a_refused_newest_snapshot_falls_back_to_the_previous_one(tmp_path, caplog):
    old = save_snapshot(tmp_path, FP, [record(4, 1)], "a")
    new = save_snapshot(tmp_path, FP, [record(4, 2)], "b")
    (new / "manifest.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="preheat.engine.kv.snapshot"):
        result = load_latest_snapshot(tmp_path, FP)
    assert result.path == old and same(result.records, [record(4, 1)])
    assert [(r.path, r.reason) for r in result.rejected] == [(str(new), "manifest_unparsable")]
    assert f"path={new} reason=manifest_unparsable" in caplog.text


def test_readers_ignore_temp_and_trash_directories(tmp_path):
    save_snapshot(tmp_path, FP, [record(4, 1)], "a")
    (tmp_path / ".tmp-b-0000").mkdir()
    (tmp_path / ".tmp-b-0000" / "manifest.json").write_text("{}")
    (tmp_path / ".trash-0000").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    result = load_latest_snapshot(tmp_path, FP)
    assert same(result.records, [record(4, 1)]) and result.rejected == []


# --------------------------------------------------------------------------- refusals


def refused(tmp_path: Path, expected_reason: str) -> str:
    """Loads the root, expects exactly one refused snapshot and nothing restored."""
    result = load_latest_snapshot(tmp_path, FP)
    assert result.records == [] and result.path is None
    assert [r.reason for r in result.rejected] == [expected_reason], result.rejected
    assert expected_reason in REJECT_REASONS
    return result.rejected[0].detail


@pytest.fixture
def one(tmp_path) -> Path:
    return save_snapshot(tmp_path, FP, [record(8, 1, pinned=True)], "pod-a")


def tensor_file(path: Path) -> Path:
    return path / manifest(path)["prefixes"][0]["file"]


@pytest.mark.parametrize(
    "field, value",
    [("architecture", "MistralForCausalLM"), ("dtype", "float16"), ("page_size", 8), ("num_layers", 3),
     ("tokenizer_hash", "sha256:other"), ("model_id", "another-finetune")],
)  # fmt: skip
def test_a_snapshot_from_another_model_dtype_page_size_or_tokenizer_is_refused(tmp_path, field, value):
    save_snapshot(tmp_path, FP, [record(8, 1)], "w")
    other = {**FP, field: value}
    result = load_latest_snapshot(tmp_path, other)
    assert [r.reason for r in result.rejected] == ["fingerprint_mismatch"] and result.records == []
    assert result.rejected[0].detail.startswith(f"{field}: snapshot has")


def test_a_missing_manifest_is_refused(tmp_path, one):
    (one / "manifest.json").unlink()
    refused(tmp_path, "manifest_missing")


@pytest.mark.parametrize("text", ["{ not json", "[1, 2]", "\xff\xfe", ""])
def test_an_unparsable_manifest_is_refused(tmp_path, one, text):
    (one / "manifest.json").write_bytes(text.encode("latin-1"))
    refused(tmp_path, "manifest_unparsable")


@pytest.mark.parametrize("version", [1, 3, 0, "2", None, True])
def test_an_unknown_format_version_is_refused(tmp_path, one, version):
    m = manifest(one)
    m["format_version"] = version
    write_manifest(one, m)
    refused(tmp_path, "unknown_version")


def _lie(path: Path, **changes) -> None:
    m = manifest(path)
    m["prefixes"][0].update(changes)
    write_manifest(path, m)


@pytest.mark.parametrize(
    "changes, detail",
    [
        ({"pages": 3}, "pages 3"),
        ({"num_tokens": 4}, "num_tokens 4"),
        ({"token_ids": list(range(6)), "num_tokens": 6}, "multiple of 4"),
        ({"shape": [2, 2, 8, 2, 8]}, "shape"),
        ({"dtype": "float32"}, "dtype"),
        ({"token_ids": "0 1 2"}, "token_ids"),
        ({"token_ids": [-1] * 8}, "token_ids"),
        ({"hits": -1}, "hits"),
        ({"pinned": "yes"}, "pinned"),
        ({"sha256": "abc"}, "sha256"),
        ({"file": "other.safetensors"}, "not listed"),
    ],
)
def test_a_manifest_that_contradicts_itself_or_the_model_is_refused(tmp_path, one, changes, detail):
    _lie(one, **changes)
    assert detail in refused(tmp_path, "manifest_invalid")


def test_a_manifest_with_wrong_structure_is_refused(tmp_path, one):
    m = manifest(one)
    m["prefixes"] = {"0": m["prefixes"][0]}
    write_manifest(one, m)
    refused(tmp_path, "manifest_invalid")


def test_a_manifest_from_another_program_is_refused(tmp_path, one):
    m = manifest(one)
    m["format"] = "someone-elses-cache"
    write_manifest(one, m)
    refused(tmp_path, "manifest_invalid")


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd.safetensors", "sub/x.safetensors", ".hidden.safetensors", "x.bin"])
def test_a_tensor_file_name_escaping_the_directory_is_refused(tmp_path, one, name):
    (tmp_path / "x.safetensors").write_bytes(tensor_file(one).read_bytes())  # the bait, outside
    m = manifest(one)
    m["files"] = {name: m["files"][m["prefixes"][0]["file"]]}
    m["prefixes"][0]["file"] = name
    write_manifest(one, m)
    refused(tmp_path, "unsafe_path")


def test_a_tensor_file_that_is_a_symlink_is_refused(tmp_path, one):
    target = tensor_file(one)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    refused(tmp_path, "unsafe_path")


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(tmp_path, one):
    (one / "manifest.json").unlink()
    os.mkfifo(one / "manifest.json")
    refused(tmp_path, "unsafe_path")


def test_a_snapshot_directory_that_is_a_symlink_is_refused(tmp_path):
    real = save_snapshot(tmp_path / "elsewhere", FP, [record(4, 1)], "a")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / real.name).symlink_to(real)
    result = load_latest_snapshot(tmp_path / "root", FP)
    assert [r.reason for r in result.rejected] == ["unsafe_path"] and result.records == []


def test_a_missing_tensor_file_is_refused(tmp_path, one):
    tensor_file(one).unlink()
    refused(tmp_path, "file_missing")


def test_a_truncated_tensor_file_is_refused(tmp_path, one):
    f = tensor_file(one)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 17])
    assert "manifest says" in refused(tmp_path, "truncated")


def test_a_tensor_file_with_bytes_appended_is_refused(tmp_path, one):
    with open(tensor_file(one), "ab") as f:
        f.write(b"\0" * 64)
    refused(tmp_path, "size_mismatch")


def test_a_manifest_that_lies_about_the_tensor_shape_is_refused(tmp_path, one):
    # The file really holds 4 tokens of KV; the manifest (sizes and checksum made consistent
    # with the file) claims 8 tokens. Shape is checked before a byte of data is used.
    e = manifest(one)["prefixes"][0]
    small = record(4, 9).kv
    save_file({e["tensor"]: small}, str(tensor_file(one)))
    m = manifest(one)
    m["files"][e["file"]]["size"] = tensor_file(one).stat().st_size
    m["prefixes"][0]["sha256"] = tensor_sha256(small)
    write_manifest(one, m)
    assert "manifest says" in refused(tmp_path, "size_mismatch")


def test_a_manifest_naming_a_tensor_the_file_lacks_is_refused(tmp_path, one):
    _lie(one, tensor="prefix.99")
    refused(tmp_path, "size_mismatch")


def test_a_bit_flip_in_the_kv_data_is_refused(tmp_path, one):
    f = tensor_file(one)
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x10  # inside the tensor data, the last bytes of the file
    f.write_bytes(bytes(data))
    assert "sha256" in refused(tmp_path, "checksum_mismatch")


def test_a_corrupt_safetensors_header_of_the_right_size_is_refused(tmp_path, one):
    f = tensor_file(one)
    data = bytearray(f.read_bytes())
    data[8:16] = b"\x00garbage"  # inside the JSON header
    f.write_bytes(bytes(data))
    refused(tmp_path, "unreadable")


def test_a_root_that_cannot_be_listed_is_an_io_error_not_a_crash(tmp_path):
    (tmp_path / "file").write_text("x")
    result = load_latest_snapshot(tmp_path / "file", FP)
    assert [r.reason for r in result.rejected] == ["io_error"] and result.records == []


def test_every_refusal_reason_is_exercised_by_this_file():
    # This file, its attacker's half (signatures, hostile files) and the restore step.
    here = Path(__file__).parent
    text = "".join((here / n).read_text() for n in ("test_snapshot.py", "test_snapshot_trust.py",
                                                     "test_snapshot_peer.py"))
    assert [r for r in REJECT_REASONS if f'"{r}"' not in text] == []


# --------------------------------------------------------------------------- pruning and sharing


def test_saving_keeps_the_newest_few_and_prunes_the_rest(tmp_path):
    paths = [save_snapshot(tmp_path, FP, [record(4, i)], "w", keep=2, grace_seconds=0) for i in range(4)]
    assert list_snapshots(tmp_path) == [paths[3], paths[2]]


def test_a_snapshot_superseded_less_than_a_restore_ago_is_kept(tmp_path):
    paths = [save_snapshot(tmp_path, FP, [record(4, i)], "w", keep=1) for i in range(3)]
    assert list_snapshots(tmp_path) == paths[::-1]  # all young: a reader may hold any of them
    superseded = snap.snapshot_created_ns(paths[1]) / 1e9  # when paths[0] stopped being newest
    assert prune_snapshots(tmp_path, keep=1, now=superseded + snap.RESTORE_GRACE_SECONDS - 1) == []
    later = snap.snapshot_created_ns(paths[2]) / 1e9 + snap.RESTORE_GRACE_SECONDS + 1  # a float clock: not the boundary itself
    assert prune_snapshots(tmp_path, keep=1, now=later) == [paths[1], paths[0]]


def test_pruning_keeps_the_newest_of_each_model(tmp_path):
    other = {**FP, "model_id": "sha256:a-fine-tune"}
    ours = [save_snapshot(tmp_path, FP, [record(4, i)], "a", keep=1, grace_seconds=0) for i in range(3)]
    theirs = save_snapshot(tmp_path, other, [record(4, 9)], "b", keep=1, grace_seconds=0)
    newest_ours = save_snapshot(tmp_path, FP, [record(4, 10)], "a", keep=1, grace_seconds=0)
    # Pods of two models share the volume: each model keeps its newest.
    assert list_snapshots(tmp_path) == [newest_ours, theirs]
    assert ours[-1] not in list_snapshots(tmp_path)
    assert load_latest_snapshot(tmp_path, other).path == theirs


@pytest.mark.parametrize(
    "snapshots, keep, expected",
    [
        ([("a", 100), ("a", 50), ("a", 10)], 1, [1, 2]),  # superseded at 100 and 50, both old
        ([("a", 100), ("b", 99), ("a", 50)], 1, [2]),  # b is another model's newest
        ([("a", 100), ("a", 95), ("a", 10)], 2, [2]),  # the third is superseded at 95: old
        ([("a", 990), ("a", 50)], 1, []),  # superseded at 990, 10 s ago: a restore may read it
        ([("?", 100), ("?", 90)], 1, [1]),  # unreadable manifests are pruned among themselves
    ],
)
def test_which_snapshots_pruning_deletes(snapshots, keep, expected):
    ns = [(k, t * 10**9) for k, t in snapshots]
    assert snap.snapshots_to_prune(ns, keep, grace_seconds=60, now_ns=1000 * 10**9) == expected


def test_pruning_removes_stale_temp_dirs_but_not_a_live_writers(tmp_path):
    save_snapshot(tmp_path, FP, [record(4, 1)], "w")
    stale, live = tmp_path / ".tmp-dead-00000000", tmp_path / ".tmp-live-00000000"
    stale.mkdir()
    live.mkdir()
    old = time.time() - 2 * snap.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    removed = prune_snapshots(tmp_path, keep=3)
    assert removed == [stale] and live.exists()


def test_pruning_leaves_the_weight_cache_on_the_same_volume_alone(tmp_path):
    # The operator puts converted weights at <snapshot dir>/weights (snapshot.cacheWeights).
    entry = tmp_path / "weights" / "abc-bfloat16-v1"
    entry.mkdir(parents=True)
    (entry / "DONE").write_text("{}")
    temp = tmp_path / "weights" / ".tmp-xyz"  # a converting pod's, inside the weights dir
    temp.mkdir()
    old = time.time() - 2 * snap.STALE_TEMP_SECONDS
    os.utime(tmp_path / "weights", (old, old))
    for i in range(3):
        save_snapshot(tmp_path, FP, [record(4, i)], "w", keep=1)
    prune_snapshots(tmp_path, keep=1)
    assert (entry / "DONE").exists() and temp.exists()
    assert list_snapshots(tmp_path) and all(p.name.startswith("snap-") for p in list_snapshots(tmp_path))


def test_concurrent_pruners_do_not_fail_each_other(tmp_path):
    for i in range(6):
        save_snapshot(tmp_path, FP, [record(4, i)], "w", keep=10)
    errors: list[BaseException] = []

    def prune():
        try:
            prune_snapshots(tmp_path, keep=1, grace_seconds=0)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=prune) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == [] and len(list_snapshots(tmp_path)) == 1


def test_two_writer_threads_and_a_reader_share_one_directory(tmp_path):
    """Writers save and prune while a reader restores: the reader never loses the snapshot it
    chose to pruning (it was pruned as soon as it was not among the newest two, and a slow
    reader got manifest_missing / file_missing), and nothing it reads is ever corrupt."""
    written: dict[tuple, list] = {}
    lock = threading.Lock()
    stop = threading.Event()
    problems: list[str] = []
    reads = []

    def writer(name: str, seed: int):
        for i in range(8):
            recs = [record(8, seed + i, pinned=True), record(4, seed + 100 + i)]
            with lock:
                written[tuple(recs[0].token_ids)] = recs
            save_snapshot(tmp_path, FP, recs, name, keep=2)

    def reader():
        while not stop.is_set() or not reads:
            result = load_latest_snapshot(tmp_path, FP)
            problems.extend(f"{r.reason}: {r.detail}" for r in result.rejected)
            if result.records:
                reads.append(result.path)
                with lock:
                    expected = written[tuple(result.records[0].token_ids)]
                if not same(result.records, expected):
                    problems.append("restored records differ from a written snapshot")

    threads = [threading.Thread(target=writer, args=("pod-a", 0)), threading.Thread(target=writer, args=("pod-b", 500))]
    r = threading.Thread(target=reader)
    r.start()
    [t.start() for t in threads]
    [t.join() for t in threads]
    stop.set()
    r.join()
    assert problems == [] and reads
    assert len(list_snapshots(tmp_path)) == 16  # all within a restore's grace: none pruned yet
    newest = snap.snapshot_created_ns(list_snapshots(tmp_path)[0]) / 1e9
    prune_snapshots(tmp_path, keep=2, now=newest + snap.RESTORE_GRACE_SECONDS)
    assert len(list_snapshots(tmp_path)) == 2
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    final = load_latest_snapshot(tmp_path, FP)
    assert final.rejected == [] and final.path == list_snapshots(tmp_path)[0]


def test_two_writer_processes_share_one_directory(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=writer_process, args=(str(tmp_path), f"pod-{w}", 5, w * 1000)) for w in range(2)]
    [p.start() for p in procs]
    [p.join(60) for p in procs]
    assert [p.exitcode for p in procs] == [0, 0]
    snapshots = list_snapshots(tmp_path)
    assert len(snapshots) == 10  # all within a restore's grace of their successor: none pruned
    writers = {manifest(p)["writer_id"] for p in snapshots}
    assert writers <= {"pod-0", "pod-1"}
    for p in snapshots:
        assert snap.read_snapshot(p, FP)[0]  # every snapshot left behind is complete and valid
    assert load_latest_snapshot(tmp_path, FP).rejected == []
    later = snap.snapshot_created_ns(snapshots[0]) / 1e9 + snap.RESTORE_GRACE_SECONDS
    prune_snapshots(tmp_path, now=later)
    assert list_snapshots(tmp_path) == snapshots[: snap.DEFAULT_KEEP]


# --------------------------------------------------------------------------- fingerprints


def test_tokenizer_hash_changes_with_vocab_special_tokens_or_chat_template_but_not_dict_order():
    base = tokenizer_hash({"a": 0, "b": 1})
    assert base == tokenizer_hash({"b": 1, "a": 0})
    assert base != tokenizer_hash({"a": 1, "b": 0})
    assert base != tokenizer_hash({"a": 0, "b": 1}, special_tokens={"eos": 1})
    assert base != tokenizer_hash({"a": 0, "b": 1}, chat_template="{{ messages }}")
    assert base != tokenizer_hash({"a": 0, "b": 1}, merges=[("a", "b")])
    assert base.startswith("sha256:")


def test_fingerprint_from_a_hugging_face_config():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576}  # fmt: skip
    fp = fingerprint_from_hf_config(cfg, dtype=torch.bfloat16, page_size=16, tokenizer_hash="sha256:t", model_id="m")
    assert fp == {"architecture": "LlamaForCausalLM", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
                  "dtype": "bfloat16", "page_size": 16, "tokenizer_hash": "sha256:t", "model_id": "m"}  # fmt: skip
    assert json.loads(json.dumps(fp)) == fp


def test_an_unsupported_kv_dtype_cannot_be_fingerprinted():
    with pytest.raises(ValueError):
        fingerprint(dtype="int4")
