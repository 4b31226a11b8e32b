"""The engine: requests in, tokens out, one scheduler step at a time.

`Engine.step()` drains newly added and aborted requests, asks the planner
(engine/scheduler.py) what runs, applies that plan to the KV pool and radix cache, runs one
forward pass and sampling (engine/runner.py), and reports what moved. `add_request` and
`abort_request` may be called from other threads; everything else runs on the stepping thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from preheat.engine.config import ConfigError, EngineConfig, default_chunked_prefill_size
from preheat.engine.detokenizer import IncrementalDetokenizer
from preheat.engine.dtypes import torch_dtype
from preheat.engine.kernels import attention
from preheat.engine.kv import prefix_io
from preheat.engine.kv.pool import KVPool, available_memory_bytes, pool_pages
from preheat.engine.kv.radix import RadixCache, RadixNode
from preheat.engine.kv.snapshot import PrefixRecord, model_fingerprint, tokenizer_hash
from preheat.engine.kv.tiers import KVTiers, page_keys, root_key
from preheat.engine.model.llama import LlamaModel, RotaryEmbedding
from preheat.engine.model.loader import fuse_weights, load_model
from preheat.engine.model.spec import rope_inv_freq
from preheat.engine.runner import BatchEntry, ModelRunner
from preheat.engine.sampling_params import SamplingParams
from preheat.engine.scheduler import SeqView, StepPlan, next_tokens_key, pages_for, plan_step
from preheat.engine.sequence import RequestOutput, Sequence, Status, TokenLogprob

log = logging.getLogger(__name__)

@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_used_pages: int
    kv_capacity_pages: int
    kv_cached_pages: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    deferred_total: int = 0  # admissions put off a step for a sharer computing their prefix

    @property
    def kv_usage(self) -> float:
        return self.kv_used_pages / max(1, self.kv_capacity_pages)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(1, self.prompt_tokens_total)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return torch_dtype(name)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        started = time.monotonic()
        loaded = load_model(config.model, self.dtype, config.weight_cache_dir)
        self.hf_config = loaded.hf_config
        self.model_config = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.served_model_name = config.served_model_name or loaded.served_name
        self.weights_id = loaded.weights_id
        self.weights_from_cache = loaded.from_cache
        self.hf_dir = loaded.hf_dir  # lets benchmarks and tests load the same weights in transformers
        spec = loaded.spec
        weights = {k: v.to(self.device) for k, v in fuse_weights(spec, loaded.weights).items()}
        inv_freq, scaling = rope_inv_freq(loaded.hf_config, spec.head_dim)
        self.model = LlamaModel(spec, weights, RotaryEmbedding(inv_freq.to(self.device), scaling, self.dtype))
        self.attention_backend = attention.set_backend(self.device)
        self.load_seconds = time.monotonic() - started
        log.info(
            "model: %s (%s, %d layers, %d heads / %d KV heads, head_dim %d) on %s in %s, loaded in %.1fs",
            self.served_model_name, spec.architecture, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, self.device, str(self.dtype).removeprefix("torch."),
            self.load_seconds,
        )

        self.max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        from preheat.engine.kernels.kv_fp8 import kv_storage_dtype

        try:
            self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype, self.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.chunked_prefill_size = config.chunked_prefill_size or default_chunked_prefill_size(
            self.device.type,
            torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0,
        )
        fraction = config.mem_fraction_static or (0.85 if self.device.type == "cuda" else 0.10)
        num_pages = pool_pages(
            spec.kv_bytes_per_token(self.kv_dtype),
            available_memory_bytes(self.device),
            fraction,
            config.page_size,
            config.max_total_tokens,
        )
        self.pool = KVPool(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages, config.page_size, self.kv_dtype, self.device
        )
        log.info(
            "kv pool: %d tokens in %d pages of %d, %.2f GiB; up to %d prompt tokens per step",
            self.pool.capacity_pages * config.page_size, self.pool.capacity_pages, config.page_size,
            self.pool.bytes / 2**30, self.chunked_prefill_size,
        )
        self.radix = RadixCache(self.pool) if config.enable_prefix_caching else None
        self.fingerprint = self._fingerprint()
        self.tiers = KVTiers.from_config(config) if self.radix is not None else None
        self._tier_root = root_key(self.fingerprint)
        if self.tiers is not None:
            self.radix.on_evict = self._offload
            log.info(
                "kv tiers: L2 %.2f GiB host memory, L3 %s, prefetch %s",
                config.host_cache_size, config.disk_cache_dir or "off", config.prefetch_policy,
            )
        self.tier_hit_tokens = {"l1": 0, "l2": 0, "l3": 0}
        self.tier_restore_seconds: list[float] = []  # L2/L3 -> L1 copy times, drained by metrics
        self.pinned: dict[tuple[int, ...], Any] = {}

        self.grammar_backend: Any = None
        grammar_masks = None
        try:
            from preheat.engine import structured

            self.grammar_backend = structured.GrammarBackend(self.tokenizer, spec.vocab_size)
            grammar_masks = structured.apply_grammar_masks
        except ImportError as exc:  # structured output is optional for the core engine
            log.warning("structured output unavailable: %s", exc)
        self.runner = ModelRunner(self.model, self.pool, self.device, grammar_masks)
        graphs = self.runner.setup_graphs(
            min(config.cuda_graph_max_bs, config.max_num_seqs),
            self.max_model_len,
            config.disable_cuda_graph,
            self.attention_backend,
        )
        self.cuda_graph_capture_seconds = graphs.capture_seconds
        self.cuda_graph_batch_sizes = list(graphs.batch_sizes)

        self.stop_token_ids = self._default_stop_ids()
        self._rng = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._deferred = 0
        self._calls: list[tuple[Any, tuple, concurrent.futures.Future]] = []

    # --- requests ----------------------------------------------------------------------
    def _default_stop_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return ids

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return [int(t) for t in prompt]

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a request; raises ValueError with a clear message when it cannot run."""
        return self.enqueue(self.build_sequence(prompt, params, request_id))

    def enqueue(self, seq: Sequence) -> str:
        with self._lock:
            self._inbox.append(seq)
        return seq.request_id

    def build_sequence(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        """Validates a request and builds its sequence without queueing it, so a caller with
        several requests can refuse them all before any starts."""
        params = params or SamplingParams()
        params.validate()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary [0, {vocab})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {self.max_model_len}; "
                "shorten the prompt"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} plus the prompt's {n} tokens exceeds the "
                f"context length {self.max_model_len}"
            )
        limit = n + params.max_tokens if params.max_tokens is not None else self.max_model_len
        capacity = self.pool.capacity_pages * self.pool.page_size
        if pages_for(limit, self.pool.page_size) > self.pool.capacity_pages:
            raise ValueError(f"the request needs up to {limit} tokens of KV but the pool holds {capacity}")
        matcher = None
        if params.structured is not None:
            if self.grammar_backend is None:
                raise ValueError("structured output is not available in this build")
            compiled = self.grammar_backend.compile(params.structured)
            matcher = self.grammar_backend.new_matcher(compiled)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.stop_token_ids
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        seq = Sequence(
            request_id,
            token_ids,
            params,
            generator,
            IncrementalDetokenizer(self.tokenizer, list(params.stop or []), params.include_stop_str_in_output),
            stop_ids,
            limit,
            matcher,
        )
        return seq

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts or self._calls)
        return pending or bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._inbox),
            kv_used_pages=self.pool.num_used_pages,
            kv_capacity_pages=self.pool.capacity_pages,
            kv_cached_pages=self.radix.total_pages if self.radix else 0,
            prompt_tokens_total=self._prompt_tokens,
            cached_tokens_total=self._cached_tokens,
            generation_tokens_total=self._generation_tokens,
            preemptions_total=self._preemptions,
            deferred_total=self._deferred,
        )

    # --- KV bookkeeping ------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int] | None:
        pages = self.pool.alloc(n)
        if pages is None and self.radix is not None:
            self.radix.evict(n - self.pool.num_free_pages)
            pages = self.pool.alloc(n)
        return pages

    def _cache_progress(self, seq: Sequence) -> None:
        """Hands the sequence's fully computed pages to the radix tree so other requests
        (and this one after a preemption) can reuse them."""
        if self.radix is None:
            return
        ps = self.pool.page_size
        full = seq.num_computed // ps
        if full <= seq.num_shared:
            return
        tree_pages, node = self.radix.insert(seq.all_token_ids[: full * ps], seq.pages[:full])
        duplicates = [seq.pages[i] for i in range(seq.num_shared, full) if tree_pages[i] != seq.pages[i]]
        seq.pages[:full] = tree_pages
        self.radix.lock(node)
        if seq.node is not None:
            self.radix.unlock(seq.node)
        seq.node = node
        seq.num_shared = full
        if duplicates:
            self.pool.free(duplicates)

    def _release(self, seq: Sequence) -> None:
        self._cache_progress(seq)
        if seq.node is not None and self.radix is not None:
            self.radix.unlock(seq.node)
        private = seq.pages[seq.num_shared :]
        if private:
            self.pool.free(private)
        seq.pages, seq.node, seq.num_shared, seq.num_computed = [], None, 0, 0

    def _admit(self, seq: Sequence) -> None:
        """Moves a waiting sequence to running with its cached prefix locked."""
        tokens = seq.all_token_ids
        if self.radix is not None:
            match = self.radix.match_prefix(tokens[: len(tokens) - 1])
            self.radix.lock(match.node)
            seq.node, seq.pages = match.node, list(match.pages)
            seq.num_shared, seq.num_computed = len(match.pages), match.length
            if self.tiers is not None:
                self._bring_back(tokens[: len(tokens) - 1], seq)
            self.tier_hit_tokens["l1"] += match.length
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_computed
            self._prompt_tokens += len(seq.prompt_token_ids)
            self._cached_tokens += seq.num_computed
        seq.status = Status.RUNNING

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self._preemptions += 1

    # --- the step ------------------------------------------------------------------------
    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
            calls, self._calls = self._calls, []
        for fn, args, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller, never kills the step loop
                    future.set_exception(exc)
        self.waiting.extend(new)
        outputs = []
        if aborts:
            for seq in [s for s in itertools.chain(self.running, self.waiting) if s.request_id in aborts]:
                outputs.append(self._finish(seq, "abort"))
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        if seq.status is Status.RUNNING:
            self._release(seq)
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        return self._output(seq)

    def _views(self) -> tuple[list[SeqView], list[SeqView]]:
        sharing = self.radix is not None  # deferring to a sharer only pays with a prefix cache
        running = [
            SeqView(
                s.request_id, s.num_tokens, s.num_computed, len(s.pages), len(s.pages) - s.num_shared,
                next_tokens_key=(
                    next_tokens_key(s.all_token_ids, s.num_computed, s.num_tokens - 1)
                    if sharing and s.num_computed % self.pool.page_size == 0
                    else None
                ),
            )
            for s in self.running
        ]
        waiting = []
        for s in self.waiting:
            if not sharing:
                waiting.append(SeqView(s.request_id, s.num_tokens, 0, 0, 0))
                continue
            tokens = s.all_token_ids
            match = self.radix.match_prefix(tokens[: len(tokens) - 1], touch=False)
            waiting.append(
                SeqView(
                    s.request_id, s.num_tokens, 0, 0, 0, match.length, self._evictable_on_path(match.node),
                    next_tokens_key(tokens, match.length, len(tokens) - 1),
                )
            )
        return running, waiting

    def _evictable_on_path(self, node: RadixNode) -> int:
        """Pages of the cached prefix ending at `node` (a waiting request's match) that are
        counted as evictable today: admitting the request locks them, taking them out of the
        free headroom."""
        total = 0
        while node is not self.radix.root:
            if node.lock_ref == 0 and node.pin_count == 0:
                total += len(node.pages)
            node = node.parent
        return total

    def plan(self) -> StepPlan:
        running, waiting = self._views()
        free = self.pool.num_free_pages + (self.radix.evictable_pages if self.radix else 0)
        return plan_step(
            running, waiting, free, self.pool.page_size, self.config.max_num_seqs, self.chunked_prefill_size
        )

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        plan = self.plan()
        self._deferred += len(plan.deferred)
        by_id = {s.request_id: s for s in itertools.chain(self.running, self.waiting)}
        for rid in plan.preempt:
            self._preempt(by_id[rid])
        for rid in plan.admit:
            seq = by_id[rid]
            self.waiting.remove(seq)
            self._admit(seq)
            self.running.append(seq)

        decode: list[BatchEntry] = []
        extend: list[BatchEntry] = []
        for rid in plan.decode:
            seq = by_id[rid]
            if not self._grow(seq, seq.num_computed + 1):
                self._preempt(seq)
                continue
            decode.append(BatchEntry(seq, seq.num_computed, 1, True))
        for rid, n in plan.extend:
            seq = by_id[rid]
            n = min(n, seq.num_tokens - seq.num_computed)
            if n <= 0 or not self._grow(seq, seq.num_computed + n):
                if rid in plan.admit:  # could not get its pages after all: back in line
                    self._release(seq)
                    seq.status = Status.WAITING
                    self.running.remove(seq)
                    self.waiting.appendleft(seq)
                continue
            done = seq.num_computed + n == seq.num_tokens
            extend.append(BatchEntry(seq, seq.num_computed, n, done))
        if not decode and not extend:
            self._fail_unrunnable(outputs)
            return outputs

        result = self.runner.run(decode, extend)
        for entry in decode:
            entry.seq.num_computed += 1
        for entry in extend:
            entry.seq.num_computed += entry.length
            self._cache_progress(entry.seq)  # concurrent requests can share a prefix at once
        if result is not None:
            sampled = [e.seq for e in decode + extend if e.sample]
            for i, seq in enumerate(sampled):
                lp = None
                if seq.logprobs is not None and result.logprobs is not None:
                    lp = TokenLogprob(result.token_ids[i], result.logprobs[i], (result.top_logprobs or [[]])[i])
                outputs.append(self._append_token(seq, result.token_ids[i], lp))
        return outputs

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = pages_for(num_tokens, self.pool.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self._alloc(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _fail_unrunnable(self, outputs: list[RequestOutput]) -> None:
        """Nothing could be scheduled. If sequences are running, the pool is held by what
        cannot be evicted (pinned prefixes): the newest running sequence ends with "length",
        as far as memory let it go. If nothing fits even in an empty pool, the head request
        fails. Either way the engine never spins without progress."""
        if self.running:
            log.warning("kv pool exhausted by pinned or locked prefixes; ending the newest request")
            outputs.append(self._finish(self.running[-1], "length"))
            return
        if not self.waiting:
            return
        evictable = self.radix.evictable_pages if self.radix else 0
        if self.pool.num_free_pages + evictable >= self.pool.capacity_pages:
            outputs.append(self._finish(self.waiting[0], "abort"))

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> RequestOutput:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(token)
        self._generation_tokens += 1
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(lp)
        reason = None
        if seq.matcher is not None:
            accepted = seq.matcher.accept_token(token)
            if not accepted or seq.matcher.is_terminated():
                reason = "stop"
        if token in seq.stop_token_ids:
            reason = "stop"
        else:
            seq.detokenizer.add(token)
            if seq.detokenizer.stopped:
                reason = "stop"
        if reason is None and seq.num_tokens >= seq.max_total_tokens:
            reason = "length"
        if reason is not None:
            return self._finish(seq, reason)
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        new_ids = seq.output_token_ids[seq.emitted_tokens :]
        seq.emitted_tokens = len(seq.output_token_ids)
        new_lps = None
        if seq.logprobs is not None:
            new_lps = seq.logprobs[seq.emitted_logprobs :]
            seq.emitted_logprobs = len(seq.logprobs)
        new_text = seq.detokenizer.take_new_text(seq.finished)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=new_ids,
            text=seq.detokenizer.text if seq.finished else seq.detokenizer.text[: seq.detokenizer.emitted],
            new_text=new_text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            cached_tokens=seq.cached_tokens or 0,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            new_logprobs=new_lps,
        )

    # --- warm start: calls on the stepping thread, pinning, snapshots, tiers ----------------
    def call_soon(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """Runs fn(*args) on the stepping thread at the start of the next step (the pool and
        the radix tree are not thread-safe). The step loop sees pending calls as work."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, args, future))
        return future

    def _fingerprint(self) -> dict[str, Any]:
        tok = self.tokenizer
        spec = self.model_config
        return model_fingerprint(
            architecture=spec.architecture,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=self.kv_dtype,
            page_size=self.pool.page_size,
            tokenizer_hash=tokenizer_hash(
                tok.get_vocab(),
                special_tokens={k: str(v) for k, v in tok.special_tokens_map.items()},
                chat_template=getattr(tok, "chat_template", None),
            ),
            model_id=self.weights_id,
        )

    def pin_prefix(self, token_ids: list[int]) -> int:
        """Keeps the cached, page-aligned part of this prefix from eviction (stepping thread).
        Returns the tokens pinned: 0 when the prefix is not cached yet (run it first)."""
        if self.radix is None:
            return 0
        ps = self.pool.page_size
        aligned = list(token_ids[: len(token_ids) - len(token_ids) % ps])
        match = self.radix.match_prefix(aligned, touch=False)
        if match.length == 0:
            return 0
        key = tuple(aligned[: match.length])
        if key not in self.pinned:
            self.radix.pin(match.node)
            self.pinned[key] = match.node
        return match.length

    def export_prefixes(self, max_tokens: int | None) -> list[PrefixRecord]:
        """The hottest cached prefixes with their KV, pinned first (stepping thread)."""
        if self.radix is None:
            return []
        return prefix_io.export_prefixes(self.pool, self.radix, max_tokens)

    def import_prefixes(self, records: list[PrefixRecord]) -> int:
        """Puts restored prefixes into the cache, pinning those recorded as pinned; returns
        tokens of KV restored (stepping thread, or before the loop starts). Records come
        prefix-first: one that extends another (kv_start > 0) needs that one in the cache."""
        if self.radix is None:
            return 0
        restored = 0
        for record in records:
            tokens = list(record.token_ids)
            have = self.radix.match_prefix(tokens, touch=False).length
            if have < record.kv_start:
                log.warning("snapshot: skipping a prefix whose first %d tokens are not cached", record.kv_start)
                continue
            node = prefix_io.import_prefix(
                self.pool, self.radix, tokens,
                lambda start, end, r=record: r.kv[:, :, start - r.kv_start : end - r.kv_start], self._alloc,
            )
            if node is None:
                log.warning("snapshot: no room in the KV pool for the remaining prefixes")
                break
            node.hits = max(node.hits, record.hits)
            restored += len(tokens) - have
            if record.pinned:
                self.pin_prefix(tokens)
        return restored

    def _offload(self, path_tokens: list[int], pages: list[int]) -> None:
        """Radix eviction hook: evicted pages go down to L2/L3 instead of being dropped."""
        assert self.tiers is not None
        keys = page_keys(path_tokens, self.pool.page_size, self._tier_root)[-len(pages):]
        kv = prefix_io.read_pages(self.pool, pages)
        ps = self.pool.page_size
        for i, key in enumerate(keys):
            self.tiers.offload(key, kv[:, :, i * ps : (i + 1) * ps].contiguous())

    def _bring_back(self, tokens: list[int], seq: Sequence) -> None:
        """Extends a radix match with pages found in L2/L3 (by the prefetch policy), then
        re-matches so the sequence starts after them."""
        assert self.radix is not None and self.tiers is not None
        ps = self.pool.page_size
        aligned = tokens[: len(tokens) - len(tokens) % ps]
        start_page = seq.num_shared
        if start_page * ps >= len(aligned):
            return
        keys = page_keys(aligned, ps, self._tier_root)[start_page:]
        if self.tiers.locate(keys[:1])[0] is None:
            return
        t0 = time.perf_counter()
        fetched = self.tiers.fetch(keys)
        if not fetched.pages:
            return
        n = len(fetched.pages)
        end = (start_page + n) * ps
        kv = torch.cat(fetched.pages, dim=2)
        node = prefix_io.import_prefix(
            self.pool, self.radix, aligned[:end], lambda a, b: kv[:, :, a - start_page * ps : b - start_page * ps],
            self._alloc,
        )
        if node is None:
            return
        self.tier_restore_seconds.append(time.perf_counter() - t0)
        for tier in fetched.tiers:
            self.tier_hit_tokens[tier] += ps
        match = self.radix.match_prefix(tokens)
        self.radix.lock(match.node)
        self.radix.unlock(seq.node)
        seq.node, seq.pages = match.node, list(match.pages)
        seq.num_shared, seq.num_computed = len(match.pages), match.length
