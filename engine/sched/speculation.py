"""Speculative decoding's drafting side: which decoding sequences get a draft this step, and
the warm-up of the verify path before the engine serves.

The drafter (prompt lookup, engine/sample/spec_decode.py) proposes; the planner grants the
drafts KV pages; the runner verifies them as extends and the sampler accepts a prefix
(engine/sample/sampler.py). A draft only ever speeds a request up, so anything that goes
wrong here costs that sequence its draft for one step, never the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from preheat.engine.config import SpeculativeSettings
from preheat.engine.kv.cache_manager import KVCacheManager
from preheat.engine.request.builder import RequestBuilder
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import Sequence
from preheat.engine.runner import BatchEntry, ModelRunner
from preheat.engine.sample.spec_decode import NgramDrafter, draft_limit

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeSettings) -> None:
        self.enabled = config.speculative_method is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        self.drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self.warmup_seconds = 0.0
        if self.enabled:
            log.info(
                "speculative decoding: %s, up to %d draft tokens, n-grams of %d..%d tokens",
                config.speculative_method, config.num_speculative_tokens,
                config.prompt_lookup_min, config.prompt_lookup_max,
            )

    def propose(self, running: Iterable[Sequence]) -> dict[str, list[int]]:
        """A prompt-lookup draft for each decoding sequence (none for a sequence with no
        n-gram match or no room left before its length limit, none at all when speculation
        is off). When proposing one raises, that sequence decodes without one this step
        (logged), and nothing else is affected."""
        if not self.enabled:
            return {}
        drafts = {}
        for seq in running:
            if seq.num_computed != seq.num_tokens - 1:
                continue  # still prefilling
            try:
                limit = draft_limit(self.num_speculative_tokens, seq.num_tokens, seq.max_total_tokens)
                draft = self.drafter.propose(seq.all_token_ids, limit)[:limit] if limit else []
            except Exception:
                log.exception("request %s: proposing a draft failed; it decodes without one", seq.request_id)
                continue
            if draft:
                drafts[seq.request_id] = draft
        return drafts


def warm_speculation(
    runner: ModelRunner, kv: KVCacheManager, requests: RequestBuilder, num_speculative_tokens: int,
    max_num_seqs: int, vocab_size: int, max_model_len: int, page_size: int,
) -> float:
    """Runs the speculative path at batch sizes 1, 2 and 4 (up to --max-num-seqs) before
    the engine serves: a short prefill, then a verify step with a full draft through the
    extend path, every row's logits and the verify sampler (greedy and sampled rows). The
    first drafted steps after /ready then cost what steady ones do (on CPU oneDNN builds
    a kernel per matmul shape the first time it sees it; on GPU the eager extend path
    picks its kernels). Bigger batches are left to traffic and warmup templates: each
    size here is a real forward pass of start-up time. Uses pages of its own and leaves
    the radix cache and the counters alone. Returns the seconds it took."""
    started = time.monotonic()
    k = num_speculative_tokens
    prompt = [(11 + 7 * i) % vocab_size for i in range(max(8, k + 1))]  # short: the verify step is what counts
    if len(prompt) + k + 1 > max_model_len:
        return 0.0
    for bs in (1, 2, 4):
        if bs > max_num_seqs:
            break
        seqs: list[Sequence] = []
        try:
            for i in range(bs):
                params = SamplingParams(max_tokens=k + 2, temperature=0.0 if i % 2 else 1.0, ignore_eos=True)
                pages = kv.alloc(-(-(len(prompt) + k + 1) // page_size))
                if pages is None:
                    break
                seq = requests.build(prompt, params, f"spec-warmup-{bs}-{i}")
                seq.pages = pages
                seqs.append(seq)
            if len(seqs) < bs:
                break
            runner.run([], [BatchEntry(s, 0, len(prompt) - 1, False) for s in seqs])
            verified = runner.run([], [BatchEntry(s, len(prompt) - 1, 1 + k, True, prompt[:k]) for s in seqs])
            for r in verified:  # the runner contains a row's failure; start-up must not
                if r.error is not None:
                    raise r.error
        finally:
            for s in seqs:
                kv.pool.free(s.pages)
                s.pages = []
    took = time.monotonic() - started
    log.info("speculative decoding warmed up in %.2fs", took)
    return took
