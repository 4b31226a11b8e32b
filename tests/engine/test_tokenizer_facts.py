"""What an engine derives from its tokenizer alone (its hash, xgrammar's tokenizer info) is
kept in the weight cache (engine/model/tokenizer_facts.py): a restart reads it and must get
exactly what it would compute; a changed tokenizer file, another vocabulary size or another
xgrammar version computes it again."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

from preheat.engine.assemble import tokenizer_parts
from preheat.engine.config import EngineConfig
from preheat.engine.model import tokenizer_facts


@pytest.fixture
def model_dir(tiny_llama_dir, tmp_path_factory):
    copy = tmp_path_factory.mktemp("tokenizer-copy")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, copy / f.name)
    return copy


def parts(model_dir, cache, vocab_size=None):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer_parts(tokenizer, vocab_size or len(tokenizer), EngineConfig(), str(model_dir), cache)


def test_a_restart_reads_the_facts_a_first_start_computed(model_dir, tmp_path):
    first = parts(model_dir, tmp_path)
    kept = tokenizer_facts.read(model_dir, tmp_path, first.grammar[0].vocab_size)
    assert kept is not None and kept.tokenizer_hash == first.tokenizer_hash
    assert kept.grammar_info == first.grammar[0].tokenizer_info.serialize_json()
    second = parts(model_dir, tmp_path)
    assert second.tokenizer_hash == first.tokenizer_hash
    a, b = first.grammar[0], second.grammar[0]
    assert b.tokenizer_info.serialize_json() == a.tokenizer_info.serialize_json()
    assert (b.tokenizer_info.vocab_type, b.tokenizer_info.stop_token_ids) == (
        a.tokenizer_info.vocab_type, a.tokenizer_info.stop_token_ids)
    uncached = tokenizer_parts(AutoTokenizer.from_pretrained(model_dir), a.vocab_size, EngineConfig(), None, None)
    assert uncached.tokenizer_hash == first.tokenizer_hash


def test_a_changed_tokenizer_another_vocab_size_or_xgrammar_computes_again(model_dir, tmp_path):
    original = parts(model_dir, tmp_path)
    vocab_size = original.grammar[0].vocab_size
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size) is not None
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size + 64) is None
    place = tokenizer_facts.path(model_dir, tmp_path)
    data = json.loads(place.read_text())
    data["signature"] = [s if s[0] != "xgrammar" else ["xgrammar", "0.0.1"] for s in data["signature"]]
    place.write_text(json.dumps(data))
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size) is None
    parts(model_dir, tmp_path)  # kept again
    template = model_dir / "chat_template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    os.utime(template, ns=(1, 1))
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size) is None
    changed = parts(model_dir, tmp_path)
    assert changed.tokenizer_hash != original.tokenizer_hash  # the chat template is part of the hash
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size).tokenizer_hash == changed.tokenizer_hash


def test_an_unreadable_file_is_computed_again(model_dir, tmp_path):
    vocab_size = parts(model_dir, tmp_path).grammar[0].vocab_size
    tokenizer_facts.path(model_dir, tmp_path).write_text("{not json")
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size) is None
    assert parts(model_dir, tmp_path).tokenizer_hash.startswith("sha256:")
    assert tokenizer_facts.read(model_dir, tmp_path, vocab_size) is not None
