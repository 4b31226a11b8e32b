"""The paged KV pool: one tensor allocated at start-up, handed out page by page.

Sizing follows the seed formula: kv_bytes_per_token = 2 x layers x kv_heads x head_dim x
dtype_size, tokens = free_memory x mem_fraction / kv_bytes_per_token. After start-up no
memory is allocated: pages are integers on a free list.
"""

from __future__ import annotations

import mmap
import os

import torch

from preheat.engine.kv.prefault import DEFAULT_BUDGET_BYTES, Prefaulter

SCRATCH_PAGE = 0  # never handed out: padding rows and masked slots write here


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        prefault_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        """`prefault_bytes`: how much of a CPU pool's lowest pages (the first handed out) a
        background thread at idle priority gives memory before they are written
        (engine/kv/prefault.py; 0: none, every page faults on first write)."""
        if num_pages < 2:
            raise ValueError("the KV pool needs at least two pages (one is scratch)")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = device
        # zeros, not empty: masked attention multiplies unused slots by 0, and 0 * NaN is NaN.
        self.kv = zeroed((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), dtype, device)
        # fp8 pools: one scale per layer for K and one for V (engine/kernels/kv_fp8.py), carried
        # by the per-layer cache views the model is handed. 1.0 until calibrated.
        self.scales: torch.Tensor | None = None
        self._views = [(self.kv[layer, 0], self.kv[layer, 1]) for layer in range(num_layers)]
        if dtype.itemsize == 1 and dtype.is_floating_point:
            self.scales = torch.ones((num_layers, 2, 1), dtype=torch.float32, device=device)
            for layer, (k, v) in enumerate(self._views):
                k.kv_scale, v.kv_scale = self.scales[layer, 0], self.scales[layer, 1]
        # Lowest ids first so a fresh pool fills from the front (nicer locality).
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._free_set = set(self._free)
        self._prefault: Prefaulter | None = None
        if prefault_bytes > 0 and getattr(self.kv, "mapped", False):
            page_bytes = page_size * num_kv_heads * head_dim * dtype.itemsize
            self._prefault = Prefaulter(self, self.kv.data_ptr(), num_layers * 2, num_pages, page_bytes,
                                        prefault_bytes)

    def k(self, layer: int) -> torch.Tensor:
        return self._views[layer][0]

    def v(self, layer: int) -> torch.Tensor:
        return self._views[layer][1]

    def set_scales(self, scales: torch.Tensor) -> None:
        """Loads calibrated fp8 scales [num_layers, 2] in place (before any page is written)."""
        assert self.scales is not None, "only an fp8 pool has scales"
        self.scales.copy_(scales.reshape(self.scales.shape).to(self.scales.device, torch.float32))

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.capacity_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None when fewer are free (the caller evicts or preempts)."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        # The free list's tail holds its lowest pages, highest first: reversed, a sequence's
        # pages ascend in memory, the direction the CPU's prefetchers follow from one page to
        # the next. Measured (AMD EPYC, 2 threads, 30 layers' pages from memory): the CPU
        # decode kernel over 8 / 16 contexts of 290 tokens took 1.33x / 1.29x the time on
        # the same pages in descending order, which is how prompts' pages came out before.
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        self._free_set.difference_update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for p in pages:
            if p == SCRATCH_PAGE or p in self._free_set or p in seen or not 0 < p < self.num_pages:
                raise ValueError(f"double free or bad page id {p}")
            seen.add(p)
        self._free.extend(reversed(pages))
        self._free_set.update(pages)

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """KV of whole pages as [num_layers, 2, len(pages) * page_size, kvh, hd] on the CPU
        (snapshot export, L2/L3 offload). A tensor-parallel rank 0 overrides this to gather
        every rank's heads (engine/distributed/kv.py)."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.kv.device)
        kv = self.kv.index_select(2, index)  # [L, 2, n, ps, kvh, hd]
        L, two, n, ps, kvh, hd = kv.shape
        return kv.reshape(L, two, n * ps, kvh, hd).to("cpu")

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Inverse of read_pages."""
        L, two, tokens, kvh, hd = kv.shape
        ps = self.page_size
        blocks = kv.reshape(L, two, tokens // ps, ps, kvh, hd).to(device=self.kv.device, dtype=self.kv.dtype)
        index = torch.tensor(pages, dtype=torch.int64, device=self.kv.device)
        target = self.kv
        if self.scales is not None and target.device.type == "cpu":  # no fp8 index_copy_ on CPU
            target, blocks = target.view(torch.uint8), blocks.view(torch.uint8)
        target.index_copy_(2, index, blocks)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it lies in an anonymous memory mapping: the kernel hands out
    zero pages on first touch, so start-up does not write the whole pool (torch.zeros
    memset ~1 GiB: about a second of a 2-core start) and pages never used cost nothing
    (beyond the first ones KVPool has populated while idle, engine/kv/prefault.py). The
    tensor keeps the mapping alive. The memory is not reserved up front: the pool is sized
    from free memory (`available_memory_bytes`, `pool_pages`). No MADV_HUGEPAGE: a first touch would then zero 2 MiB
    per layer's K and V (tens of ms inside one request's prefill), not the 4 KiB it writes."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    tensor.mapped = True  # memory comes on first touch: KVPool may populate it ahead (prefault.py)
    return tensor


def available_memory_bytes(device: torch.device) -> int:
    """Free memory the pool may take. On the CPU: the node's MemAvailable, but no more than
    the container's memory limit leaves (`cgroup_headroom_bytes`): in a pod /proc/meminfo
    is the node's, and a pool sized from it outgrows a smaller limit, which first touch
    hides until load brings the OOM kill."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    headroom = cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)


# (limit, usage, stat, the stat's reclaimable file-cache key) of this process's memory
# cgroup: v2, then v1. In a container the cgroup namespace puts its own cgroup at the
# mount's root.
CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_inactive_file",
    ),
)


def cgroup_headroom_bytes(files: tuple[tuple[str, str, str, str], ...] = CGROUP_MEMORY_FILES) -> int | None:
    """The memory cgroup's limit minus its working set, or None without a limit (v2 "max",
    v1's near-2^63 "unlimited", no cgroup files). The working set is the usage less the
    inactive file cache, as the kubelet counts it for eviction: the usage also holds the
    page cache of files the process read (a model's weights: gigabytes), which the kernel
    reclaims before it kills anything, so counting it would shrink the pool by the model's
    size. No stat file: the usage as it is (smaller, never larger, than the room)."""
    for limit_path, usage_path, stat_path, inactive_key in files:
        try:
            with open(limit_path) as f:
                limit_text = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        try:
            limit = int(limit_text)
        except ValueError:
            continue
        if limit >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2^63 - 1
            return None
        return max(0, limit - max(0, usage - _stat_value(stat_path, inactive_key)))
    return None


def _stat_value(path: str, key: str) -> int:
    """One "key value" line of a cgroup memory.stat, 0 when absent or unreadable."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def pool_pages(
    kv_bytes_per_token: int,
    free_memory: int,
    mem_fraction: float,
    page_size: int,
    max_total_tokens: int | None,
) -> int:
    """Pages the pool gets (plus the scratch page), from the seed formula."""
    tokens = int(free_memory * mem_fraction / kv_bytes_per_token)
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    pages = tokens // page_size
    if pages < 1:
        raise ValueError(
            f"no room for a KV pool: {free_memory / 2**30:.2f} GiB free x {mem_fraction} "
            f"holds {tokens} tokens at {kv_bytes_per_token} bytes each"
        )
    return pages + 1
