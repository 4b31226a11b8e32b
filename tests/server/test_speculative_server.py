"""`preheat serve --speculative-method ngram` through the real `openai` SDK: greedy answers are
the non-speculative server's, streamed chunks carry several tokens when a draft is accepted,
and /metrics counts draft and accepted tokens."""

from __future__ import annotations

import httpx
import pytest
from server_process import API_KEY, MODEL, start_server

pytestmark = pytest.mark.slow

REPEAT = [{"role": "user", "content": "Repeat exactly, twice: the red bicycle is parked by the old bakery."}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("spec-server"), "--api-key", API_KEY,
                       "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                       "--speculative-gate", "always")  # the plumbing, whatever the gate would decide
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server):
    import openai

    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def spec_metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("preheat_spec_") and "_total " in line
    }


def test_greedy_answers_match_the_plain_server_and_drafts_are_counted(spec_server, spec_client, client):
    args = dict(model=MODEL, messages=REPEAT, max_tokens=48, temperature=0)
    want = client.chat.completions.create(**args).choices[0].message.content
    got = spec_client.chat.completions.create(**args).choices[0].message.content
    assert got == want
    chunks = list(spec_client.chat.completions.create(**args, stream=True, logprobs=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # an accepted draft arrives as one chunk of several tokens (each with its logprob)
    assert max(len(c.choices[0].logprobs.content or []) for c in chunks if c.choices and c.choices[0].logprobs) > 1
    counters = spec_metrics(spec_server)
    assert counters["preheat_spec_draft_tokens_total"] > 0
    assert 0 < counters["preheat_spec_accepted_tokens_total"] <= counters["preheat_spec_draft_tokens_total"]


def test_sampled_and_structured_requests_run_with_speculation(spec_client):
    r = spec_client.chat.completions.create(model=MODEL, messages=REPEAT, max_tokens=24, temperature=0.8, seed=3)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 24
    r = spec_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2, 3"}], max_tokens=40, temperature=0,
        extra_body={"regex": r"([0-9], ){5}[0-9]"},
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and len(text) == 16 and text[-1].isdigit()
