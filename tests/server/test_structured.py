"""The grammar backend against the real SmolLM2 tokenizer: masks, termination, cache, errors."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import torch
from slow_grammar import SLOW_REGEX

from preheat.engine.sample.structured import GrammarBackend, InvalidGrammar, apply_grammar_masks

VOCAB = 49152
EOS = 2


@dataclass
class Spec:  # the shape of sampling_params.StructuredOutput, duck-typed
    kind: str
    spec: Any = None


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB)


def sample_under_grammar(backend, tokenizer, spec, seed: int, max_steps: int = 200) -> str:
    """Samples random tokens under the grammar's mask until it terminates; returns the text."""
    gen = torch.Generator().manual_seed(seed)
    matcher = backend.new_matcher(backend.compile(spec))
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, VOCAB, generator=gen)
        apply_grammar_masks(logits, [matcher])
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert matcher.accept_token(tok), "the mask let through a token the grammar rejects"
        if matcher.is_terminated():
            assert tok == EOS
            return tokenizer.decode(out)
        out.append(tok)
    pytest.fail(f"grammar did not terminate in {max_steps} steps: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(5))
def test_regex_samples_fully_match(backend, tokenizer, seed):
    pattern = r"(yes|no)-[0-9]{2}"
    text = sample_under_grammar(backend, tokenizer, Spec("regex", pattern), seed)
    assert re.fullmatch(pattern, text), text


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "size"],
}


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_samples_parse_and_validate(backend, tokenizer, seed):
    text = sample_under_grammar(backend, tokenizer, Spec("json_schema", SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_allows_only_an_object(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(Spec("json_object")))
    logits = torch.zeros(1, VOCAB)
    apply_grammar_masks(logits, [matcher])
    allowed = torch.nonzero(logits[0] > float("-inf")).flatten().tolist()
    assert allowed, "nothing allowed at the first step"
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    for tok in tokenizer.encode('{"any": [1, "x"]}', add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.is_completed() and matcher.accept_token(EOS) and matcher.is_terminated()


def test_masks_touch_only_constrained_rows(backend):
    matcher = backend.new_matcher(backend.compile(Spec("regex", "[0-9]+")))
    logits = torch.zeros(3, VOCAB)
    apply_grammar_masks(logits, [None, matcher, None])
    assert torch.all(logits[0] == 0) and torch.all(logits[2] == 0)
    assert 0 < int((logits[1] == 0).sum()) < VOCAB


def test_no_matchers_is_a_no_op():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    apply_grammar_masks(logits, [None, None])
    assert torch.equal(logits, before)


def test_terminated_matcher_allows_only_stop(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(Spec("regex", "ab")))
    for tok in tokenizer.encode("ab", add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    logits = torch.zeros(1, VOCAB)
    apply_grammar_masks(logits, [matcher])
    assert torch.nonzero(logits[0] == 0).flatten().tolist() == [EOS]
    assert not matcher.accept_token(5)


def test_rejected_token_leaves_state_unchanged(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(Spec("regex", "[0-9]{2}")))
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    assert not matcher.accept_token(letter)
    for tok in tokenizer.encode("42", add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.is_completed()


def test_repeated_schema_is_compiled_once(tokenizer):
    backend = GrammarBackend(tokenizer, VOCAB)
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    first = backend.compile(Spec("json_schema", schema))
    # Same schema, other key order, given as text: still the same cache entry.
    reordered = json.dumps({"properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                            "type": "object"})
    second = backend.compile(Spec("json_schema", reordered))
    assert second is first  # the cached object itself: nothing was compiled again
    assert (backend.cache_misses, backend.cache_hits) == (1, 1)


@pytest.mark.parametrize(
    "spec",
    [
        Spec("regex", "(unclosed"),
        Spec("regex", "a{2,1}"),
        Spec("regex", ""),
        Spec("json_schema", "not json"),
        Spec("json_schema", {"type": "no-such-type"}),
        Spec("json_schema", {"type": "object", "required": "a"}),
        Spec("json_schema", [1, 2]),
        Spec("grammar", "root ::= x"),
    ],
)
def test_invalid_grammar_is_a_value_error_with_one_line(backend, spec):
    with pytest.raises(InvalidGrammar) as info:
        backend.compile(spec)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message and "\n" not in message and ".cc:" not in message


def test_a_grammar_over_the_size_limit_is_refused_before_compiling(backend):
    from preheat.engine.request.limits import MAX_GRAMMAR_CHARS

    kills = backend.worker.kills
    with pytest.raises(InvalidGrammar) as info:
        backend.compile(Spec("regex", "a" * (MAX_GRAMMAR_CHARS + 1)))
    assert info.value.code == "grammar_too_large"
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(InvalidGrammar) as info:
        backend.compile(Spec("json_schema", schema))
    assert info.value.code == "grammar_too_large" and backend.worker.kills == kills


def test_a_compile_past_the_time_limit_is_stopped_and_the_next_one_works(tokenizer):
    """SLOW_REGEX is short but compiles for far longer than the limit; xgrammar cannot be
    interrupted, so the compile runs in a child process that is killed at the limit."""
    backend = GrammarBackend(tokenizer, VOCAB, compile_timeout=1.0)
    backend.compile(Spec("regex", "[0-9]+"))  # the child is up before the clock matters
    with pytest.raises(InvalidGrammar) as info:
        backend.compile(Spec("regex", SLOW_REGEX))
    assert info.value.code == "grammar_compile_timeout" and backend.worker.kills == 1
    matcher = backend.new_matcher(backend.compile(Spec("regex", "(yes|no)")))  # a fresh child
    for tok in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.is_completed()
    backend.close()
