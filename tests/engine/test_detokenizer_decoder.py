"""The incremental detokenizer decodes through the Rust tokenizer directly where that is
exactly what `tokenizer.decode(ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)` runs, and through `decode` itself wherever a tokenizer
class changes what decoding does."""

from __future__ import annotations

import random

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from preheat.engine.request.detokenizer import IncrementalDetokenizer, plain_decoder


def reference(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_the_embedded_tokenizer_decodes_what_its_decode_gives(smollm_tokenizer):
    decode = plain_decoder(smollm_tokenizer)
    assert decode.__closure__ is not None  # the direct path: it closes over the Rust tokenizer
    rng = random.Random(0)
    specials = smollm_tokenizer.all_special_ids
    for _ in range(2000):
        ids = [rng.randrange(len(smollm_tokenizer)) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert decode(ids) == reference(smollm_tokenizer, ids), ids


@settings(max_examples=30, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), min_size=1, max_size=40))
def test_streamed_text_is_the_whole_decode(smollm_tokenizer, text):
    """Token by token (multi-byte characters split across tokens included), the streamed text
    is the decode of all the ids."""
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assume(reference(smollm_tokenizer, ids) == text)  # text the vocabulary writes back as it was
    detok = IncrementalDetokenizer(smollm_tokenizer, [])
    for token in ids:
        detok.add(token)
    assert detok.text == reference(smollm_tokenizer, ids)


def test_a_tokenizer_class_with_its_own_decode_is_asked_itself(smollm_tokenizer):
    class Shouting(type(smollm_tokenizer)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(smollm_tokenizer.__dict__)
    ids = smollm_tokenizer.encode("hello world", add_special_tokens=False)
    assert plain_decoder(shouting)(ids) == "HELLO WORLD"
    assert plain_decoder(smollm_tokenizer)(ids) == "hello world"
