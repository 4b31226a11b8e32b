"""When and how a serving engine restores and persists its hot-prefix KV snapshot.

The format and the checks live in engine/kv/snapshot.py; this file decides the moments:
restore once at start (phase "restoring", before warmup, so templates hit restored prefixes;
first fetching the newest snapshot from a ready peer when one is configured, see
snapshot_peer.py), save periodically, on `POST /admin/snapshot`, for a peer, and at
shutdown after draining — sized to fit the shutdown deadline. Export runs on the
engine's step thread (the pool and radix tree are not thread-safe), writing runs off it
(blocking I/O must not stall decoding). Nothing here may stop the engine from serving: a
refused or unreadable snapshot means warming cold, a failed save is a log line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# How long a save may wait for the step thread to export (a long prefill step is seconds).
EXPORT_TIMEOUT_S = 120.0
# Write speed assumed for the shutdown snapshot before any save was timed (bytes/s): a slow
# network volume. Measured saves replace it.
ASSUMED_WRITE_BYTES_PER_S = 50e6
def kv_bytes_per_token(fingerprint: dict) -> int:
    """Bytes of K and V one token takes, from a snapshot fingerprint (torch is loaded: only
    called once the engine is)."""
    from preheat.engine.dtypes import torch_dtype

    return int(fingerprint["num_layers"]) * 2 * int(fingerprint["num_kv_heads"]) * \
        int(fingerprint["head_dim"]) * torch_dtype(str(fingerprint["dtype"])).itemsize


def shutdown_token_budget(max_tokens: int, seconds: float | None, bytes_per_token: int,
                          write_bytes_per_s: float | None) -> int:
    """Most tokens the shutdown snapshot may hold so that writing it takes at most half of
    `seconds` at the write speed seen so far: a write cut off by SIGKILL would be wasted
    (the atomic rename never happens), a smaller snapshot still carries the hottest
    prefixes. None: no deadline."""
    if seconds is None:
        return max_tokens
    rate = write_bytes_per_s or ASSUMED_WRITE_BYTES_PER_S
    return max(0, min(max_tokens, int(0.5 * seconds * rate / max(1, bytes_per_token))))


class SnapshotInProgress(RuntimeError):
    """Another save is running (`POST /admin/snapshot` answers 409)."""


class SnapshotTooSoon(RuntimeError):
    """A forced save right after another (`POST /admin/snapshot` answers 429)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"a snapshot was saved on request {retry_after:.0f}s too recently")
        self.retry_after = retry_after


@dataclass(frozen=True)
class SavedSnapshot:
    path: str | None  # None when there was nothing to save
    tokens: int
    prefixes: int
    seconds: float


def writer_id() -> str:
    """The pod name (HOSTNAME in Kubernetes): tells pods sharing one volume apart in names."""
    return os.environ.get("HOSTNAME") or socket.gethostname() or "preheat"


def restore_budget(snapshot_max_tokens: int, pool_tokens: int) -> int:
    """Most tokens to restore. Restored pinned prefixes can never be evicted, so a snapshot
    from a pod with a bigger pool must not fill this one: at most half the pool."""
    return max(0, min(snapshot_max_tokens, pool_tokens // 2))


class Snapshotter:
    def __init__(self, directory: str, max_tokens: int, interval: float, metrics: Any,
                 writer: str | None = None, *, peer_url: str | None = None,
                 peer_secret: Any = None, peer_timeout: float = 60.0,
                 shutdown_timeout: float | None = None, max_bytes: int | None = None,
                 max_candidates: int = 4) -> None:
        """`peer_secret` (engine/peer/peer_secret.PeerSecret, or anything with `keys()`): sign
        every save, restore only what verifies, authenticate to the peer. None: a
        standalone engine that trusts its own directory. `max_bytes`: what the directory
        may hold (pruning's byte budget); None: whatever the volume has free."""
        self.directory = directory
        self.max_tokens = max_tokens
        self.interval = interval
        self.metrics = metrics
        self.writer = writer or writer_id()
        self.peer_url = peer_url
        self.peer_secret = peer_secret
        self.peer_timeout = peer_timeout
        self.shutdown_timeout = shutdown_timeout
        self.max_bytes = max_bytes
        self.max_candidates = max_candidates  # snapshots one restore reads at most
        self.write_bytes_per_s: float | None = None  # measured by the last save
        self._last_forced: float | None = None  # monotonic time of the last forced save
        self._lock = threading.Lock()  # one save at a time per process
        self._restored = False  # a save before restore finished would persist a cold cache
        self._timer: asyncio.Task | None = None

    def keys(self) -> Any:
        """The peer keys now (re-read as the mounted Secret changes), None without a secret."""
        return self.peer_secret.keys() if self.peer_secret is not None else None

    def snapshot_bytes(self, fingerprint: dict) -> int:
        """The most one snapshot takes: max tokens of KV (plus its manifest, small)."""
        return self.max_tokens * kv_bytes_per_token(fingerprint)

    def byte_budget(self, fingerprint: dict | None = None) -> int | None:
        """Pruning's budget: --snapshot-max-bytes less room for the next write and a
        fetched snapshot when set (an emptyDir's sizeLimit: exceeding it evicts the pod),
        else what the directory's volume can hold beyond a tenth kept free (for the write
        in progress and whatever else shares it: weights, downloads)."""
        if self.max_bytes is not None:
            reserve = 2 * self.snapshot_bytes(fingerprint) if fingerprint else 0
            return max(0, self.max_bytes - reserve)
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return None
        from preheat.engine.kv.snapshot import _snapshot_bytes, list_snapshots

        ours = sum(_snapshot_bytes(p) for p in list_snapshots(self.directory))
        return max(0, ours + st.f_bavail * st.f_frsize - st.f_blocks * st.f_frsize // 10)

    # ------------------------------------------------------------ restore

    def restore(self, aengine: Any) -> int:
        """Restores the newest valid snapshot into the engine; returns tokens restored.
        Never raises: any failure is logged and the engine warms cold."""
        from preheat.engine.kv.snapshot import load_latest_snapshot  # torch: imported once the model loads

        started = time.monotonic()
        engine = aengine.engine
        tokens = 0
        try:
            pool_tokens = engine.pool.capacity_pages * engine.pool.page_size
            budget = restore_budget(self.max_tokens, pool_tokens)
            self.check_size(engine.fingerprint)
            keys = self.keys()
            if keys is None:
                log.info("snapshot: no --peer-secret-file: trusting every snapshot in %s as "
                         "this engine's own (unsigned)", self.directory)
            fetched = None
            if self.peer_url and keys is None:
                log.warning("snapshot: --snapshot-peer-url needs --peer-secret-file (the peer "
                            "answers /admin/* only to it); not fetching")
            elif self.peer_url:
                fetched = self.fetch_from_peer(engine.fingerprint)
            result = load_latest_snapshot(self.directory, engine.fingerprint, budget, keys=keys,
                                          max_candidates=self.max_candidates)
            for rejection in result.rejected:  # each one is logged by load_latest_snapshot
                self.metrics.snapshot_rejected.labels(reason=rejection.reason).inc()
                if fetched is not None and fetched.path is not None and \
                        rejection.path == str(fetched.path):
                    # A refused transfer must not shadow the pod's own snapshots next time.
                    shutil.rmtree(fetched.path, ignore_errors=True)
            self._unpin_foreign(result)
            if result.records:
                future = aengine.call_in_engine(engine.import_prefixes, result.records)
                tokens = int(future.result(timeout=EXPORT_TIMEOUT_S))
                log.info("snapshot: restored %d of %d tokens from %s (writer %s)", tokens,
                         result.num_tokens, result.path, result.writer_id)
            elif not result.rejected:
                log.info("snapshot: none in %s, warming cold", self.directory)
            else:
                log.warning("snapshot: no usable snapshot in %s (%d refused), warming cold",
                            self.directory, len(result.rejected))
        except Exception as e:  # never fatal: warm cold instead
            log.warning("snapshot: restore failed, warming cold: %s: %s", type(e).__name__, e)
            log.debug("snapshot restore failure", exc_info=True)
        took = time.monotonic() - started
        self.metrics.snapshot_restored_tokens.set(tokens)
        self.metrics.snapshot_restore_seconds.set(took)
        self._restored = True
        return tokens

    def check_size(self, fingerprint: dict) -> bool:
        """Whether --snapshot-max-bytes holds what the snapshots need: DEFAULT_KEEP kept, one
        being written, one fetched. Logged when not (pruning then keeps fewer)."""
        from preheat.engine.kv.snapshot import DEFAULT_KEEP

        if self.max_bytes is None:
            return True
        need = (DEFAULT_KEEP + 2) * self.snapshot_bytes(fingerprint)
        if need > self.max_bytes:
            log.warning("snapshot: %s holds %d bytes but %d snapshots of up to %d bytes need %d "
                        "(bytes per token x --snapshot-max-tokens x (keep + 2)); fewer are kept. "
                        "Raise spec.snapshot.size or lower --snapshot-max-tokens", self.directory,
                        self.max_bytes, DEFAULT_KEEP + 2, self.snapshot_bytes(fingerprint), need)
            return False
        return True

    def _unpin_foreign(self, result: Any) -> None:
        """Pinned prefixes are never evicted: only this pod's own earlier run (same writer)
        may restore them pinned. From a peer or another pod on the volume they come in as
        ordinary cache entries (this pod's templates pin their own), counted as
        preheat_snapshot_rejected{reason="peer_pinned"}."""
        if result.writer_id == self.writer:
            return
        pinned = [r for r in result.records if r.pinned]
        for r in pinned:
            r.pinned = False
        if pinned:
            self.metrics.snapshot_rejected.labels(reason="peer_pinned").inc()
            log.warning("snapshot: %d pinned prefixes from writer %s restored unpinned",
                        len(pinned), result.writer_id)

    def fetch_from_peer(self, fingerprint: dict) -> Any:
        """Fetches the newest snapshot from the peer URL (normally the Service: a ready
        serving pod) into our directory. Never raises."""
        from preheat.engine.warm.snapshot_peer import fetch_latest

        # The peer's snapshot may hold more than we restore; bound what we accept anyway.
        cap = 2 * self.max_tokens * kv_bytes_per_token(fingerprint) + (64 << 20)
        fetched = fetch_latest(self.peer_url or "", self.directory, keys=self.keys(),
                               timeout=self.peer_timeout, max_bytes=cap)
        self.metrics.snapshot_peer_fetches.labels(result=fetched.result).inc()
        if fetched.reason is not None:
            self.metrics.snapshot_rejected.labels(reason=fetched.reason).inc()
        self.metrics.snapshot_peer_fetch_seconds.set(fetched.seconds)
        if fetched.result == "fetched":
            log.info("snapshot: fetched %s (%d bytes) from %s in %.2fs", fetched.path,
                     fetched.bytes, self.peer_url, fetched.seconds)
        else:
            log.info("snapshot: nothing fetched from %s (%s%s)", self.peer_url, fetched.result,
                     f": {fetched.detail}" if fetched.detail else "")
        return fetched

    async def restore_step(self, aengine: Any) -> None:
        """The "restoring" StartupStep: restore off the loop, then arm the periodic saver."""
        from preheat.engine.lifecycle import in_daemon_thread  # a SIGTERM must not wait for a peer fetch

        await in_daemon_thread(self.restore, aengine)
        if self.interval > 0 and self._timer is None:
            self._timer = asyncio.create_task(self._periodic(aengine))

    # ------------------------------------------------------------ save

    def save(self, aengine: Any, wait: bool = True, max_tokens: int | None = None,
             wait_s: float | None = None) -> SavedSnapshot:
        """Exports the hottest prefixes on the step thread and writes them (in this thread).
        One save at a time: with `wait=False`, raises SnapshotInProgress instead of waiting
        for a running one; with `wait_s`, after waiting that long. `max_tokens` caps this
        save below the configured size (the shutdown save must fit its deadline). Raises on
        failure; callers decide whether that is a log line or an HTTP 500."""
        engine = aengine.engine
        if engine is None:
            raise RuntimeError("the engine is not loaded yet")
        timeout = -1 if not wait or wait_s is None else max(0.0, wait_s)
        if not self._lock.acquire(blocking=wait, timeout=timeout):
            raise SnapshotInProgress("a snapshot is already being saved")
        try:
            return self._save(aengine, engine, self.max_tokens if max_tokens is None else max_tokens)
        finally:
            self._lock.release()

    def _save(self, aengine: Any, engine: Any, limit: int) -> SavedSnapshot:
        from preheat.engine.kv.snapshot import save_snapshot

        started = time.monotonic()
        records = aengine.call_in_engine(engine.export_prefixes, limit).result(
            timeout=EXPORT_TIMEOUT_S
        )
        if not records:
            # An empty snapshot would become the newest and shadow a useful older one.
            log.info("snapshot: nothing cached, nothing saved")
            return SavedSnapshot(None, 0, 0, time.monotonic() - started)
        path = save_snapshot(self.directory, engine.fingerprint, records, self.writer,
                             sharding=getattr(engine, "sharding", None), keys=self.keys(),
                             max_bytes=self.byte_budget(engine.fingerprint))
        tokens = sum(r.stored_tokens for r in records)
        took = time.monotonic() - started
        self.write_bytes_per_s = tokens * kv_bytes_per_token(engine.fingerprint) / max(took, 1e-3)
        self.metrics.snapshot_saved_tokens.set(tokens)
        return SavedSnapshot(str(path), tokens, len(records), took)

    def save_forced(self, aengine: Any, min_interval: float) -> SavedSnapshot:
        """`POST /admin/snapshot`: a save now, unless one runs (SnapshotInProgress) or the
        last forced one finished less than `min_interval` seconds ago (SnapshotTooSoon):
        every save pauses decoding for its export."""
        if self._last_forced is not None and time.monotonic() - self._last_forced < min_interval:
            raise SnapshotTooSoon(min_interval - (time.monotonic() - self._last_forced))
        saved = self.save(aengine, wait=False)
        self._last_forced = time.monotonic()
        return saved

    def save_at_shutdown(self, aengine: Any) -> None:
        """`AsyncEngine.on_shutdown` callback: runs after draining, before the step thread
        stops. Logs and swallows every error: shutdown must still exit 0."""
        if not self._restored:
            log.info("snapshot: start-up never finished restoring, not saving at shutdown")
            return
        try:
            budget = shutdown_token_budget(self.max_tokens, self.shutdown_timeout,
                                           kv_bytes_per_token(aengine.engine.fingerprint),
                                           self.write_bytes_per_s)
            if budget <= 0:
                log.warning("snapshot at shutdown skipped: no time for one (%ss)", self.shutdown_timeout)
                return
            # A periodic or peer save still running takes the lock: waiting for it without
            # bound would push this one past the deadline (cut off by SIGKILL). It persists
            # the hot prefixes too; this save only waits a quarter of the deadline for it.
            wait_s = None if self.shutdown_timeout is None else self.shutdown_timeout / 4
            saved = self.save(aengine, max_tokens=budget, wait_s=wait_s)
            log.info("snapshot at shutdown: %s (%d tokens of at most %d, %.2fs of %ss)", saved.path,
                     saved.tokens, budget, saved.seconds, self.shutdown_timeout)
        except SnapshotInProgress:
            log.warning("snapshot at shutdown skipped: an earlier save was still running after "
                        "%.1fs (it persists the cache)", (self.shutdown_timeout or 0) / 4)
        except Exception as e:
            log.error("snapshot at shutdown failed: %s: %s", type(e).__name__, e)

    async def _periodic(self, aengine: Any) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if aengine.phase == "draining" or aengine.error is not None:
                return  # the shutdown save takes over
            if aengine.phase != "ready":
                continue
            try:
                saved = await asyncio.to_thread(self.save, aengine)
                log.info("periodic snapshot: %s (%d tokens)", saved.path, saved.tokens)
            except Exception as e:
                log.error("periodic snapshot failed: %s: %s", type(e).__name__, e)
