"""The grammar compiler started ahead of the first compile (issue 27): `preheat serve` starts
the forkserver with its flags, and a worker made after that starts its child at once, so the
warmup's first compile does not pay the start. Only when the warmup compiles a grammar."""

from __future__ import annotations

import threading

import pytest
import xgrammar as xgr

from preheat.engine.sample import grammar_worker
from preheat.engine.serve.early_start import warmup_compiles_grammars
from preheat.engine.warm.warm_start import WarmStart
from preheat.engine.warm.warmup_templates import parse_templates


@pytest.fixture
def tokenizer_info(smollm_tokenizer) -> str:
    return xgr.TokenizerInfo.from_huggingface(smollm_tokenizer, vocab_size=49152).serialize_json()


def test_a_worker_made_after_prestart_has_its_child_before_any_compile(monkeypatch, tokenizer_info):
    monkeypatch.setattr(grammar_worker, "_prestarted", False)  # restored after the test
    grammar_worker.prestart()
    started = threading.Event()
    real = grammar_worker.GrammarWorker._start_quietly

    def recording(self):
        real(self)
        started.set()

    monkeypatch.setattr(grammar_worker.GrammarWorker, "_start_quietly", recording)
    worker = grammar_worker.GrammarWorker(tokenizer_info)
    try:
        assert started.wait(grammar_worker.START_TIMEOUT_S)
        child = worker._proc
        assert child is not None and child.is_alive()
        assert worker.compile("regex", "[0-9]+", timeout=60, wait=60)
        assert worker._proc is child  # the compile used the child started ahead
    finally:
        worker.close()


def test_without_prestart_a_worker_starts_its_child_on_the_first_compile(monkeypatch, tokenizer_info):
    monkeypatch.setattr(grammar_worker, "_prestarted", False)
    worker = grammar_worker.GrammarWorker(tokenizer_info)
    try:
        assert worker._proc is None
        assert worker.compile("regex", "[a-z]+", timeout=60, wait=60)
        assert worker._proc is not None
    finally:
        worker.close()


def test_the_forkserver_is_started_only_when_the_warmup_compiles_a_grammar():
    plain = parse_templates("name: p\nprompts: [hello]\n", "p.yaml")
    regex = parse_templates("name: r\nprompts: [hello]\nstructured: [{regex: 'a+'}]\n", "r.yaml")
    assert warmup_compiles_grammars(WarmStart(builtin=True))  # the built-in warmup compiles two
    assert not warmup_compiles_grammars(WarmStart(builtin=False))
    assert not warmup_compiles_grammars(WarmStart(builtin=False, templates=plain))
    assert warmup_compiles_grammars(WarmStart(builtin=False, templates=regex))
