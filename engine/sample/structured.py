"""Structured output: compile regex / JSON-schema / structural-tag grammars and mask logits.

xgrammar does the work (JSON-schema compile in milliseconds, mask fill in ~0.1 ms). This file
owns the seam described in docs/engine-internals.md:

    backend = GrammarBackend(tokenizer, vocab_size)
    compiled = backend.compile(StructuredOutput)     # cached by (kind, spec)
    matcher = backend.new_matcher(compiled)
    apply_grammar_masks(logits, matchers)            # in place, -inf where not allowed

A grammar longer than MAX_GRAMMAR_CHARS is refused before compiling; compiling runs in a
child process (engine/sample/grammar_worker.py) that is killed when it takes longer than the
compile timeout (`--grammar-compile-timeout`), so neither size nor a pathological regex can
stall the engine. Both refusals are `InvalidGrammar`s with their own code.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xgrammar as xgr

from preheat.engine.request.errors import QueueFull, RequestRejected
from preheat.engine.request.limits import MAX_GRAMMAR_CHARS
from preheat.engine.sample import grammar_worker

log = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0

KINDS = ("regex", "json_schema", "json_object", "structural_tag")

# A JSON object with any keys; strict mode in xgrammar only closes *declared* objects.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredSpec(Protocol):
    """What the backend reads from `sampling_params.StructuredOutput`."""

    kind: str
    spec: Any


class InvalidGrammar(RequestRejected):
    """The regex or JSON schema cannot be used; the message says why, in one line. `code` is
    "invalid_grammar" (does not compile), "grammar_too_large" or "grammar_compile_timeout".
    `param` is left to the caller, who knows which request field carried the grammar."""

    def __init__(self, message: str, code: str = "invalid_grammar") -> None:
        super().__init__(code, None, message)
        self.kind: str | None = None  # the structured output kind that was refused


@dataclass(frozen=True)
class CompiledGrammar:
    kind: str
    key: str  # canonical spec text, the cache key together with kind
    grammar: xgr.CompiledGrammar


class Matcher:
    """Per-request grammar state: which tokens may come next, and whether the grammar is done."""

    def __init__(self, compiled: CompiledGrammar, stop_token_ids: Sequence[int]) -> None:
        self.compiled = compiled
        self._m = xgr.GrammarMatcher(compiled.grammar)
        self._stop_token_ids = list(stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        """Advances the grammar; False (state unchanged) when the token is not allowed."""
        if self._m.is_terminated():
            return False
        return bool(self._m.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once the grammar is complete *and* a stop token was accepted."""
        return bool(self._m.is_terminated())

    def is_completed(self) -> bool:
        """True when the text so far is a full match (a stop token may come next)."""
        return bool(self._m.is_completed())

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted tokens (speculative decoding looks ahead
        through a draft, then returns to the verified state)."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():
            # xgrammar refuses to fill after termination; only a stop token makes sense now.
            bitmask[row].zero_()
            for tok in self._stop_token_ids:
                bitmask[row, tok // 32] |= 1 << (tok % 32)
            return
        self._m.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """Compiles grammars for one tokenizer; thread-safe; keeps an LRU of compiled grammars."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_size: int = 256,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S, tokenizer_info_json: str | None = None,
    ) -> None:
        """`tokenizer_info_json`: xgrammar's serialized tokenizer info for this tokenizer and
        vocab_size, as `self.tokenizer_info_json` holds it (a restart reads it from the weight cache,
        engine/model/tokenizer_facts.py); None: derived from the tokenizer."""
        # vocab_size is the model's logits width, which may exceed the tokenizer's (padding);
        # xgrammar then treats the extra ids as never allowed under a grammar.
        self.vocab_size = int(vocab_size)
        if tokenizer_info_json is not None:
            self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        else:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            tokenizer_info_json = self.tokenizer_info.serialize_json()
        self.tokenizer_info_json = tokenizer_info_json
        self.compile_timeout = compile_timeout
        self.worker = grammar_worker.GrammarWorker(tokenizer_info_json)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer_info.stop_token_ids)

    def compile(self, structured: StructuredSpec) -> CompiledGrammar:
        try:
            return self._cached_compile(structured)
        except InvalidGrammar as e:
            e.kind = getattr(structured, "kind", None)  # the server names the field from it
            raise

    def _cached_compile(self, structured: StructuredSpec) -> CompiledGrammar:
        kind, key = _canonical(structured)
        with self._lock:
            hit = self._cache.get((kind, key))
            if hit is not None:
                self._cache.move_to_end((kind, key))
                self.cache_hits += 1
                return hit
        grammar = self._compile(kind, key)
        compiled = CompiledGrammar(kind, key, grammar)
        with self._lock:
            self.cache_misses += 1
            self._cache[(kind, key)] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, compiled: CompiledGrammar) -> Matcher:
        return Matcher(compiled, self.stop_token_ids)

    def close(self) -> None:
        self.worker.close()

    def _compile(self, kind: str, key: str) -> xgr.CompiledGrammar:
        """Compiles in the worker process (see engine/sample/grammar_worker.py for why)."""
        timeout = self.compile_timeout
        try:
            serialized = self.worker.compile(kind, key, timeout=timeout, wait=timeout)
        except grammar_worker.CompileError as e:
            raise InvalidGrammar(f"invalid {kind}: {_one_line(e)}") from None
        except grammar_worker.CompileTimeout:
            log.warning("grammar compile of a %s of %d characters passed %.1fs; refused", kind, len(key), timeout)
            raise InvalidGrammar(
                f"the {kind} took longer than {timeout:g}s to compile (--grammar-compile-timeout); "
                "simplify it (large bounded repetitions such as .{0,1000} are costly)",
                code="grammar_compile_timeout",
            ) from None
        except grammar_worker.WorkerBusy as e:
            raise QueueFull("grammar_compiler_busy", f"structured output: {e}; try again", retry_after=timeout) from None
        return xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)


def _canonical(structured: StructuredSpec) -> tuple[str, str]:
    kind = getattr(structured, "kind", None)
    spec = getattr(structured, "spec", None)
    if kind not in KINDS:
        raise InvalidGrammar(f"unknown structured output kind {kind!r}; use one of {KINDS}")
    if kind == "json_object":
        return kind, _ANY_OBJECT_SCHEMA
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidGrammar("invalid regex: must be a non-empty string")
        _check_size(kind, spec)
        return kind, spec
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidGrammar(f"invalid {kind}: not JSON ({e})") from None
    if kind == "structural_tag":
        if not isinstance(spec, dict):
            raise InvalidGrammar("invalid structural_tag: must be a JSON object")
        # Key order is kept: it is the order the grammar makes the model write properties in.
        # Equal tools build equal tags (tool_calling.tool_grammar), so the cache still hits.
        try:
            key = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidGrammar(f"invalid structural_tag: {_one_line(e)}") from None
        _check_size(kind, key)  # tools' schemas are bounded like a response_format's
        return kind, key
    if not isinstance(spec, (dict, bool)):
        raise InvalidGrammar("invalid json_schema: must be a JSON object")
    # Key order and spacing must not split the cache: the same schema costs one compile.
    try:
        key = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidGrammar(f"invalid json_schema: {_one_line(e)}") from None
    _check_size(kind, key)  # before the schema check, which is Python and scales with size
    _check_schema(spec)
    return kind, key


def _check_size(kind: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidGrammar(
            f"the {kind} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted",
            code="grammar_too_large",
        )


def _check_schema(schema: Any) -> None:
    """Catches schemas xgrammar would silently accept but that are not valid JSON Schema."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidGrammar(f"invalid json_schema: {_one_line(e.message)}") from None
    except RecursionError:
        raise InvalidGrammar("invalid json_schema: nested too deeply") from None


def _one_line(err: object) -> str:
    text = str(err).strip()
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:NN: "; keep only the reason.
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return " ".join(text.split())[:500]


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Sets logits[i, t] = -inf for every token t the i-th grammar forbids; rows with None
    are left alone. logits is [B, V] on any device; the mask is filled on the CPU."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)
    for i in rows:
        matchers[i].fill_bitmask(bitmask, i)  # type: ignore[union-attr]
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)


def apply_draft_grammar_masks(
    logits: torch.Tensor, groups: Sequence[tuple[int, Matcher | None, Sequence[int]]]
) -> None:
    """Grammar masks for speculative verification, in place. Each group is (first row,
    matcher, draft): rows first .. first + len(draft) hold the positions after the draft's
    first 0, 1, ... tokens, so row first + i is masked with the grammar advanced through
    draft[:i]. The matcher is rolled back to where it was: the engine advances it through
    the tokens actually accepted. A draft token the grammar refuses is masked out at its own
    row, so it is rejected there and the rows after it are never read (they stay unmasked)."""
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    rows: list[int] = []
    for first, matcher, draft in groups:
        if matcher is None:
            continue
        advanced = 0
        try:
            for i in range(len(draft) + 1):
                matcher.fill_bitmask(bitmask, first + i)
                rows.append(first + i)
                if i == len(draft) or not matcher.accept_token(draft[i]):
                    break
                advanced += 1
        finally:  # also when it raises: the runner then verifies each request alone
            matcher.rollback(advanced)
    if not rows:
        return
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
