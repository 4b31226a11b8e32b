"""The engine: requests in, tokens out, one scheduler step at a time.

`Engine.step()` reads as its four parts: *schedule* (the pure planner in engine/sched/scheduler.py
decides over views of the state what runs), *apply* (preemptions, admissions and the pages
the plan granted, through the KV cache manager in engine/kv/cache_manager.py), *run* (one
forward pass and sampling, engine/runner.py) and *postprocess* (progress, new tokens, stop
checks, outputs). Requests are validated and built by engine/request/builder.py.
`add_request`, `abort_request` and `call_soon` may be called from other threads; everything
else runs on the stepping thread.

A request can fail, the engine cannot: an exception while admitting, preparing, sampling
or detokenizing one sequence ends that sequence with finish_reason "error" (its pages freed)
and the step goes on for the others. Only an exception from the forward pass itself leaves
`step()`, and the caller (engine/async_engine.py) then declares the engine dead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from preheat.engine.config import ConfigError, EngineConfig, default_chunked_prefill_size
from preheat.engine.distributed.comm import all_reduce
from preheat.engine.distributed.driver import DrivenModel
from preheat.engine.distributed.launcher import TensorParallel
from preheat.engine.dtypes import torch_dtype
from preheat.engine.kernels.backend import select_backend
from preheat.engine.kv.cache_manager import KVCacheManager
from preheat.engine.kv.pool import KVPool, available_memory_bytes, pool_pages
from preheat.engine.kv.radix import RadixCache
from preheat.engine.kv.snapshot import PrefixRecord, model_fingerprint, tokenizer_hash
from preheat.engine.kv.tiers import KVTiers
from preheat.engine.model.build import build_model, select_moe_backend
from preheat.engine.model.loader import load_model
from preheat.engine.model.quantize import quantize_weights
from preheat.engine.request.builder import RequestBuilder, default_stop_ids
from preheat.engine.request.errors import QueueFull, RequestRejected
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import RequestOutput, Sequence, Status, TokenLogprob
from preheat.engine.runner import BatchEntry, EntryFailed, EntryTokens, ModelRunner, run_prompt
from preheat.engine.sched.scheduler import SeqView, StepPlan, next_tokens_key, plan_step
from preheat.engine.sched.spec_decode import NgramDrafter, draft_limit

log = logging.getLogger(__name__)

QUEUE_RETRY_AFTER_S = 1.0  # what a 429 for a full queue tells the client to wait


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
    failed_total: int = 0  # requests ended by an error of their own (finish_reason "error")
    spec_draft_tokens_total: int = 0  # speculative draft tokens verified by the model
    spec_accepted_tokens_total: int = 0  # of those, the ones it accepted

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


def fetched_config(config: EngineConfig) -> EngineConfig:
    """The config with a hub or S3 --model replaced by its local copy (downloaded now when
    missing). `preheat serve` has already done this in its downloading phase (a no-op
    then); the Python API (`LLM(model="org/name")`) gets it here."""
    from preheat.engine.model.download import Progress
    from preheat.engine.model.fetch import fetch_model, needs_download

    if not needs_download(config.model):
        return config
    fetched = fetch_model(config.model, config.download_dir, config.weight_cache_dir, Progress())
    return dataclasses.replace(config, model=fetched.path,
                               served_model_name=config.served_model_name or fetched.served_name)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = fetched_config(config or EngineConfig(**overrides))
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        started = time.monotonic()
        # Tensor parallel: the workers start first (their start-up overlaps this load), read
        # the checkpoint themselves and build their shards (engine/distributed/).
        self.tp = TensorParallel.launch(config, self.device, self.dtype) if config.tensor_parallel_size > 1 else None
        try:
            loaded = load_model(config.model, self.dtype, config.weight_cache_dir)
            if self.tp is not None:
                self.tp.join(loaded)
        except BaseException:
            self.close()
            raise
        self.hf_config = loaded.hf_config
        self.model_config = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.served_model_name = config.served_model_name or loaded.served_name
        self.weights_id = loaded.weights_id
        self.weights_from_cache = loaded.from_cache
        self.hf_dir = loaded.hf_dir  # lets benchmarks and tests load the same weights in transformers
        spec = loaded.spec
        moe_backend = select_moe_backend(self.device) if spec.moe is not None else "torch"
        # Before the model is built: the backend decides the weights' form (packed for the
        # CPU kernels, plain tensors elsewhere).
        self.kernels = select_backend(self.device)
        self.attention_backend = self.kernels.name
        self.quantization = config.quantization
        weights = loaded.weights
        if config.quantization:
            weights = quantize_weights(weights, spec, loaded.source, config.quantization)
        self.model = build_model(
            spec, loaded.hf_config, weights, self.device, self.dtype, moe_backend, backend=self.kernels,
            **({"sharder": self.tp.sharder(spec), "reduce": all_reduce} if self.tp else {}),
        )  # fmt: skip
        del loaded, weights  # the model holds what it needs; drop the checkpoint's own tensors
        self.load_seconds = time.monotonic() - started
        log.info(
            "model: %s (%s, %d layers, %d heads / %d KV heads, head_dim %d) on %s in %s%s%s, kernels %s, "
            "loaded in %.1fs",
            self.served_model_name, spec.architecture, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, self.device, str(self.dtype).removeprefix("torch."),
            f" with {self.quantization} weights" if self.quantization else "",
            f", tensor parallel over {self.tp.size} ranks" if self.tp else "", self.attention_backend,
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
        kv_heads = self.tp.local_kv_heads(spec.num_kv_heads) if self.tp else spec.num_kv_heads
        if self.tp and self.device.type == "cpu":
            fraction /= self.tp.size  # every rank's pool comes out of the same host memory
        num_pages = pool_pages(
            spec.kv_bytes_per_token(self.kv_dtype) * kv_heads // spec.num_kv_heads,  # this rank's heads
            available_memory_bytes(self.device),
            fraction,
            config.page_size,
            config.max_total_tokens,
        )
        pool_shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages, config.page_size, self.kv_dtype)
        self.pool = self.tp.make_pool(*pool_shape) if self.tp else KVPool(*pool_shape, self.device)
        if self.pool.scales is not None and not self.tp:  # fp8 KV: per-layer scales, calibrated
            from preheat.engine.kv.fp8_calibration import calibrate_kv_scales

            prefill = functools.partial(run_prompt, self.model, self.device)
            self.pool.set_scales(calibrate_kv_scales(prefill, self.tokenizer, spec, self.device, self.dtype,
                                                     self.kv_dtype, config.page_size))
        if self.tp:
            self.model = DrivenModel(self.model, self.tp)
        log.info(
            "kv pool: %d tokens in %d pages of %d, %.2f GiB; up to %d prompt tokens per step",
            self.pool.capacity_pages * config.page_size, self.pool.capacity_pages, config.page_size,
            self.pool.bytes / 2**30, self.chunked_prefill_size,
        )
        self.fingerprint = model_fingerprint(
            architecture=spec.architecture,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=self.kv_dtype,
            page_size=self.pool.page_size,
            tokenizer_hash=tokenizer_hash(
                self.tokenizer.get_vocab(),
                special_tokens={k: str(v) for k, v in self.tokenizer.special_tokens_map.items()},
                chat_template=getattr(self.tokenizer, "chat_template", None),
            ),
            model_id=self.weights_id,
            # Quantized weights give other KV; the field is absent otherwise, so snapshots
            # of unquantized engines keep their fingerprint.
            **({"quantization": self.quantization} if self.quantization else {}),
            # fp8 KV: values were divided by these scales; other scales read them wrong.
            **({"kv_scales": self.pool.scales.flatten().tolist()} if self.pool.scales is not None else {}),
        )
        radix = RadixCache(self.pool) if config.enable_prefix_caching else None
        tiers = KVTiers.from_config(config) if radix is not None else None
        if tiers is not None:
            log.info(
                "kv tiers: L2 %.2f GiB host memory, L3 %s, prefetch %s",
                config.host_cache_size, config.disk_cache_dir or "off", config.prefetch_policy,
            )
        self.kv = KVCacheManager(self.pool, radix, tiers, self.fingerprint)

        self.grammar_backend: Any = None
        grammar_masks = draft_grammar_masks = None
        try:
            from preheat.engine.sample import structured

            self.grammar_backend = structured.GrammarBackend(
                self.tokenizer, spec.vocab_size, compile_timeout=config.grammar_compile_timeout
            )
            grammar_masks = structured.apply_grammar_masks
            draft_grammar_masks = structured.apply_draft_grammar_masks
        except ImportError as exc:  # structured output is optional for the core engine
            log.warning("structured output unavailable: %s", exc)
        self.runner = ModelRunner(self.model, self.pool, self.device, grammar_masks, draft_grammar_masks)
        graphs = self.runner.setup_graphs(
            min(config.cuda_graph_max_bs, config.max_num_seqs),
            self.max_model_len,
            config.disable_cuda_graph,
            self.attention_backend,
        )
        self.cuda_graph_capture_seconds = graphs.capture_seconds
        self.cuda_graph_batch_sizes = list(graphs.batch_sizes)

        self.requests = RequestBuilder(
            self.tokenizer, spec.vocab_size, self.max_model_len, self.pool.capacity_pages, self.pool.page_size,
            default_stop_ids(self.tokenizer, self.hf_config), self.grammar_backend, self.device, config.seed,
            config.max_request_prompt_tokens,
        )
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
        self._failed = 0
        self._calls: list[tuple[Any, tuple, concurrent.futures.Future]] = []
        # The sequences the last plan() looked at: the running ones and the head of the line.
        self._planned: dict[str, Sequence] = {}
        self.speculative = config.speculative_method is not None
        self.drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self._drafts: dict[str, list[int]] = {}  # this step's proposals, by request id
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        self.spec_warmup_seconds = 0.0
        if self.speculative:
            log.info(
                "speculative decoding: %s, up to %d draft tokens, n-grams of %d..%d tokens",
                config.speculative_method, config.num_speculative_tokens,
                config.prompt_lookup_min, config.prompt_lookup_max,
            )
            self.spec_warmup_seconds = self.warm_speculation()

    @property
    def sharding(self) -> dict[str, Any]:
        """How this engine is sharded, as a snapshot manifest records it. Snapshot KV holds
        every KV head whatever the sharding (see engine/distributed/kv.py)."""
        return {"tensor_parallel_size": self.tp.size if self.tp else 1, "kv_heads": "all"}

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (a single-rank engine holds nothing
        that needs closing)."""
        if self.tp is not None:
            self.tp.close()

    # --- requests (any thread) -----------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a request; raises ValueError with a clear message when it cannot run."""
        return self.enqueue(self.build_sequence(prompt, params, request_id))

    def build_sequence(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        """Validates a request and builds its sequence without queueing it, so a caller with
        several requests can refuse them all before any starts."""
        return self.requests.build(prompt, params, request_id)

    def enqueue(self, seq: Sequence) -> str:
        """Queues a built sequence, however long the line (the Python API's batches)."""
        with self._lock:
            self._inbox.append(seq)
        return seq.request_id

    def enqueue_all(self, seqs: list[Sequence]) -> list[str]:
        """Queues all of one request's sequences or none: raises QueueFull when they would
        make more than `max_queue_len` sequences wait (the server's backpressure)."""
        limit = self.config.max_queue_len
        if len(seqs) > limit:  # could never fit: waiting for room would not help
            raise RequestRejected(
                "request_too_large", "n",
                f"the request adds {len(seqs)} sequences (prompts x n) but at most {limit} may wait "
                "(--max-queue-len); send fewer prompts or choices per request",
            )
        with self._lock:
            waiting = len(self._inbox) + len(self.waiting)
            if waiting + len(seqs) > limit:
                raise QueueFull(
                    "queue_full",
                    f"the server is at capacity: {waiting} requests are waiting to start and at most "
                    f"{limit} may (--max-queue-len); retry later",
                    retry_after=QUEUE_RETRY_AFTER_S,
                )
            self._inbox.extend(seqs)
        return [s.request_id for s in seqs]

    def check_request_budget(self, prompt_tokens: int, param: str = "prompt") -> None:
        """Raises RequestRejected when one request's sequences together bring more prompt
        tokens than `--max-request-prompt-tokens`."""
        self.requests.check_request_budget(prompt_tokens, param)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def call_soon(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """Runs fn(*args) on the stepping thread at the start of the next step (the pool and
        the radix tree are not thread-safe). The step loop sees pending calls as work."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, args, future))
        return future

    def has_unfinished(self) -> bool:
        if self.tp is not None:
            self.tp.check()  # a dead worker ends the engine even while it idles
        with self._lock:
            pending = bool(self._inbox or self._aborts or self._calls)
        return pending or bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._inbox),
            kv_used_pages=self.pool.num_used_pages,
            kv_capacity_pages=self.pool.capacity_pages,
            kv_cached_pages=self.kv.cached_pages,
            prompt_tokens_total=self._prompt_tokens,
            cached_tokens_total=self._cached_tokens,
            generation_tokens_total=self._generation_tokens,
            preemptions_total=self._preemptions,
            deferred_total=self._deferred,
            failed_total=self._failed,
            spec_draft_tokens_total=self._spec_draft_tokens,
            spec_accepted_tokens_total=self._spec_accepted_tokens,
        )

    # --- the step: schedule -> apply -> run -> postprocess ---------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        plan = self.plan()
        decode, extend = self._apply(plan, outputs)
        if not decode and not extend:
            self._fail_unrunnable(outputs)
            return outputs
        results = self._run(decode, extend, outputs)
        outputs.extend(self._postprocess(decode, extend, results))
        return outputs

    def _run(self, decode: list[BatchEntry], extend: list[BatchEntry], outputs: list[RequestOutput]) -> list[EntryTokens]:
        """Run: the forward pass and sampling. A sequence whose inputs cannot be prepared is
        failed and the batch prepared again without it; a failure of the forward pass itself
        propagates (the engine is then dead)."""
        while decode or extend:
            try:
                return self.runner.run(decode, extend)
            except EntryFailed as failed:
                entry = failed.entry
                outputs.append(self._fail(entry.seq, "preparing its inputs", failed.error))
                if entry in decode:
                    decode.remove(entry)
                else:
                    extend.remove(entry)
        return []

    def _drain_inbox(self) -> list[RequestOutput]:
        """Takes what other threads handed in: calls to run here, new requests, aborts."""
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

    def plan(self) -> StepPlan:
        """Schedule: what runs this step, decided by the pure planner over views of the state."""
        self._drafts = self._propose_drafts() if self.speculative else {}
        running, waiting = self._views()
        return plan_step(
            running, waiting, self.kv.free_pages, self.pool.page_size, self.config.max_num_seqs,
            self.chunked_prefill_size,
        )

    def admission_window(self) -> int:
        """How many waiting sequences the next plan looks at: as many as could start (free
        running slots), and as many again for those deferred to a sharer. The rest of the
        line costs the step nothing (no prefix match), however long it is."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        return 2 * free

    def _views(self) -> tuple[list[SeqView], list[SeqView]]:
        sharing = self.radix is not None  # deferring to a sharer only pays with a prefix cache
        # A request waiting for its L3 pages is not in the head: the line moves past it.
        ready = (s for s in self.waiting if not self.kv.prefetch_pending(s))
        head = list(itertools.islice(ready, self.admission_window()))
        self._planned = {s.request_id: s for s in itertools.chain(self.running, head)}
        running = [
            SeqView(
                s.request_id, s.num_tokens, s.num_computed, len(s.pages), len(s.pages) - s.num_shared,
                next_tokens_key=(
                    next_tokens_key(s.all_token_ids, s.num_computed, s.num_tokens - 1)
                    if sharing and s.num_computed % self.pool.page_size == 0
                    else None
                ),
                num_draft=len(self._drafts.get(s.request_id, ())),
            )
            for s in self.running
        ]
        waiting = []
        for s in head:
            if not sharing:
                waiting.append(SeqView(s.request_id, s.num_tokens, 0, 0, 0))
                continue
            tokens = s.all_token_ids
            cached = self.kv.peek_prefix(tokens[: s.max_cached_prefix + 1])
            waiting.append(
                SeqView(
                    s.request_id, s.num_tokens, 0, 0, 0, cached.length, cached.evictable_pages,
                    next_tokens_key(tokens, cached.length, len(tokens) - 1),
                )
            )
        return running, waiting

    def _propose_drafts(self) -> dict[str, list[int]]:
        """Speculative decoding: a prompt-lookup draft for each decoding sequence (none for
        a sequence with no n-gram match or no room left before its length limit). A draft
        only speeds a request up: when proposing one raises, that sequence decodes without
        one this step (logged), and nothing else is affected."""
        cfg = self.config
        drafts = {}
        for seq in self.running:
            if seq.num_computed != seq.num_tokens - 1:
                continue  # still prefilling
            try:
                limit = draft_limit(cfg.num_speculative_tokens, seq.num_tokens, seq.max_total_tokens)
                draft = self.drafter.propose(seq.all_token_ids, limit)[:limit] if limit else []
            except Exception:
                log.exception("request %s: proposing a draft failed; it decodes without one", seq.request_id)
                continue
            if draft:
                drafts[seq.request_id] = draft
        return drafts

    def _apply(
        self, plan: StepPlan, outputs: list[RequestOutput]
    ) -> tuple[list[BatchEntry], list[BatchEntry]]:
        """Carries the plan out: preemptions, admissions, and each scheduled sequence gets the
        pages the plan granted it. A sequence whose pages cannot be had after all (pinned
        or tier pages the planner could not foresee) does not run: a decode is preempted, an
        admission goes back in line, a continuing prefill waits a step. An admission that
        raises fails that request alone."""
        self._deferred += len(plan.deferred)
        by_id = self._planned
        for rid in plan.preempt:
            self._preempt(by_id[rid])
        failed: set[str] = set()
        for rid in plan.admit:
            seq = by_id[rid]
            self.waiting.remove(seq)
            self.running.append(seq)
            try:
                if self._admit(seq):  # pages came back from L2/L3: it starts later than planned
                    plan.rebase_admission(rid, seq.num_tokens, seq.num_computed, len(seq.pages), self.pool.page_size)
            except Exception as exc:
                outputs.append(self._fail(seq, "admitting it", exc))
                failed.add(rid)

        decode: list[BatchEntry] = []
        extend: list[BatchEntry] = []
        drafted: list[BatchEntry] = []
        for rid in plan.decode:
            seq = by_id[rid]
            if not self.kv.grow(seq, plan.pages[rid]):
                self._preempt(seq)
                continue
            draft = self._drafts.get(rid, [])[: plan.drafts.get(rid, 0)]
            if draft:  # verified as an extend of 1 + len(draft) tokens over its prefix
                drafted.append(BatchEntry(seq, seq.num_computed, 1 + len(draft), True, draft))
            else:
                decode.append(BatchEntry(seq, seq.num_computed, 1, True))
        extend.extend(drafted)
        for rid, n in plan.extend:
            if rid in failed:
                continue
            seq = by_id[rid]
            if not self.kv.grow(seq, plan.pages[rid]):
                if rid in plan.admit:
                    self._requeue(seq)
                continue
            last = seq.num_computed + n == seq.num_tokens
            extend.append(BatchEntry(seq, seq.num_computed, n, last and not seq.params.prompt_only))
        return decode, extend

    def _admit(self, seq: Sequence) -> int:
        """Moves a waiting sequence to running from its cached prefix; returns the tokens
        brought back from L2/L3 (see KVCacheManager.admit)."""
        seq.status = Status.RUNNING  # first: a failing admission is released like a running one
        restored = self.kv.admit(seq)
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_computed
            self._prompt_tokens += len(seq.prompt_token_ids)
            self._cached_tokens += seq.num_computed
        return restored

    def _requeue(self, seq: Sequence) -> None:
        """Back to the head of the line, its pages given back (what it computed stays cached)."""
        self.kv.release(seq)
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self._preemptions += 1

    def _postprocess(
        self, decode: list[BatchEntry], extend: list[BatchEntry], results: list[EntryTokens]
    ) -> list[RequestOutput]:
        """Records what the forward pass computed and sampled; returns the outputs."""
        outputs = []
        for entry in decode:
            entry.seq.num_computed += 1
        for entry in extend:
            if entry.draft:
                continue  # its progress depends on how much of the draft was accepted
            entry.seq.num_computed += entry.length
            try:
                self.kv.cache_progress(entry.seq)  # concurrent requests can share a prefix at once
            except Exception as exc:
                outputs.append(self._fail(entry.seq, "caching its prefix", exc))
                continue
            if entry.seq.params.prompt_only and entry.seq.num_computed == entry.seq.num_tokens:
                outputs.append(self._finish(entry.seq, "length"))  # computed and cached: done
        for r in results:
            seq = r.seq
            if seq.finished:
                continue  # failed above
            if r.error is not None:
                stage = "verifying its draft" if r.num_draft else "sampling"
                outputs.append(self._fail(seq, stage, r.error))
                continue
            try:
                if r.num_draft:
                    # The last known token and the accepted drafts now have verified KV; the
                    # rejected drafts' KV is dead: pages holding only that go back to the pool.
                    accepted = len(r.token_ids) - 1
                    seq.num_computed += 1 + accepted
                    self._spec_draft_tokens += r.num_draft
                    self._spec_accepted_tokens += accepted
                lps: list[TokenLogprob | None] = [None] * len(r.token_ids)
                if seq.logprobs is not None and r.logprobs is not None:
                    tops = r.top_logprobs or [[] for _ in r.token_ids]
                    lps = [TokenLogprob(t, lp, top) for t, lp, top in zip(r.token_ids, r.logprobs, tops)]
                output = self._append_tokens(seq, r.token_ids, lps)
                if r.num_draft and seq.status is Status.RUNNING:
                    self.kv.truncate(seq, seq.num_tokens)
            except Exception as exc:  # the grammar matcher, the detokenizer, stop strings
                # A draft step counted its accepted tokens as computed before appending them:
                # only those appended may be cached when its pages are released.
                seq.num_computed = min(seq.num_computed, seq.num_tokens)
                outputs.append(self._fail(seq, "detokenizing", exc))
                continue
            outputs.append(output)
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob | None]) -> RequestOutput:
        """Appends this step's tokens one by one, as decoding them one per step would: the
        first that finishes the request (stop token or string, grammar end, length) is the
        last; the rest are dropped."""
        for token, lp in zip(tokens, lps):
            reason = self._append_token(seq, token, lp)
            if reason is not None:
                # Draft tokens past this one were computed but are not part of the output.
                seq.num_computed = min(seq.num_computed, seq.num_tokens)
                return self._finish(seq, reason)
        return seq.take_output()

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> str | None:
        """Appends one token; returns the finish reason it causes, if any."""
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
        return reason

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        self._remove(seq)
        seq.finish_reason = reason
        try:
            return seq.take_output()
        except Exception as exc:  # its detokenizer: the request fails, the step goes on
            return self._fail(seq, "detokenizing", exc)

    def _remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the running set or the line, its pages given back. Marked
        finished first, so a second call (after a failing release) does nothing."""
        status, seq.status = seq.status, Status.FINISHED
        if status is Status.RUNNING:
            self.running.remove(seq)
            self.kv.release(seq)
        elif status is Status.WAITING:
            self.waiting.remove(seq)

    def _fail(self, seq: Sequence, stage: str, exc: BaseException) -> RequestOutput:
        """Ends one request that raised while the engine was `stage`: logged with its id, its
        pages freed, and an output with finish_reason "error" that names the failure (the
        server answers 500). Its detokenizer is not asked again: it may be what failed."""
        log.error("request %s failed while %s: %s: %s", seq.request_id, stage, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self._failed += 1
        try:
            self._remove(seq)
        except Exception:  # what it held cannot be given back cleanly; the others go on
            log.exception("request %s: releasing its KV pages failed", seq.request_id)
        return seq.error_output(f"the request failed while {stage}: {type(exc).__name__}: {exc}")

    def _fail_unrunnable(self, outputs: list[RequestOutput]) -> None:
        """Nothing could be scheduled. If sequences are running, the pool is held by what
        cannot be evicted (pinned prefixes): the newest running sequence ends with "length",
        as far as memory let it go. If nothing fits even in an empty pool, the head request
        fails. Either way the engine never spins without progress."""
        if not self.running and self.kv.wait_prefetch(self.waiting, 0.01):
            return  # only requests waiting for L3 pages: let the disk work
        if self.running:
            log.warning("kv pool exhausted by pinned or locked prefixes; ending the newest request")
            outputs.append(self._finish(self.running[-1], "length"))
            return
        if self.waiting and self.kv.all_free():
            outputs.append(self._finish(self.waiting[0], "abort"))

    # --- speculative decoding warmup ---------------------------------------------------------
    def warm_speculation(self) -> float:
        """Runs the speculative path at batch sizes 1, 2 and 4 (up to --max-num-seqs) before
        the engine serves: a short prefill, then a verify step with a full draft through the
        extend path, every row's logits and the verify sampler (greedy and sampled rows). The
        first drafted steps after /ready then cost what steady ones do (on CPU oneDNN builds
        a kernel per matmul shape the first time it sees it; on GPU the eager extend path
        picks its kernels). Bigger batches are left to traffic and warmup templates: each
        size here is a real forward pass of start-up time. Uses pages of its own and leaves
        the radix cache and the counters alone. Returns the seconds it took."""
        started = time.monotonic()
        k = self.config.num_speculative_tokens
        vocab = self.model_config.vocab_size
        prompt = [(11 + 7 * i) % vocab for i in range(max(8, k + 1))]  # short: the verify step is what counts
        if len(prompt) + k + 1 > self.max_model_len:
            return 0.0
        ps = self.pool.page_size
        for bs in (1, 2, 4):
            if bs > self.config.max_num_seqs:
                break
            seqs: list[Sequence] = []
            try:
                for i in range(bs):
                    params = SamplingParams(max_tokens=k + 2, temperature=0.0 if i % 2 else 1.0, ignore_eos=True)
                    pages = self.kv.alloc(-(-(len(prompt) + k + 1) // ps))
                    if pages is None:
                        break
                    seq = self.requests.build(prompt, params, f"spec-warmup-{bs}-{i}")
                    seq.pages = pages
                    seqs.append(seq)
                if len(seqs) < bs:
                    break
                self.runner.run([], [BatchEntry(s, 0, len(prompt) - 1, False) for s in seqs])
                verified = self.runner.run([], [BatchEntry(s, len(prompt) - 1, 1 + k, True, prompt[:k]) for s in seqs])
                for r in verified:  # the runner contains a row's failure; start-up must not
                    if r.error is not None:
                        raise r.error
            finally:
                for s in seqs:
                    self.pool.free(s.pages)
                    s.pages = []
        took = time.monotonic() - started
        log.info("speculative decoding warmed up in %.2fs", took)
        return took

    # --- warm start: pinning, snapshots (stepping thread; see KVCacheManager) --------------
    def pin_prefix(self, token_ids: list[int]) -> int:
        """Keeps the cached, page-aligned part of this prefix from eviction (stepping thread).
        Returns the tokens pinned: 0 when the prefix is not cached yet (run it first)."""
        return self.kv.pin_prefix(token_ids)

    def export_prefixes(self, max_tokens: int | None) -> list[PrefixRecord]:
        """The hottest cached prefixes with their KV, pinned first (stepping thread)."""
        return self.kv.export_prefixes(max_tokens)

    def import_prefixes(self, records: list[PrefixRecord]) -> int:
        """Puts restored prefixes into the cache, pinning those recorded as pinned; returns
        tokens of KV restored (stepping thread, or before the loop starts)."""
        return self.kv.import_prefixes(records)

    # The KV state's parts, as benchmarks, tests and metrics read them.
    @property
    def radix(self) -> RadixCache | None:
        return self.kv.radix

    @property
    def tiers(self) -> KVTiers | None:
        return self.kv.tiers

    @property
    def tier_hit_tokens(self) -> dict[str, int]:
        return self.kv.tier_hit_tokens

    @property
    def tier_restore_seconds(self) -> list[float]:
        return self.kv.tier_restore_seconds
