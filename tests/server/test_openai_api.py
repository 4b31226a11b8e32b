"""The real server with the embedded model, driven by the real `openai` SDK."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from server_process import MODEL

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens >= 1 and u.prompt_tokens > 10
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_greedy_answer_is_sensible(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4,
                                  temperature=0)
    assert r.object == "text_completion"
    (choice,) = r.choices
    assert choice.text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 4


def test_chat_stream_matches_non_stream_and_ends_with_usage(client):
    args = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                            max_tokens=5, temperature=0, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                      temperature=0).choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == whole


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 2, "stream": True,
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first  # only present when stream_options.include_usage is set


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=4, n=3, temperature=1.0, seed=7,
        messages=[{"role": "user", "content": "Say a random word."}])
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 12
    # one seed, n choices: each choice samples with its own stream, so they differ
    assert len({c.message.content for c in r.choices}) > 1


def test_n_choices_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2,
                                            temperature=1.0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert all(texts.values())


def test_seed_reproduces_sampling(client):
    args = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                top_p=0.95)
    a = client.completions.create(**args, seed=1234).choices[0].text
    b = client.completions.create(**args, seed=1234).choices[0].text
    others = {client.completions.create(**args, seed=s).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should not all sample the same text"


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Rome"]},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "is_capital"],
}


def test_json_schema_response_parses_and_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0.7, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_response_is_an_object(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0,
        messages=[{"role": "user",
                   "content": "Give me a JSON object describing a cat with its name and age."}],
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_answer_fully_matches(client):
    pattern = r"(yes|no), [0-9]{1,2} (cats|dogs)"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Do you like pets?"}],
        max_tokens=20, temperature=1.0, seed=11, extra_body={"regex": pattern},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert re.fullmatch(pattern, choice.message.content), choice.message.content


def test_regex_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="The year is", max_tokens=8,
                                  temperature=0.8, seed=5, extra_body={"regex": r" [12][0-9]{3}"})
    assert re.fullmatch(r" [12][0-9]{3}", r.choices[0].text)


LONG_SYSTEM = ("You are a support assistant for the Preheat inference engine. " * 30).strip()


def test_repeated_long_prefix_reports_cached_tokens(client):
    def ask(q: str):
        return client.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0,
            messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        ).usage

    first = ask("How do I start it?")
    second = ask("How do I stop it?")
    assert first.prompt_tokens > 200
    assert second.prompt_tokens_details.cached_tokens >= 200
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0


def test_stop_sequence_is_honoured(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                  temperature=0, stop=[","])
    assert "," not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_logit_bias_through_the_sdk(client, tokenizer):
    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    (top_id,) = tokenizer.encode(greedy.choices[0].text, add_special_tokens=False)
    # The SDK sends token ids as string keys, as OpenAI's API defines them.
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(top_id): -100})
    assert banned.choices[0].text != greedy.choices[0].text
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                            logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == tokenizer.decode([forced_id] * 3)


def test_tokenize_counts_exactly_what_a_chat_request_is_charged(client, http, tokenizer):
    r = http.post("/tokenize", json={"model": MODEL, "messages": ASK})
    assert r.status_code == 200, r.text
    body = r.json()
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0)
    assert body["count"] == len(body["tokens"]) == chat.usage.prompt_tokens
    assert body["max_model_len"] == 512

    plain = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()
    assert plain["tokens"] == tokenizer.encode("The capital of France is")


def test_detokenize_inverts_tokenize(http):
    text = "Hello, world! Ünïcödé too."
    tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}
