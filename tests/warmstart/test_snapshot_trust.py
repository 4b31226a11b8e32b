"""Snapshots as an attacker would write them: what the peer secret's HMAC refuses, what the
regular-file check refuses (FIFO, link to /dev/zero), future-dated names, too many
candidates, and pruning to a byte budget and away from models no pod runs any more."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from preheat.engine.kv import snapshot as snap
from preheat.engine.kv.snapshot import list_snapshots, load_latest_snapshot, prune_snapshots, save_snapshot
from preheat.engine.peer.peer_secret import PeerKeys, PeerSecret, PeerSecretError, load_peer_keys

from .snapshot_helpers import fingerprint, manifest, record, write_manifest

FP = fingerprint()
KEY = PeerKeys(b"k" * 32, (b"k" * 32,))
OTHER = PeerKeys(b"o" * 32, (b"o" * 32,))


def reasons(result) -> list[str]:
    return [r.reason for r in result.rejected]


# --------------------------------------------------------------------------- signatures


def test_a_signed_snapshot_restores_under_its_key_and_carries_manifest_hmac(tmp_path):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a", keys=KEY)
    assert sorted(p.name for p in path.iterdir())[:2] == ["kv-00000.safetensors", "manifest.hmac"]
    result = load_latest_snapshot(tmp_path, FP, keys=KEY)
    assert result.path == path and result.rejected == [] and len(result.records) == 1


def test_an_unsigned_snapshot_is_refused_once_a_peer_secret_is_set(tmp_path):
    save_snapshot(tmp_path, FP, [record(8, 1)], "intruder")  # anyone who can write the volume
    result = load_latest_snapshot(tmp_path, FP, keys=KEY)
    assert result.records == [] and reasons(result) == ["unsigned"]
    # With no peer secret the engine trusts its own directory (a standalone `preheat serve`).
    assert len(load_latest_snapshot(tmp_path, FP).records) == 1


def test_a_snapshot_signed_under_another_key_is_refused(tmp_path):
    save_snapshot(tmp_path, FP, [record(8, 1)], "other-service", keys=OTHER)
    assert reasons(load_latest_snapshot(tmp_path, FP, keys=KEY)) == ["bad_signature"]


def test_a_forged_manifest_fails_its_hmac(tmp_path):
    """The attacker edits a valid signed manifest (pins a prefix, more hits): the HMAC over
    the manifest's bytes no longer verifies, so nothing of it is restored."""
    path = save_snapshot(tmp_path, FP, [record(8, 1, hits=1)], "pod-a", keys=KEY)
    m = manifest(path)
    m["prefixes"][0]["pinned"], m["prefixes"][0]["hits"] = True, 10**6
    write_manifest(path, m)
    result = load_latest_snapshot(tmp_path, FP, keys=KEY)
    assert result.records == [] and reasons(result) == ["bad_signature"]


def test_a_copied_signature_does_not_sign_another_manifest(tmp_path):
    good = save_snapshot(tmp_path / "a", FP, [record(8, 1)], "pod-a", keys=KEY)
    forged = save_snapshot(tmp_path / "b", FP, [record(8, 2, pinned=True)], "intruder")
    (forged / "manifest.hmac").write_bytes((good / "manifest.hmac").read_bytes())
    assert reasons(load_latest_snapshot(tmp_path / "b", FP, keys=KEY)) == ["bad_signature"]


@pytest.mark.parametrize("body", [b"not json", b'{"alg": "md5", "mac": "00"}', b"x" * 4096])
def test_a_malformed_signature_file_is_refused(tmp_path, body):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a", keys=KEY)
    (path / "manifest.hmac").write_bytes(body)
    assert reasons(load_latest_snapshot(tmp_path, FP, keys=KEY)) == ["bad_signature"]


def test_rotation_previous_keys_still_verify_and_the_current_one_signs(tmp_path):
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "current").write_text("new-key-0123456789abcdef\n")
    (tmp_path / "secret" / "previous").write_text("old-key-0123456789abcdef\n")
    keys = load_peer_keys(tmp_path / "secret")
    assert keys.current == b"new-key-0123456789abcdef" and keys.matches("old-key-0123456789abcdef")
    old = PeerKeys(b"old-key-0123456789abcdef", (b"old-key-0123456789abcdef",))
    save_snapshot(tmp_path / "snaps", FP, [record(8, 1)], "before-rotation", keys=old)
    assert len(load_latest_snapshot(tmp_path / "snaps", FP, keys=keys).records) == 1
    newer = save_snapshot(tmp_path / "snaps", FP, [record(8, 2)], "after-rotation", keys=keys)
    assert reasons(load_latest_snapshot(tmp_path / "snaps", FP, keys=old)) == ["bad_signature"]
    assert load_latest_snapshot(tmp_path / "snaps", FP, keys=keys).path == newer


def test_a_peer_secret_file_holds_keys_one_per_line_and_refuses_weak_ones(tmp_path):
    f = tmp_path / "peer"
    f.write_text("current-0123456789abcdef\nprevious-0123456789abcdef\n")
    keys = load_peer_keys(f)
    assert keys.current == b"current-0123456789abcdef" and len(keys.accepted) == 2
    assert not keys.matches("") and not keys.matches("current-0123456789abcde")
    for bad, match in (("", "holds no key"), ("short\n", "shorter than")):
        f.write_text(bad)
        with pytest.raises(PeerSecretError, match=match):
            load_peer_keys(f)
    with pytest.raises(PeerSecretError, match="cannot read"):
        PeerSecret(tmp_path / "absent")


# --------------------------------------------------------------------------- hostile files


def fifo_manifest(tmp_path):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a")
    (path / "manifest.json").unlink()
    os.mkfifo(path / "manifest.json")
    return path


def finishes(fn, *args, **kwargs):
    """Runs fn in a thread; the result if it returned at all (a FIFO read would block forever)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{fn.__name__} blocked"
    return out[0]


def test_a_fifo_manifest_neither_blocks_a_restore_nor_a_prune(tmp_path):
    path = fifo_manifest(tmp_path)
    assert reasons(finishes(load_latest_snapshot, tmp_path, FP)) == ["unsafe_path"]
    assert reasons(finishes(load_latest_snapshot, tmp_path, FP, keys=KEY)) == ["unsafe_path"]
    # Pruning reads manifests to group by model: the FIFO is "unreadable", not a hang.
    finishes(prune_snapshots, tmp_path, keep=1)
    finishes(save_snapshot, tmp_path, FP, [record(8, 2)], "pod-b")  # a save prunes too
    assert path in list_snapshots(tmp_path)


@pytest.mark.parametrize("name", ["manifest.json", "manifest.hmac", "kv-00000.safetensors"])
def test_a_symlink_to_dev_zero_is_refused_without_reading_it(tmp_path, name):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a", keys=KEY)
    (path / name).unlink()
    os.symlink("/dev/zero", path / name)
    assert reasons(finishes(load_latest_snapshot, tmp_path, FP, keys=KEY)) == ["unsafe_path"]
    finishes(prune_snapshots, tmp_path, keep=1)  # no MemoryError


def test_a_huge_manifest_is_refused_at_the_cap(tmp_path, monkeypatch):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a")
    monkeypatch.setattr(snap, "MAX_MANIFEST_BYTES", 100)
    assert reasons(load_latest_snapshot(tmp_path, FP)) == ["manifest_invalid"]
    assert snap._fingerprint_key(path) == "?"


# --------------------------------------------------------------------------- names and candidates


def test_a_future_dated_name_is_ignored_and_pruned(tmp_path):
    real = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a")
    future_ns = time.time_ns() + 10 * 365 * 86400 * 10**9
    future = tmp_path / f"snap-{future_ns:020d}-intruder-0123abcd"
    os.rename(save_snapshot(tmp_path / "x", FP, [record(8, 2)], "intruder"), future)
    assert list_snapshots(tmp_path) == [real]
    result = load_latest_snapshot(tmp_path, FP)
    assert result.path == real and reasons(result) == ["future_dated"]
    assert future in prune_snapshots(tmp_path) and not future.exists()


def test_a_name_a_little_ahead_of_this_clock_is_still_read(tmp_path):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a")
    ahead = tmp_path / f"snap-{time.time_ns() + 60 * 10**9:020d}-fast-clock-0123abcd"
    os.rename(path, ahead)
    assert load_latest_snapshot(tmp_path, FP).path == ahead


def test_a_restore_reads_at_most_max_candidates(tmp_path):
    good = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a")
    for i in range(6):  # newer and all unusable: another model's
        save_snapshot(tmp_path, fingerprint(model_id=f"m{i}"), [record(8, i)], "other")
    result = load_latest_snapshot(tmp_path, FP, max_candidates=4)
    assert result.records == [] and reasons(result) == ["fingerprint_mismatch"] * 4
    assert load_latest_snapshot(tmp_path, FP, max_candidates=7).path == good


# --------------------------------------------------------------------------- pruning budgets


def test_pruning_keeps_the_directory_within_a_byte_budget_but_never_the_newest(tmp_path):
    paths = [save_snapshot(tmp_path, fingerprint(model_id=f"m{i}"), [record(8, i)], "w") for i in range(4)]
    newest_two = snap._snapshot_bytes(paths[2]) + snap._snapshot_bytes(paths[3])
    later = time.time() + 1
    assert sorted(prune_snapshots(tmp_path, now=later, max_bytes=newest_two)) == paths[:2]
    assert list_snapshots(tmp_path) == paths[:1:-1]
    assert prune_snapshots(tmp_path, now=later, max_bytes=1) == [paths[2]]
    assert list_snapshots(tmp_path) == [paths[3]]


def test_a_model_no_pod_saved_for_days_is_dropped_whole(tmp_path):
    current = save_snapshot(tmp_path, FP, [record(8, 9)], "w")
    eight_days_ago = time.time_ns() - 8 * 86400 * 10**9
    old = []
    for i in range(2):  # the only snapshots of a model the service no longer runs
        written = save_snapshot(tmp_path / "w", fingerprint(model_id="old"), [record(8, i)], "w")
        old.append(tmp_path / f"snap-{eight_days_ago + i:020d}-w-0000000{i}")
        os.rename(written, old[-1])
    assert prune_snapshots(tmp_path, stale_fingerprint_seconds=9 * 86400) == []
    assert sorted(prune_snapshots(tmp_path)) == old  # the default: a week
    assert list_snapshots(tmp_path) == [current]


def test_save_prunes_to_its_byte_budget(tmp_path):
    first = save_snapshot(tmp_path, fingerprint(model_id="a"), [record(8, 1)], "w")
    size = snap._snapshot_bytes(first)
    second = save_snapshot(tmp_path, fingerprint(model_id="b"), [record(8, 2)], "w",
                           max_bytes=size + 1, grace_seconds=0)
    assert list_snapshots(tmp_path) == [second]


def test_the_manifest_a_reader_checks_is_the_bytes_the_writer_signed(tmp_path):
    path = save_snapshot(tmp_path, FP, [record(8, 1)], "pod-a", keys=KEY)
    raw = (path / "manifest.json").read_bytes()
    mac = json.loads((path / "manifest.hmac").read_text())["mac"]
    assert KEY.verify_manifest(raw, mac) and not KEY.verify_manifest(raw + b" ", mac)
