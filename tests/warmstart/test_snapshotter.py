"""The snapshot schedule and its failure rules, on stand-ins (no model): restoring never
raises, an empty cache writes nothing, the periodic saver runs only while ready and outlives
a failed save."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from types import SimpleNamespace

from preheat.engine.kv.snapshot import list_snapshots, save_snapshot
from preheat.engine.metrics import Metrics
from preheat.engine.warm.snapshotter import Snapshotter, kv_bytes_per_token, restore_budget

from .snapshot_helpers import fingerprint, record


class StandInEngine:
    """What the snapshotter uses of an Engine, with calls run at once."""

    def __init__(self, records=(), fail_import: bool = False):
        self.fingerprint = fingerprint()
        self.pool = SimpleNamespace(capacity_pages=64, page_size=4)
        self.records = list(records)
        self.fail_import = fail_import
        self.imported: list = []

    def export_prefixes(self, max_tokens):
        return self.records

    def import_prefixes(self, records):
        if self.fail_import:
            raise RuntimeError("pool exploded")
        self.imported += records
        return sum(r.num_tokens for r in records)


class StandInAsyncEngine:
    def __init__(self, engine, phase: str = "ready"):
        self.engine, self.phase, self.error = engine, phase, None

    def call_in_engine(self, fn, *args):
        f = concurrent.futures.Future()
        f.set_result(fn(*args))
        return f


def snapshotter(tmp_path: Path, interval: float = 0.0) -> Snapshotter:
    return Snapshotter(str(tmp_path), 1024, interval, Metrics(), writer="pod-a")


def test_restore_budget_is_the_configured_cap_but_never_more_than_half_the_pool():
    assert restore_budget(65536, 4096) == 2048
    assert restore_budget(512, 4096) == 512


def test_a_snapshot_round_trips_through_save_and_restore(tmp_path):
    saver = snapshotter(tmp_path)
    source = StandInEngine([record(8, seed=1, hits=3, pinned=True), record(4, seed=2)])
    saved = saver.save(StandInAsyncEngine(source))
    assert saved.tokens == 12 and saved.prefixes == 2 and Path(saved.path).parent == tmp_path
    assert saver.metrics.snapshot_saved_tokens._value.get() == 12

    target = StandInEngine()
    restorer = snapshotter(tmp_path)
    assert restorer.restore(StandInAsyncEngine(target, "restoring")) == 12
    assert [r.token_ids for r in target.imported] == [r.token_ids for r in source.records]
    assert restorer.metrics.snapshot_restored_tokens._value.get() == 12


def test_an_empty_cache_writes_no_snapshot_that_would_hide_an_older_one(tmp_path):
    save_snapshot(tmp_path, fingerprint(), [record(8, seed=1, pinned=True)], "pod-b")
    saved = snapshotter(tmp_path).save(StandInAsyncEngine(StandInEngine([])))
    assert saved.path is None and saved.tokens == 0
    assert len(list_snapshots(tmp_path)) == 1


def test_restore_never_raises_a_refusal_is_metered_and_a_failed_import_warms_cold(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    s = Snapshotter(str(not_a_dir), 1024, 0, Metrics())
    assert s.restore(StandInAsyncEngine(StandInEngine(), "restoring")) == 0
    assert s.metrics.snapshot_rejected.labels(reason="io_error")._value.get() == 1

    save_snapshot(tmp_path, fingerprint(), [record(8, seed=1, pinned=True)], "pod-b")
    s = snapshotter(tmp_path)
    assert s.restore(StandInAsyncEngine(StandInEngine(fail_import=True), "restoring")) == 0
    assert "restore failed, warming cold: RuntimeError: pool exploded" in caplog.text
    assert s.metrics.snapshot_restored_tokens._value.get() == 0


async def test_the_periodic_saver_saves_only_while_ready_survives_errors_and_stops_when_draining(tmp_path):
    s = snapshotter(tmp_path, interval=0.01)
    ae = StandInAsyncEngine(StandInEngine(), phase="warming")
    calls = []

    def save(aengine):
        calls.append(aengine.phase)
        if len(calls) == 1:
            raise OSError("volume full")  # logged; the next tick tries again
        return SimpleNamespace(path="p", tokens=1)

    s.save = save
    await s.restore_step(ae)  # restores (nothing there) and arms the timer
    await asyncio.sleep(0.1)
    assert calls == []  # not while warming
    ae.phase = "ready"
    while len(calls) < 3:
        await asyncio.sleep(0.01)
    ae.phase = "draining"
    await asyncio.wait_for(s._timer, 1)  # ends by itself: the shutdown save takes over
    assert set(calls) == {"ready"}


def test_the_shutdown_save_waits_a_bounded_time_for_a_running_save(tmp_path, caplog):
    """A periodic save still holding the lock at SIGTERM must not push the shutdown save
    past its deadline: it waits a quarter of the deadline, then leaves the persisting to
    the running save. Once the lock is free the shutdown save runs, sized to the budget."""
    import threading

    s = Snapshotter(str(tmp_path), 1024, 0.0, Metrics(), writer="pod-a", shutdown_timeout=0.4)
    s._restored = True
    ae = StandInAsyncEngine(StandInEngine())
    calls = []
    s._save = lambda aengine, engine, limit=None: calls.append(limit)
    s._lock.acquire()  # a periodic save is running
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.save_at_shutdown(ae), done.set()))
    t.start()
    assert done.wait(5), "the shutdown save waited for the running one without bound"
    t.join()
    assert calls == [] and "still running" in caplog.text
    s._lock.release()
    s.save_at_shutdown(ae)
    assert len(calls) == 1 and 0 < calls[0] <= 1024


def test_an_emptydir_budget_leaves_room_for_a_write_and_a_fetch_and_says_when_too_small(tmp_path, caplog):
    per = kv_bytes_per_token(fingerprint())
    saver = Snapshotter(str(tmp_path), 1024, 0, Metrics(), max_bytes=10 * 1024 * per)
    assert saver.byte_budget(fingerprint()) == 8 * 1024 * per  # two snapshots' room kept free
    assert saver.check_size(fingerprint())  # keep 3 + write + fetch = 5 of 10
    small = Snapshotter(str(tmp_path), 1024, 0, Metrics(), max_bytes=4 * 1024 * per)
    with caplog.at_level("WARNING"):
        assert not small.check_size(fingerprint())
    assert "x (keep + 2)" in caplog.text
    assert Snapshotter(str(tmp_path), 1024, 0, Metrics()).check_size(fingerprint())  # the volume decides
