"""The engine: requests in, tokens out, one scheduler step at a time.

`Engine.step()` reads as its parts: take what other threads handed in (engine/sched/inbox.py),
*schedule* (engine/sched/scheduler.py: the pure planner, engine/sched/plan.py, decides over
views of the queues what runs, and the scheduler carries it out through the KV cache
manager), *run* (one forward pass and sampling, engine/runner.py) and *postprocess* (the
scheduler records progress, appends tokens, checks stops). What an engine is made of is
built by engine/assemble.py; speculative drafts come from engine/sched/speculation.py;
requests are validated and built by engine/request/builder.py. `add_request`,
`abort_request` and `call_soon` may be called from other threads; everything else runs on
the stepping thread.

A request can fail, the engine cannot: an exception while admitting, preparing, sampling
or detokenizing one sequence ends that sequence with finish_reason "error" (its pages freed)
and the step goes on for the others. Only an exception from the forward pass itself leaves
`step()`, and the caller (engine/async_engine.py) then declares the engine dead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preheat.engine.assemble import assemble, fetched_config
from preheat.engine.config import EngineConfig
from preheat.engine.kv.pool import available_memory_bytes
from preheat.engine.kv.radix import RadixCache
from preheat.engine.kv.snapshot import PrefixRecord
from preheat.engine.kv.tiers import KVTiers
from preheat.engine.model import weight_arena
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import RequestOutput, Sequence
from preheat.engine.runner import EntryFailed, EntryTokens
from preheat.engine.sched.inbox import Inbox, run_calls
from preheat.engine.sched.scheduler import Batch, Scheduler, SchedulerLimits
from preheat.engine.sched.speculation import Speculator, warm_speculation

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
    failed_total: int = 0  # requests ended by an error of their own (finish_reason "error")
    spec_draft_tokens_total: int = 0  # speculative draft tokens verified by the model
    spec_accepted_tokens_total: int = 0  # of those, the ones it accepted

    @property
    def kv_usage(self) -> float:
        return self.kv_used_pages / max(1, self.kv_capacity_pages)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(1, self.prompt_tokens_total)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = fetched_config(config or EngineConfig(**overrides))
        self.config = config
        parts = assemble(config)
        self.device, self.dtype, self.tp = parts.device, parts.dtype, parts.tp
        loaded = parts.loaded
        self.model, self.hf_config, self.model_config = loaded.model, loaded.hf_config, loaded.spec
        self.tokenizer, self.served_model_name = loaded.tokenizer, loaded.served_model_name
        self.weights_id, self.weights_from_cache, self.hf_dir = loaded.weights_id, loaded.weights_from_cache, loaded.hf_dir
        self.prepared_dir = loaded.prepared_dir  # the packed matrices kept in the weight cache, if any
        self.attention_backend, self.load_seconds = loaded.attention_backend, loaded.load_seconds
        self.kernels = loaded.kernels  # the kernel backend object (engine/kernels/backend.py)
        self.quantization = parts.quantization  # --quantization auto resolved: "int8" or None
        self.max_model_len, self.kv_dtype = parts.max_model_len, parts.kv_dtype
        self.chunked_prefill_size = parts.chunked_prefill_size
        self.pool, self.fingerprint, self.kv = parts.pool, parts.fingerprint, parts.kv
        self.grammar_backend, self.runner, self.requests = parts.grammar_backend, parts.runner, parts.requests
        self.cuda_graph_capture_seconds = parts.cuda_graph_capture_seconds
        self.cuda_graph_batch_sizes = parts.cuda_graph_batch_sizes
        self.inbox = Inbox()
        self.scheduler = Scheduler(
            self.kv, self.pool.page_size,
            SchedulerLimits(config.max_num_seqs, self.chunked_prefill_size, config.max_queue_len),
        )
        self.speculator = Speculator(config)
        self.spec_warmup_seconds = self.warm_speculation() if self.speculator.enabled else 0.0
        # The CPU kernels' matrices copied into huge pages on an idle-priority thread once the
        # engine serves (weight_move.start(): after /ready in lifecycle.py, at the end of
        # LLM(...); never on the way to ready), swapped in at a step's start. None on a GPU
        # or a tensor-parallel engine (engine/model/weight_arena.py).
        self.weight_move = (
            weight_arena.WeightMove(self.model, lambda: available_memory_bytes(self.device))
            if self.device.type == "cpu" and self.tp is None else None
        )  # fmt: skip

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

    # The queues live in the scheduler; tests, metrics and the warm-start code read them.
    @property
    def waiting(self) -> collections.deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

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
        self.inbox.put([seq])
        return seq.request_id

    def enqueue_all(self, seqs: list[Sequence]) -> list[str]:
        """Queues all of one request's sequences or none: raises QueueFull when they would
        make more than `max_queue_len` sequences wait (the server's backpressure)."""
        self.inbox.put(seqs, admit=lambda handed_in: self.scheduler.check_room(len(seqs), handed_in))
        return [s.request_id for s in seqs]

    def check_request_budget(self, prompt_tokens: int, param: str = "prompt") -> None:
        """Raises RequestRejected when one request's sequences together bring more prompt
        tokens than `--max-request-prompt-tokens`."""
        self.requests.check_request_budget(prompt_tokens, param)

    def abort_request(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Runs fn(*args) on the stepping thread at the start of the next step (the pool and
        the radix tree are not thread-safe). The step loop sees pending calls as work."""
        return self.inbox.call(fn, *args)

    def has_unfinished(self) -> bool:
        if self.tp is not None:
            self.tp.check()  # a dead worker ends the engine even while it idles
        return not self.inbox.empty() or self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.inbox.waiting(),
            kv_used_pages=self.pool.num_used_pages,
            kv_capacity_pages=self.pool.capacity_pages,
            kv_cached_pages=self.kv.cached_pages,
            prompt_tokens_total=c.prompt_tokens,
            cached_tokens_total=c.cached_tokens,
            generation_tokens_total=c.generation_tokens,
            preemptions_total=c.preemptions,
            deferred_total=c.deferred,
            failed_total=c.failed,
            spec_draft_tokens_total=c.spec_draft_tokens,
            spec_accepted_tokens_total=c.spec_accepted_tokens,
        )

    # --- the step: take the inbox -> schedule -> run -> postprocess ---------------------------
    def step(self) -> list[RequestOutput]:
        if self.weight_move is not None:
            self.weight_move.apply_if_done()
        outputs = self._take_inbox()
        started = time.perf_counter()
        batch = self.scheduler.schedule(self.speculator.propose(self.scheduler.running), outputs)
        if batch.empty:
            self.scheduler.fail_unrunnable(outputs)
            return outputs
        results = self._run(batch, outputs)
        outputs.extend(self.scheduler.postprocess(batch, results))
        # What drafting cost this step, for the speculation gate (the whole step: drafts'
        # rows, their verification and the tokens they add to detokenize).
        self.speculator.observe_step(batch.decode, batch.extend, time.perf_counter() - started,
                                     sum(len(r.token_ids) for r in results))
        return outputs

    def _take_inbox(self) -> list[RequestOutput]:
        """Runs the calls handed in, queues the new requests, ends the aborted ones."""
        delivery = self.inbox.take()
        run_calls(delivery.calls)
        self.scheduler.add(delivery.sequences)
        return self.scheduler.abort(delivery.aborts) if delivery.aborts else []

    def _run(self, batch: Batch, outputs: list[RequestOutput]) -> list[EntryTokens]:
        """Run: the forward pass and sampling. A sequence whose inputs cannot be prepared is
        failed and the batch prepared again without it; a failure of the forward pass itself
        propagates (the engine is then dead)."""
        while not batch.empty:
            try:
                return self.runner.run(batch.decode, batch.extend)
            except EntryFailed as failed:
                outputs.append(self.scheduler.fail(failed.entry.seq, "preparing its inputs", failed.error))
                batch.drop(failed.entry)
        return []

    def warm_speculation(self) -> float:
        """Runs the speculative verify path before the engine serves (engine/sched/speculation.py)."""
        cfg = self.config
        return warm_speculation(self.runner, self.kv, self.requests, cfg.num_speculative_tokens, cfg.max_num_seqs,
                                self.model_config.vocab_size, self.max_model_len, self.pool.page_size)

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
