"""SGLang's frontend language, unmodified, against a real `preheat serve`.

The real `sglang` package (frontend only) runs the programs of tests/server/sglang_programs.py
once, in a process of its own, against a server started for this module without an API key
(the seed article's programs connect to a bare URL). Each test checks one program's result.
Content is asserted only where decoding is greedy (temperature 0).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import start_server

PROGRAMS = Path(__file__).with_name("sglang_programs.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sglang")
    srv = start_server(tmp)
    try:
        out = tmp / "results.json"
        run = subprocess.run([sys.executable, str(PROGRAMS), srv.url, str(out)], capture_output=True,
                             text=True, timeout=540)
        assert run.returncode == 0, f"programs failed:\n{run.stdout}\n{run.stderr}\n{srv.log()[-4000:]}"
        return json.loads(out.read_text())
    finally:
        srv.stop()


def test_runtime_endpoint_reads_model_and_server_info(results):
    info = results["model_info"]
    assert info["model_path"] and info["is_generation"] is True
    assert results["server_info_version"]


def test_gen_with_a_system_prompt_stops_at_the_stop_string(results):
    r = results["arithmetic"]
    assert "4" in r["answer"] and "\n" not in r["answer"]
    meta = r["meta"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] > 0 and "cached_tokens" in meta


def test_gen_honours_max_tokens(results):
    meta = results["limited"]["meta"]
    assert meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}


def test_gen_stop_string_is_trimmed(results):
    r = results["stop"]
    assert "." not in r["sentence"] and r["sentence"]
    assert r["meta"]["finish_reason"] == {"type": "stop", "matched": "."}


def test_select_scores_choices_with_prompt_logprobs(results):
    r = results["capital"]
    assert r["city"] == " Paris"
    scores = r["meta"]["normalized_prompt_logprobs"]
    assert len(scores) == 3 and scores[0] == max(scores)
    for choice, entries in zip([" Paris", " London", " Berlin"], r["meta"]["input_token_logprobs"]):
        assert entries[0][0] is None  # the first position asked for has no logprob, as in SGLang
        assert entries[-1][2] == choice and entries[-1][0] < 0


def test_gen_regex_and_json_schema(results):
    assert re.fullmatch(r"[0-9]{3}", results["three_digits"])
    person = json.loads(results["person"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


def test_fork_runs_both_branches(results):
    text = results["fork"]["text"]
    assert text.startswith("Here are two fruits:\n1.") and "\n2." in text


def test_multi_turn_conversation(results):
    r = results["conversation"]
    assert r["roles"] == ["system", "user", "assistant", "user", "assistant"]
    assert r["first"] and r["second"]


def test_run_batch(results):
    answers = results["batch"]
    assert len(answers) == 3 and all(answers)
    assert "4" in answers[0] and "6" in answers[1]


def test_streaming_yields_the_answer_piece_by_piece(results):
    r = results["stream"]
    assert len(r["chunks"]) > 1
    assert "".join(r["chunks"]) == r["final"] and r["final"]


def test_second_run_of_a_program_reuses_its_prefix(results):
    first, second = results["prefix_reuse"]
    assert first["cached_tokens"] < 16  # after /flush_cache: nothing of the system prompt
    assert second["cached_tokens"] >= 64  # its system prompt, from the prefix cache
    assert second["prompt_tokens"] == first["prompt_tokens"]


def test_seed_article_warmup_programs(results):
    warm = results["seed_warmup"]
    assert warm["meta"]["completion_tokens"] <= 8 and warm["meta"]["finish_reason"]["type"] in ("stop", "length")
    out = results["seed_json"]
    text, reason = out["json_output"], out["meta"]["finish_reason"]["type"]
    assert text.startswith("{")
    if reason == "stop":  # the grammar ended it: the whole regex matched
        assert re.fullmatch(r'\{.*?"name".*?\}', text, re.DOTALL)
    else:  # max_tokens=128 cut it: what there is can still become a match
        assert reason == "length" and out["meta"]["completion_tokens"] == 128
