"""KV cache tiers below the device pool: L2 host memory, L3 disk, and prefetching back.

Pages evicted from the L1 pool (the device KV pool) are offloaded here instead of being
dropped; a later radix match that reaches them brings them back. This module is pure storage:
it knows pages by a content key and nothing about the radix tree or the pool. The radix tree
computes keys with `page_keys` (a chained hash over the token ids from the root, so a key
names one page *in its full context*: the same 16 tokens after a different prefix have
different KV and a different key) and hands evicted pages to `KVTiers.offload`.

A page is a tensor [num_layers, 2, page_size, num_kv_heads, head_dim] in the KV dtype.

A tier is a cache: any failure in it (a full or failing disk, a corrupt page, no host memory)
is logged, counted per (tier, op) for `preheat_kv_tier_errors_total{tier,op}`, and treated
as a miss. Nothing here raises into the step loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from preheat.engine.config import PREFETCH_POLICIES, CacheSettings
from preheat.engine.kv.checksum import tensor_sha256

log = logging.getLogger(__name__)

GIB = 1 << 30
PAGE_FORMAT = "preheat-kv-page"
_KEY = re.compile(r"^[0-9a-f]{32}$")


# --------------------------------------------------------------------------- keys


def root_key(fingerprint: Mapping[str, Any]) -> str:
    """The key chain's start, from the model fingerprint (see snapshot.model_fingerprint): a
    disk cache left by another model or page size can then never match."""
    blob = json.dumps(dict(fingerprint), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def page_key(parent: str, page_tokens: Sequence[int]) -> str:
    """Key of a page whose predecessor page has key `parent` (the root key for the first)."""
    h = hashlib.blake2b(bytes.fromhex(parent), digest_size=16)
    h.update(np.asarray(page_tokens, dtype="<i8").tobytes())
    return h.hexdigest()


def page_keys(token_ids: Sequence[int], page_size: int, root: str) -> list[str]:
    """Keys of every full page of a token sequence, in order (a partial last page has none)."""
    keys, parent = [], root
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_key(parent, token_ids[start : start + page_size])
        keys.append(parent)
    return keys


def _check_key(key: str) -> str:
    # The key becomes a file name in L3: anything but hex could escape the directory.
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"not a page key (32 hex digits): {key!r}")
    return key


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0  # pages pushed out to make room
    too_large: int = 0  # pages bigger than the whole tier
    corrupt: int = 0  # L3 pages that failed their checksum or could not be read
    read_errors: int = 0  # reads that failed (corrupt or unreadable pages included)
    write_errors: int = 0  # writes that failed (disk full, no memory, ...): the page is dropped
    bytes_used: int = 0
    pages: int = 0


class ErrorLog:
    """Logs tier errors without flooding: the first of each (tier, op), then at most one line
    a minute with the count since (a full disk fails every eviction)."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def error(self, tier: str, op: str, detail: object) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get((tier, op), (-self.interval_s, 0))
            if now - last < self.interval_s:
                self._last[(tier, op)] = (last, suppressed + 1)
                return
            self._last[(tier, op)] = (now, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        log.warning("KV tier %s %s failed, treated as a miss: %s%s", tier, op, detail, more)


_ERRORS = ErrorLog()


# --------------------------------------------------------------------------- L2


class HostPageStore:
    """L2: pages in host memory, bounded in bytes, least-recently-used out first. An evicted
    page goes to `on_evict` (the L3 store) rather than being dropped. Thread-safe."""

    def __init__(
        self,
        capacity_bytes: int,
        on_evict: Callable[[str, torch.Tensor], Any] | None = None,
        pin_memory: bool = False,
    ):
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = int(capacity_bytes)
        self.on_evict = on_evict
        # Pinned host memory makes the copy back to the GPU asynchronous and ~2x faster.
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._pages: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = TierStats()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Stores a copy of `kv`; returns False when the page is larger than the tier (it then
        goes straight to `on_evict`)."""
        _check_key(key)
        size = _nbytes(kv)
        with self._lock:
            if key in self._pages:  # already here: the content is the same by construction
                self._pages.move_to_end(key)
                return True
        if size > self.capacity_bytes:
            self.stats.too_large += 1
            self._spill([(key, kv)])
            return False
        try:
            copy = self._host_copy(kv)
        except Exception as e:  # no host memory (pinned memory especially): drop the page
            self.stats.write_errors += 1
            _ERRORS.error("l2", "write", f"{type(e).__name__}: {e}")
            return False
        evicted: list[tuple[str, torch.Tensor]] = []
        with self._lock:
            if key not in self._pages:
                self._pages[key] = copy
                self.stats.bytes_used += size
                self.stats.stores += 1
            while self.stats.bytes_used > self.capacity_bytes:
                old_key, old = self._pages.popitem(last=False)
                self.stats.bytes_used -= _nbytes(old)
                self.stats.evictions += 1
                evicted.append((old_key, old))
            self.stats.pages = len(self._pages)
        self._spill(evicted)  # outside the lock: an L3 write takes milliseconds
        return True

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            kv = self._pages.get(key)
            if kv is None:
                self.stats.misses += 1
                return None
            self._pages.move_to_end(key)
            self.stats.hits += 1
            return kv

    def pop(self, key: str) -> torch.Tensor | None:
        with self._lock:
            kv = self._pages.pop(key, None)
            if kv is not None:
                self.stats.bytes_used -= _nbytes(kv)
                self.stats.pages = len(self._pages)
            return kv

    def _host_copy(self, kv: torch.Tensor) -> torch.Tensor:
        if self.pin_memory:
            out = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            return out.copy_(kv.detach())
        return kv.detach().to("cpu", copy=True).contiguous()

    def _spill(self, pages: list[tuple[str, torch.Tensor]]) -> None:
        if self.on_evict is None:
            return
        for key, kv in pages:
            try:
                self.on_evict(key, kv)
            except Exception as e:  # a full or failing disk must not break serving
                _ERRORS.error("l3", "write", f"{type(e).__name__}: {e}")


# --------------------------------------------------------------------------- L3


class DiskPageStore:
    """L3: one safetensors file per page under `directory/<key[:2]>/<key>.safetensors`, written
    atomically (temp file + rename), checksummed (sha256 in the file's metadata, checked on
    every read), bounded in bytes with least-recently-used eviction. Survives restarts: the
    index is rebuilt from the files, oldest modification first.

    Files are not fsynced: this is a cache, and a page torn by a crash fails its checksum and
    is dropped. One process owns a directory (a pod's local disk); it is not a shared volume."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if capacity_bytes is None:  # no flag for it yet: half of the free space at start
            capacity_bytes = shutil.disk_usage(self.directory).free // 2
        self.capacity_bytes = int(capacity_bytes)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU order
        self._lock = threading.Lock()
        self.stats = TierStats()
        self._scan()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in self.directory.iterdir():
            if not (sub.is_dir() and not sub.is_symlink() and re.fullmatch(r"[0-9a-f]{2}", sub.name)):
                continue
            for f in sub.iterdir():
                if f.name.startswith(".tmp-"):  # a write cut short by a crash
                    f.unlink(missing_ok=True)
                    continue
                key = f.name.removesuffix(".safetensors")
                if f.suffix == ".safetensors" and _KEY.match(key) and key[:2] == sub.name:
                    st = f.lstat()
                    found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.bytes_used += size
        self.stats.pages = len(self._index)
        self._evict_over_capacity()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Stores the page; False when it is not stored (too large, or the write failed: the
        error is counted in `stats.write_errors` and the page is dropped, never raised)."""
        _check_key(key)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        try:
            kv = kv.detach().to("cpu").contiguous()
            if _nbytes(kv) > self.capacity_bytes:
                self.stats.too_large += 1
                return False
            size = self._write(key, kv)
        except Exception as e:  # ENOSPC, EIO, a read-only remount...: this page is not cached
            self.stats.write_errors += 1
            _ERRORS.error("l3", "write", f"{type(e).__name__}: {e}")
            return False
        with self._lock:
            self.stats.bytes_used += size - self._index.pop(key, 0)
            self._index[key] = size
            self.stats.stores += 1
            self._evict_over_capacity()
        return True

    def _write(self, key: str, kv: torch.Tensor) -> int:
        """Writes the page file atomically (temp file + rename); returns its size."""
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".tmp-{key}-{secrets.token_hex(4)}"
        try:
            save_file({"kv": kv}, str(tmp), metadata={"format": PAGE_FORMAT, "key": key, "sha256": tensor_sha256(kv)})
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path.stat().st_size

    def get(self, key: str) -> torch.Tensor | None:
        """The page, or None when absent or corrupt (a corrupt file is deleted and counted)."""
        _check_key(key)
        with self._lock:
            if key not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                kv = f.get_tensor("kv")
            if meta.get("format") != PAGE_FORMAT or meta.get("key") != key or meta.get("sha256") != tensor_sha256(kv):
                raise ValueError("checksum or key mismatch")
        except Exception as e:  # any unreadable page is a miss, never a crash
            self.stats.corrupt += 1
            self.stats.read_errors += 1
            _ERRORS.error("l3", "read", f"page {key} dropped: {type(e).__name__}: {e}")
            try:
                self.discard(key)
            except OSError:
                pass
            return None
        try:
            os.utime(path)  # keeps LRU order across restarts
        except OSError:
            pass
        self.stats.hits += 1
        return kv

    def discard(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.bytes_used -= size
                self.stats.pages = len(self._index)
        self._path(key).unlink(missing_ok=True)

    def _evict_over_capacity(self) -> None:
        # Called with the lock held (or from __init__).
        while self.stats.bytes_used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as e:  # forgotten either way; a stray file is rescanned at start
                _ERRORS.error("l3", "write", f"cannot delete evicted page {key}: {e}")
            self.stats.bytes_used -= size
            self.stats.evictions += 1
        self.stats.pages = len(self._index)


# --------------------------------------------------------------------------- prefetch


@dataclass
class PrefetchResult:
    """The leading run of requested pages that is available now. Only a contiguous run from
    the first key is useful: page i's KV is only valid after pages 0..i-1."""

    pages: list[torch.Tensor] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)  # "l2" or "l3" per returned page
    requested: int = 0
    pending: int = 0  # L3 loads still running in the background (they land in L2)
    waited_s: float = 0.0

    @property
    def complete(self) -> bool:
        return len(self.pages) == self.requested


class Prefetcher:
    """Brings L2/L3 pages back for a radix match, by policy:

    - best_effort: return the pages already in L2 now; start loading the L3 pages in the
      background into L2, for the next request with this prefix. Never waits on disk.
    - wait_complete: load everything from L3, return all that exists and is intact.
    - timeout: load from L3 for up to `timeout_ms`, return the leading run that arrived; the
      rest keeps loading into L2 in the background.
    """

    def __init__(
        self,
        l2: HostPageStore | None,
        l3: DiskPageStore | None,
        policy: str = "best_effort",
        timeout_ms: float = 50.0,
        workers: int = 2,
    ):
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy {policy!r} is not one of {', '.join(PREFETCH_POLICIES)}")
        self.l2, self.l3, self.policy, self.timeout_ms = l2, l3, policy, timeout_ms
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-prefetch")
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _load(self, key: str) -> torch.Tensor | None:
        assert self.l3 is not None
        kv = self.l3.get(key)
        if kv is not None and self.l2 is not None:
            self.l2.put(key, kv)
        return kv

    def _submit(self, key: str) -> Future:
        with self._lock:
            fut = self._inflight.get(key)  # one disk read per page, however many ask
            if fut is not None:
                return fut
            fut = self._pool.submit(self._load, key)
            self._inflight[key] = fut
        # Outside the lock: a future that is already done runs the callback right here.
        fut.add_done_callback(lambda f, k=key: self._forget(k, f))
        return fut

    def _forget(self, key: str, fut: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    @property
    def waits(self) -> bool:
        """Whether a request waits for its L3 pages (wait_complete, timeout)."""
        return self.policy != "best_effort" and self.l3 is not None

    def start(self, keys: Sequence[str]) -> PrefetchTicket | None:
        """Starts loading, without waiting, the L3 pages of the run that `keys` (a waiting
        request's pages beyond its L1 match) would bring back; None when none are on disk
        only (the L2 run is there now: admission takes it without waiting)."""
        if not self.waits:
            return None
        disk: list[str] = []
        held: dict[str, torch.Tensor] = {}
        for key in keys:
            kv = self.l2.get(key) if self.l2 is not None else None
            if kv is not None:
                held[key] = kv
            elif key in self.l3:
                disk.append(key)
            else:
                break
        if not disk:
            return None
        deadline = None if self.policy == "wait_complete" else time.monotonic() + self.timeout_ms / 1000.0
        return PrefetchTicket({k: self._submit(k) for k in disk}, deadline, held)

    def collect(self, keys: Sequence[str], ticket: PrefetchTicket) -> PrefetchResult:
        """The leading run of `keys` available now, from L2 or the ticket's finished loads;
        never waits (a load still running ends the run: those pages are recomputed)."""
        result = PrefetchResult(requested=len(keys))
        for key in keys:
            kv, tier = ticket.held.get(key), "l2"
            fut = ticket.loads.get(key)
            if kv is None and fut is not None:  # read from disk (it has landed in L2 too)
                done = fut.done() and not fut.cancelled() and fut.exception() is None
                kv, tier = (fut.result(), "l3") if done else (None, "l3")
            if kv is None and self.l2 is not None:
                kv, tier = self.l2.get(key), "l2"
            if kv is None:
                break
            result.pages.append(kv)
            result.tiers.append(tier)
        result.pending = sum(not f.done() for f in ticket.loads.values())
        return result

    def fetch(self, keys: Sequence[str]) -> PrefetchResult:
        start = time.perf_counter()
        result = PrefetchResult(requested=len(keys))
        # Walk the L2 run first; it costs only a dictionary lookup per page.
        i = 0
        while i < len(keys) and self.l2 is not None and (kv := self.l2.get(keys[i])) is not None:
            result.pages.append(kv)
            result.tiers.append("l2")
            i += 1
        # The L3 run that follows (a page in neither tier ends what can be brought back).
        disk: list[str] = []
        if self.l3 is not None:
            for key in keys[i:]:
                if key not in self.l3 and not (self.l2 is not None and key in self.l2):
                    break
                disk.append(key)
        if not disk:
            result.waited_s = time.perf_counter() - start
            return result
        if self.policy == "best_effort":
            result.pending = sum(not self._submit(k).done() for k in disk if not (self.l2 is not None and k in self.l2))
            result.waited_s = time.perf_counter() - start
            return result
        # A later page may still sit in L2 (it was touched more recently than this one). Take
        # those before starting any load: a load lands in L2 and may evict them.
        held = {k: kv for k in disk if self.l2 is not None and (kv := self.l2.get(k)) is not None}
        futures = [("l2", _done(held[k])) if k in held else ("l3", self._submit(k)) for k in disk]
        timeout = None if self.policy == "wait_complete" else self.timeout_ms / 1000.0
        wait([f for _, f in futures], timeout=timeout)
        for tier, fut in futures:
            kv = fut.result() if fut.done() and not fut.cancelled() and fut.exception() is None else None
            if kv is None:
                break
            result.pages.append(kv)
            result.tiers.append(tier)
        result.pending = sum(not f.done() for _, f in futures)
        result.waited_s = time.perf_counter() - start
        return result


@dataclass
class PrefetchTicket:
    """Loads from L3 started for one waiting request (`Prefetcher.start`), so the request can
    wait in the line while the step thread keeps running the batch. `ready()` says when it
    may be admitted: every load finished (wait_complete), or that or its deadline passed
    (timeout: it then starts with what arrived, recomputing the rest)."""

    loads: dict[str, Future]
    deadline: float | None  # time.monotonic() deadline, None: wait for all
    # The run's pages that were in L2 when it started, held: the loads land in L2 and may
    # evict them before the request is admitted.
    held: dict[str, torch.Tensor] = field(default_factory=dict)

    def ready(self) -> bool:
        if all(f.done() for f in self.loads.values()):
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def wait(self, timeout: float) -> None:
        """Blocks up to `timeout` seconds for the loads (the step thread, when it has nothing
        else to run)."""
        if self.deadline is not None:
            timeout = max(0.0, min(timeout, self.deadline - time.monotonic()))
        wait(list(self.loads.values()), timeout=timeout)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------- facade


class KVTiers:
    """L2 + L3 + prefetcher behind the calls the KV cache manager needs. None of them
    raises: a failure is counted (`error_counts`) and is a miss."""

    def __init__(self, l2: HostPageStore | None, l3: DiskPageStore | None, prefetcher: Prefetcher):
        self.l2, self.l3, self.prefetcher = l2, l3, prefetcher
        self._other_errors: dict[tuple[str, str], int] = {}
        self._errors_lock = threading.Lock()

    @property
    def first_tier(self) -> str:
        return "l2" if self.l2 is not None else "l3"

    def record_error(self, tier: str, op: str, exc: BaseException) -> None:
        """Counts and logs a failure met outside the stores (copying a page out of the
        pool, a prefetch that could not start)."""
        with self._errors_lock:
            self._other_errors[(tier, op)] = self._other_errors.get((tier, op), 0) + 1
        _ERRORS.error(tier, op, f"{type(exc).__name__}: {exc}")

    def error_counts(self) -> dict[tuple[str, str], int]:
        """Failures so far by (tier, op), op "read" or "write"; the metric
        preheat_kv_tier_errors_total{tier,op} follows these."""
        with self._errors_lock:
            counts = dict(self._other_errors)
        for tier, store in (("l2", self.l2), ("l3", self.l3)):
            if store is not None:
                counts[(tier, "read")] = counts.get((tier, "read"), 0) + store.stats.read_errors
                counts[(tier, "write")] = counts.get((tier, "write"), 0) + store.stats.write_errors
        return counts

    @classmethod
    def from_config(cls, cfg: CacheSettings, disk_capacity_bytes: int | None = None) -> KVTiers | None:
        """From the cache section's host_cache_size (GiB), disk_cache_dir, prefetch_policy,
        prefetch_timeout_ms. None when both tiers are off."""
        l3 = DiskPageStore(cfg.disk_cache_dir, disk_capacity_bytes) if cfg.disk_cache_dir else None
        l2 = None
        if cfg.host_cache_size > 0:
            l2 = HostPageStore(int(cfg.host_cache_size * GIB), on_evict=l3.put if l3 is not None else None, pin_memory=True)
        if l2 is None and l3 is None:
            return None
        return cls(l2, l3, Prefetcher(l2, l3, cfg.prefetch_policy, cfg.prefetch_timeout_ms))

    def offload(self, key: str, kv: torch.Tensor) -> None:
        """The L1 eviction hook: keep the page in L2 (which spills to L3), or L3 directly."""
        try:
            if self.l2 is not None:
                self.l2.put(key, kv)
            elif self.l3 is not None:
                self.l3.put(key, kv)
        except Exception as e:
            self.record_error(self.first_tier, "write", e)

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        """Where each page is: "l2", "l3" or None (for match accounting without loading)."""
        out: list[str | None] = []
        for k in keys:
            out.append("l2" if self.l2 is not None and k in self.l2 else "l3" if self.l3 is not None and k in self.l3 else None)
        return out

    def fetch(self, keys: Sequence[str]) -> PrefetchResult:
        """The leading run of pages available (see Prefetcher); a failure is an empty run."""
        try:
            return self.prefetcher.fetch(keys)
        except Exception as e:
            self.record_error(self.first_tier, "read", e)
            return PrefetchResult(requested=len(keys))

    def start(self, keys: Sequence[str]) -> PrefetchTicket | None:
        """Starts a waiting request's L3 loads (see Prefetcher.start); a failure is no ticket
        (admission then fetches as it would have)."""
        try:
            return self.prefetcher.start(keys)
        except Exception as e:
            self.record_error("l3", "read", e)
            return None

    def collect(self, keys: Sequence[str], ticket: PrefetchTicket) -> PrefetchResult:
        try:
            return self.prefetcher.collect(keys, ticket)
        except Exception as e:
            self.record_error(self.first_tier, "read", e)
            return PrefetchResult(requested=len(keys))

    def close(self) -> None:
        self.prefetcher.close()
