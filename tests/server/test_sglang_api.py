"""SGLang's native routes over raw HTTP on the shared servers: the answers' shapes (checked
against SGLang's own field meanings), refusals by name, auth, bounds, backpressure, metrics,
and the prefix cache as /flush_cache and meta_info.cached_tokens show it."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import API_KEY, TINY
from test_bad_input import assert_error

GREEDY = {"max_new_tokens": 4, "temperature": 0}


@pytest.fixture
def tiny_http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_generate_needs_the_api_key_health_generate_does_not(server):
    assert httpx.post(server.url + "/generate", json={"text": "Hi"}, timeout=30).status_code == 401
    assert httpx.get(server.url + "/get_model_info", timeout=30).status_code == 401
    assert httpx.get(server.url + "/server_info", timeout=30).status_code == 401
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 401
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200


def test_one_prompt_is_one_object_with_meta_info(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["text"], str) and len(body["output_ids"]) == 4
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0
    assert meta["id"] and meta["e2e_latency"] >= 0


def test_a_batch_with_n_answers_prompt_major_with_the_callers_ids(http, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    r = http.post("/generate", json={"input_ids": [ids, ids[:2]], "rid": ["a", "b"],
                                     "sampling_params": {**GREEDY, "n": 2}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b-0", "b-1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(ids), len(ids), 2, 2]
    assert out[0]["text"] == out[1]["text"]  # greedy: both samples agree


def test_max_new_tokens_zero_computes_the_prompt_only(http):
    r = http.post("/generate", json={"text": "Remember this.", "sampling_params": {"max_new_tokens": 0}})
    body = r.json()
    assert body["text"] == "" and body["output_ids"] == []
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_logprobs_are_shaped_as_sglang_and_agree_between_prompt_and_output(http, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True})
    meta = r.json()["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inputs] == prompt and inputs[0][0] is None
    assert all(e[0] <= 0 for e in inputs[1:]) and all(isinstance(e[2], str) for e in inputs)
    assert len(outputs) == 2 and [e[1] for e in outputs] == r.json()["output_ids"]
    assert meta["input_top_logprobs"][0] is None and all(len(t) == 2 for t in meta["input_top_logprobs"][1:])
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    # Greedy: the chosen token is the top one, and scoring the prompt plus that token gives it
    # the same logprob (prefill vs decode numerics) at its position.
    first = outputs[0]
    assert meta["output_top_logprobs"][0][0][1] == first[1]
    again = http.post("/generate", json={"input_ids": prompt + [first[1]], "sampling_params": {"max_new_tokens": 0},
                                         "return_logprob": True, "logprob_start_len": len(prompt) - 1}).json()
    scored = again["meta_info"]["input_token_logprobs"]
    assert scored[-1][1] == first[1] and scored[-1][0] == pytest.approx(first[0], abs=1e-3)
    assert scored[-1][2] is None  # return_text_in_logprobs was not asked


def test_logprob_start_len_past_the_prompt_is_refused(http):
    r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4})
    assert_error(r, 400, param="logprob_start_len")


@pytest.mark.parametrize("body, param", [
    ({"text": "Hi", "image_data": "a.png"}, "image_data"),
    ({"text": "Hi", "lora_path": "x"}, "lora_path"),
    ({"text": "Hi", "session_params": {"id": "s"}}, "session_params"),
    ({"text": "Hi", "no_such_field": 1}, "no_such_field"),
    ({"text": "Hi", "sampling_params": {"ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
    ({"text": "Hi", "sampling_params": {"min_new_tokens": 3}}, "sampling_params.min_new_tokens"),
    ({"text": "Hi", "sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),
    ({"text": "Hi", "sampling_params": {"skip_special_tokens": False}}, "sampling_params.skip_special_tokens"),
    ({"text": "Hi", "sampling_params": {"stream_interval": 4}}, "sampling_params.stream_interval"),
])
def test_a_field_preheat_cannot_honour_is_refused_by_name(http, body, param):
    assert_error(http.post("/generate", json=body), 400, param=param, code="unsupported_parameter")


def test_fields_that_ask_for_nothing_are_accepted(http):
    body = {"text": "Hi", "image_data": None, "lora_path": None, "log_metrics": True,
            "sampling_params": {**GREEDY, "min_new_tokens": 0, "stop_regex": [], "skip_special_tokens": True,
                                "spaces_between_special_tokens": True, "stop_token_ids": [], "ebnf": None}}
    assert http.post("/generate", json=body).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"text": "Hi", "sampling_params": {"temperature": 1000}}, "sampling_params.temperature"),
    ({"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "Hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "Hi", "sampling_params": {"n": 1000}}, "sampling_params.n"),
    ({"text": "Hi", "return_logprob": True, "top_logprobs_num": 1000}, "top_logprobs_num"),
    ({"text": "Hi", "input_ids": [1, 2]}, "text"),
    ({"text": ""}, "text"),
    ({"text": "Hi", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "sampling_params.regex"),
    ({"text": "Hi", "sampling_params": {"regex": "(unclosed"}}, "sampling_params.regex"),
    ({"text": "Hi", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ({"text": "Hi " * 600}, "text"),  # longer than the context (512)
])
def test_bad_values_are_400s_naming_their_field(http, body, param):
    assert_error(http.post("/generate", json=body), 400, param=param)


def test_stream_events_carry_the_cumulative_text_and_the_index_in_a_batch(http):
    body = {"text": ["Once upon a time", "The sea"], "sampling_params": GREEDY, "stream": True}
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        texts = [c["text"] for c in mine]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])


def test_flush_cache_empties_the_prefix_cache(http):
    prompt = "A long enough prompt to fill a few pages of the KV cache. " * 4
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    http.post("/generate", json=body)
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] >= 32
    r = http.post("/flush_cache")
    assert r.status_code == 200 and "flushed" in r.text
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


def test_model_and_server_info(http):
    info = http.get("/get_model_info").json()
    assert info["model_path"] and info["is_generation"] is True and info["model_type"] == "llama"
    server_info = http.get("/get_server_info").json()
    assert server_info["version"] and set(server_info) == set(http.get("/server_info").json())
    assert server_info["context_length"] == 512 and server_info["max_running_requests"] == 16
    assert "api_key" not in server_info and server_info["internal_states"]


def test_generate_is_in_the_openapi_document(http):
    doc = http.get("/openapi.json").json()
    assert "/generate" in doc["paths"] and "GenerateRequest" in doc["components"]["schemas"]


def test_a_full_queue_answers_429_and_counts_it(tiny_server, tiny_http):
    # 32 sequences: 16 run and 16 wait while the first 16 generate their 60 tokens.
    filler = {"input_ids": [[5, 6, 7]] * 16, "stream": True,
              "sampling_params": {"n": 2, "max_new_tokens": 60, "ignore_eos": True}}
    before = _errors(tiny_server, "429")
    with tiny_http.stream("POST", "/generate", json=filler) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        late = {"input_ids": [[5, 6]] * 17, "sampling_params": {"max_new_tokens": 1}}
        refused = tiny_http.post("/generate", json=late)
        assert_error(refused, 429, code="queue_full")
        assert int(refused.headers["retry-after"]) >= 1
        for _ in lines:
            pass
    assert _errors(tiny_server, "429") == before + 1
    assert tiny_http.post("/generate", json=late).status_code == 200


def _errors(server, status: str) -> float:
    for line in server.metrics().splitlines():
        if line.startswith("preheat_request_errors_total{") and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_requests_show_in_the_engine_metrics(server, http):
    def finished() -> float:
        total = 0.0
        for line in server.metrics().splitlines():
            if line.startswith("preheat_requests_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    before = finished()
    http.post("/generate", json={"text": ["a", "b"], "sampling_params": GREEDY})
    assert finished() == before + 2


def test_tiny_model_name_is_not_needed(tiny_http):
    # /generate has no model field: SGLang serves one model per server.
    assert tiny_http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
                          ).status_code == 200
    assert TINY  # the tiny server's served name, unused by this API
