"""Each bad request gets an OpenAI-shaped 4xx error, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from server_process import API_KEY, MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture
def then_serves(http):
    """Checks, after the test, that a valid request on the same server still succeeds."""
    yield
    r = http.post(CHAT, json=GOOD_CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("then_serves")]


def test_malformed_json(http):
    r = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_body_that_is_not_an_object(http):
    assert_error(http.post(CHAT, json=[1, 2]), 400, code="invalid_json")


def test_missing_model(http):
    body = {k: v for k, v in GOOD_CHAT.items() if k != "model"}
    assert_error(http.post(CHAT, json=body), 400, param="model")


def test_unknown_model(http):
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "model": "gpt-4o"}), 404,
                       param="model", code="model_not_found")
    assert "gpt-4o" in err["message"]


def test_empty_messages(http):
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "messages": []}), 400, param="messages")


def test_message_with_unknown_role(http):
    r = http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]})
    assert_error(r, 400)


def test_prompt_longer_than_the_context(http):
    long_text = "word " * 2000  # the test server's context is 512 tokens
    r = http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "user", "content": long_text}]})
    err = assert_error(r, 400, param="messages", code="context_length_exceeded")
    assert "512" in err["message"]


def test_completion_prompt_longer_than_the_context(http):
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": [5] * 600, "max_tokens": 1})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")


@pytest.mark.parametrize("value", [0, -3])
def test_max_tokens_not_positive(http, value):
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "max_tokens": value}), 400, param="max_tokens")


def test_max_completion_tokens_not_positive(http):
    r = http.post(CHAT, json={**GOOD_CHAT, "max_completion_tokens": 0})
    assert_error(r, 400, param="max_completion_tokens")


def test_max_tokens_too_large(http):
    r = http.post(CHAT, json={**GOOD_CHAT, "max_tokens": 100_000})
    assert_error(r, 400, param="max_tokens", code="context_length_exceeded")


def test_negative_temperature(http):
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "temperature": -0.5}), 400, param="temperature")


def test_top_p_out_of_range(http):
    assert_error(http.post(COMPLETIONS, json={"model": MODEL, "prompt": "a", "top_p": 1.5}),
                 400, param="top_p")


def test_invalid_regex(http):
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "regex": "(unclosed"}), 400,
                       param="regex", code="invalid_grammar")
    assert "\n" not in err["message"]


def test_invalid_json_schema(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    assert_error(http.post(CHAT, json={**GOOD_CHAT, "response_format": fmt}), 400,
                 param="response_format", code="invalid_grammar")


def test_json_schema_format_without_schema(http):
    r = http.post(CHAT, json={**GOOD_CHAT, "response_format": {"type": "json_schema"}})
    assert_error(r, 400, param="response_format")


def test_non_utf8_body(http):
    body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    r = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_encoding")


def test_oversized_body(http):
    big = "x" * (5 * 1024 * 1024)  # the default limit is 4 MiB
    r = http.post(CHAT, json={**GOOD_CHAT, "messages": [{"role": "user", "content": big}]})
    assert_error(r, 413, code="body_too_large")


def test_oversized_chunked_body_without_length(http):
    def chunks():
        for _ in range(80):
            yield b"x" * 65536  # 5 MiB in all, with no Content-Length header

    r = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="body_too_large")


@pytest.mark.parametrize(
    "bias, fragment",
    [({"not-a-token": 5}, "not a token id"), ({"17": 250}, "less than or equal to 100"), ({"99999999": 1}, "vocabulary")],
)
def test_bad_logit_bias(http, bias, fragment):
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "logit_bias": bias}), 400)
    assert fragment in err["message"]


def test_the_deprecated_functions_form_is_refused_rather_than_silently_ignored(http):
    fn = {"name": "lookup_order", "parameters": {"type": "object"}}
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "functions": [fn]}), 400, param="functions")
    assert "send tools" in err["message"]
    # tools themselves are served (tests/server/test_tools_api.py); "none" is a plain chat.
    tool = {"type": "function", "function": fn}
    r = http.post(CHAT, json={**GOOD_CHAT, "tools": [tool], "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


def test_a_tool_grammar_xgrammar_cannot_build_is_a_400_naming_tools(http):
    # Passes the meta-schema, but its reference leads nowhere.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    err = assert_error(http.post(CHAT, json={**GOOD_CHAT, "tools": [tool], "tool_choice": "required"}), 400,
                       param="tools", code="invalid_grammar")
    assert "structural_tag" in err["message"]


@pytest.mark.parametrize("extra, param", [({"best_of": 3}, "best_of"), ({"suffix": " end."}, "suffix")])
def test_completion_options_we_do_not_implement_are_refused(http, extra, param):
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "a", "max_tokens": 1, **extra})
    assert param in assert_error(r, 400)["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenizer_requests(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param=param)


def test_out_of_vocabulary_token_ids(http):
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": [1, 10**9], "max_tokens": 1})
    assert_error(r, 400, param="prompt")


def test_missing_api_key(server):
    r = httpx.post(server.url + CHAT, json=GOOD_CHAT)
    assert_error(r, 401, code="invalid_api_key")


def test_wrong_api_key(server):
    r = httpx.post(server.url + CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer nope"})
    assert_error(r, 401, code="invalid_api_key")


def test_wrong_api_key_through_the_sdk(server):
    import openai

    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(**GOOD_CHAT)
    assert info.value.status_code == 401


def test_probes_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert API_KEY  # the server under test does require a key for the API


def test_unknown_path_is_an_openai_error(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_wrong_method(http):
    assert_error(http.get(CHAT), 405)


# The operator's side of the contract (issue 13 point 5): with --api-key set (as
# spec.engine.apiKeySecretRef does), the kubelet's probes and the operator's /metrics scrape
# need no key, and every other client route does. /admin/* is not a client route at all:
# without --peer-secret-file it does not exist, whatever the key (tests/server/test_http_security.py).
OPEN_ROUTES = ["/health", "/ready", "/metrics"]
KEYED_ROUTES = [("GET", "/v1/models"), ("POST", CHAT), ("POST", COMPLETIONS),
                ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/not-a-route")]


def test_probes_and_metrics_need_no_key_the_rest_does(server):
    for path in OPEN_ROUTES:
        assert httpx.get(server.url + path).status_code == 200, path
    for method, path in KEYED_ROUTES:
        r = httpx.request(method, server.url + path, json={})
        assert_error(r, 401, code="invalid_api_key")


def test_admin_is_off_without_a_peer_secret_whatever_the_client_key(server):
    """The real server runs with --api-key and no --peer-secret-file: the hot-prefix
    export (every client's recent conversations) is not there for anyone, least of all
    for a client holding the API key."""
    for method, path in (("POST", "/admin/snapshot"), ("GET", "/admin/snapshot/latest"),
                         ("GET", "/admin/snapshot/latest?max_age=0")):
        for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}):
            assert_error(httpx.request(method, server.url + path, headers=headers), 404)
