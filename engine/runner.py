"""Turns a scheduled batch into tensors, runs the model, samples.

This is where the GPU path plugs in: a batch of decodes only (every row one token) goes
through `decode_forward`, which on CUDA replays a captured graph for the padded batch size
(engine/cuda_graph.py) and elsewhere runs eagerly.

A decoding sequence with a speculative draft (engine/sample/spec_decode.py) comes as an extend
entry of 1 + len(draft) tokens over its cached prefix: the extend attention path computes
it, every one of its rows yields logits, and `verify_drafts` keeps what the model agrees
with. Such a step runs eagerly (plain decode steps keep their CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from preheat.engine.cuda_graph import CudaGraphRunner, DecodeInputs
from preheat.engine.kv.pool import KVPool
from preheat.engine.model.decoder import AttentionMetadata, DecoderModel
from preheat.engine.request.sequence import Sequence
from preheat.engine.sample.prompt_logprobs import prompt_rows, record_prompt_logprobs
from preheat.engine.sample.sampler import SampleResult, sample, verify_drafts


@dataclass(eq=False)
class BatchEntry:
    seq: Sequence
    start: int  # first position computed this step
    length: int  # tokens computed this step
    sample: bool  # whether this entry's last token produces a new token
    # Speculative decoding: the draft tokens that follow the sequence's last known token in
    # this entry (length == 1 + len(draft)); every row of the entry is verified.
    draft: list[int] | None = None


@dataclass
class EntryTokens:
    """What one sampled entry yields this step: one token, or with a draft the accepted
    draft tokens plus the model's own (logprobs per token when the request asked)."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    num_draft: int = 0
    # Set when this entry's sampling or verification raised: the engine fails that request
    # alone (token_ids is then empty).
    error: BaseException | None = None


class EntryFailed(Exception):
    """One sequence's inputs could not be prepared; the engine fails that request and runs
    the batch without it."""

    def __init__(self, entry: BatchEntry, error: BaseException) -> None:
        super().__init__(f"{entry.seq.request_id}: {error}")
        self.entry = entry
        self.error = error


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        pool: KVPool,
        device: torch.device,
        grammar_masks: Callable | None,
        draft_grammar_masks: Callable | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.grammar_masks = grammar_masks
        self.draft_grammar_masks = draft_grammar_masks
        self.graph_runner = None  # set by the CUDA-graph path when it captures

    def _page_table(self, seqs: list[Sequence]) -> torch.Tensor:
        # One tensor from padded rows: a tensor per row and a copy into the table cost
        # ~10 us a sequence, every step.
        width = max(len(s.pages) for s in seqs)
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def prepare(self, decode: list[BatchEntry], extend: list[BatchEntry]) -> tuple[torch.Tensor, AttentionMetadata]:
        ps = self.pool.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for entry in decode + extend:
            try:
                end = entry.start + entry.length
                if entry.draft:  # the draft's tokens follow the sequence's known ones
                    known = entry.seq.num_tokens
                    entry_ids = (entry.seq.token_ids(entry.start, min(end, known))
                                 + entry.draft[max(0, entry.start - known) : max(0, end - known)])  # fmt: skip
                else:
                    entry_ids = entry.seq.token_ids(entry.start, end)
                pages = entry.seq.pages
                entry_slots = [pages[pos // ps] * ps + pos % ps for pos in range(entry.start, end)]
                if len(entry_ids) != entry.length:
                    raise IndexError(f"{entry.length} tokens from {entry.start} asked, {len(entry_ids)} known")
            except Exception as exc:
                raise EntryFailed(entry, exc) from exc
            ids.extend(entry_ids)
            positions.extend(range(entry.start, end))
            slots.extend(entry_slots)
        dev = self.device
        # Token ids, positions and slots as the rows of one tensor: one conversion from lists
        # a step instead of three (each ~10-20 us with the caches cold after a step's weights).
        ids_t, positions_t, slots_t = torch.tensor([ids, positions, slots], dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            positions=positions_t,
            slots=slots_t,
            num_decode=len(decode),
            decode_page_table=self._page_table([e.seq for e in decode]) if decode else None,
            decode_seq_lens=(
                torch.tensor([e.start + 1 for e in decode], dtype=torch.int32, device=dev) if decode else None
            ),
            extend_page_table=self._page_table([e.seq for e in extend]) if extend else None,
            extend_prefix_lens=[e.start for e in extend],
            extend_lens=[e.length for e in extend],
            verify_only=bool(extend) and all(e.draft for e in extend),
        )
        return ids_t, meta

    def _decode_fn(self, inp: DecodeInputs) -> torch.Tensor:
        meta = AttentionMetadata(
            positions=inp.positions,
            slots=inp.slots,
            num_decode=inp.batch_size,
            decode_page_table=inp.page_table,
            decode_seq_lens=inp.seq_lens,
            extend_page_table=None,
            extend_prefix_lens=[],
            extend_lens=[],
        )
        return self.model.forward(inp.input_ids, meta, self.pool)

    def setup_graphs(
        self, max_bs: int, max_model_len: int, disable: bool, attention_backend: str, on_capture=None
    ) -> CudaGraphRunner:
        """Captures decode graphs (on CUDA with the Triton backend) before the engine is
        ready; elsewhere the runner decodes eagerly and logs why."""
        ps = self.pool.page_size
        self.graph_runner = CudaGraphRunner(
            self._decode_fn,
            max_bs=max_bs,
            max_pages=(max_model_len + ps - 1) // ps,
            device=self.device,
            disable=disable,
            # The reference decode reads int(seq_lens.max()): a host sync a graph cannot hold.
            eager_because=(
                f"attention backend is {attention_backend}" if attention_backend != "triton"
                else self.model.graphs_off_reason
            ),
            on_capture=on_capture,
        )
        with torch.inference_mode():
            self.graph_runner.capture()
        return self.graph_runner

    def decode_forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.graph_runner is None or not self.graph_runner.enabled:
            return self.model.forward(input_ids, meta, self.pool)
        return self.graph_runner.run(
            DecodeInputs(input_ids, meta.positions, meta.slots, meta.decode_page_table, meta.decode_seq_lens)
        )

    @torch.inference_mode()
    def run(self, decode: list[BatchEntry], extend: list[BatchEntry]) -> list[EntryTokens]:
        """One forward pass and sampling; returns what each sampled entry yields, in order."""
        input_ids, meta = self.prepare(decode, extend)
        if not extend:
            hidden = self.decode_forward(input_ids, meta)
        else:
            hidden = self.model.forward(input_ids, meta, self.pool)
            asked = prompt_rows(decode + extend)
            if asked:
                record_prompt_logprobs(self.model, hidden, asked)
        # Rows that end a sequence's known tokens produce a token; with a draft, all its rows.
        rows: list[int] = []
        plain: list[BatchEntry] = []
        drafted: list[BatchEntry] = []
        offset = 0
        for entry in decode + extend:
            offset += entry.length
            if entry.sample and not entry.draft:
                rows.append(offset - 1)
                plain.append(entry)
        offset = 0
        for entry in decode + extend:
            offset += entry.length
            if entry.draft:
                rows.extend(range(offset - entry.length, offset))
                drafted.append(entry)
        if not rows:
            return []
        if rows != list(range(hidden.shape[0])):  # a decode-only step samples every row, in order
            hidden = hidden[torch.tensor(rows, device=self.device)]
        out: list[EntryTokens] = []
        # The LM head once for every row: it reads the whole head (SmolLM2's 28M parameters,
        # ~1.9 ms a read at ~30 GB/s on the Zen 4 host), so a step with plain and drafted rows
        # pays for one read, not two.
        logits = self.model.logits(hidden)
        if plain:
            result = self.sample_rows(hidden[: len(plain)], [e.seq for e in plain], logits[: len(plain)])
            for i, entry in enumerate(plain):
                if i in result.failed:
                    out.append(EntryTokens(entry.seq, [], None, None, error=result.failed[i]))
                    continue
                out.append(
                    EntryTokens(
                        entry.seq,
                        [result.token_ids[i]],
                        None if result.logprobs is None else [result.logprobs[i]],
                        None if result.top_logprobs is None else [result.top_logprobs[i]],
                    )
                )
        if drafted:
            verified = self.verify_rows(hidden[len(plain) :], drafted, logits[len(plain) :])
            for entry, outcome in zip(drafted, verified):
                num_draft = len(entry.draft or [])
                if isinstance(outcome, BaseException):
                    out.append(EntryTokens(entry.seq, [], None, None, num_draft, error=outcome))
                else:
                    out.append(
                        EntryTokens(entry.seq, outcome.token_ids, outcome.logprobs, outcome.top_logprobs, num_draft)
                    )
        return out

    def sample_rows(self, hidden: torch.Tensor, seqs: list[Sequence], logits: torch.Tensor | None = None) -> SampleResult:
        """One token per row. Sampling is batched; when the batch raises (one request's
        grammar matcher, logit bias, ...), each row is sampled alone from fresh logits so
        only the rows that raise fail (`SampleResult.failed`). Computing the logits is part
        of the forward pass: its failure propagates. `logits`: these rows' logits when the
        caller computed them (sampling changes them in place)."""
        if logits is None:
            logits = self.model.logits(hidden)
        try:
            return sample(logits, seqs, self.grammar_masks, self.model.backend.argmax)
        except Exception:
            pass
        logits = self.model.logits(hidden)  # the batched attempt changed them in place
        rows: list[SampleResult | BaseException] = []
        for i, seq in enumerate(seqs):
            try:
                rows.append(sample(logits[i : i + 1], [seq], self.grammar_masks, self.model.backend.argmax))
            except Exception as exc:
                rows.append(exc)
        return merge_rows(rows)

    def verify_rows(
        self, hidden: torch.Tensor, entries: list[BatchEntry], logits: torch.Tensor | None = None
    ) -> list[SampleResult | BaseException]:
        """The drafted entries' tokens (their rows back to back in `hidden`), verified as one
        batch; when that raises, each entry is verified alone from fresh logits, so only a
        request whose own sampling or grammar raises fails (as `sample_rows` does).
        `logits`: these rows' logits when the caller computed them."""
        drafts = [e.draft or [] for e in entries]
        if logits is None:
            logits = self.model.logits(hidden)
        try:
            return list(verify_drafts(logits, [e.seq for e in entries], drafts, self.draft_grammar_masks,
                                      self.model.backend.argmax))
        except Exception:
            pass
        logits = self.model.logits(hidden)  # the batched attempt changed them in place
        outcomes: list[SampleResult | BaseException] = []
        start = 0
        for entry, draft in zip(entries, drafts):
            end = start + len(draft) + 1
            try:
                outcomes.extend(verify_drafts(logits[start:end], [entry.seq], [draft], self.draft_grammar_masks,
                                              self.model.backend.argmax))
            except Exception as exc:
                outcomes.append(exc)
            start = end
        return outcomes


def merge_rows(rows: list[SampleResult | BaseException]) -> SampleResult:
    """Single-row results (or the exception of a row) as one batch result."""
    failed = {i: r for i, r in enumerate(rows) if isinstance(r, BaseException)}
    ok = [r for r in rows if isinstance(r, SampleResult)]
    want_logprobs = any(r.logprobs is not None for r in ok)
    token_ids, logprobs, tops = [], [], []
    for r in rows:
        good = isinstance(r, SampleResult)
        token_ids.append(r.token_ids[0] if good else -1)
        logprobs.append(r.logprobs[0] if good and r.logprobs is not None else 0.0)
        tops.append(r.top_logprobs[0] if good and r.top_logprobs is not None else [])
    return SampleResult(token_ids, logprobs if want_logprobs else None, tops if want_logprobs else None, failed)


def run_prompt(model: DecoderModel, device: torch.device, pool: KVPool, token_ids: list[int],
               pages: list[int]) -> None:  # fmt: skip
    """Computes a prompt's KV (every token, from position 0) into `pool` at `pages`; nothing
    is sampled. fp8 KV calibration (engine/kv/fp8_calibration.py) is handed it as a callable,
    so engine/kv does not import the runner."""
    seq = SimpleNamespace(token_ids=lambda start, end: token_ids[start:end], pages=pages)
    input_ids, meta = ModelRunner(model, pool, device, None).prepare([], [BatchEntry(seq, 0, len(token_ids), False)])
    with torch.inference_mode():
        model.forward(input_ids, meta, pool)
