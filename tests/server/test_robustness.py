"""No input takes the server down (issue 13's repros, over real HTTP on a tiny model): every
field bounded and refused with an OpenAI-shaped 4xx, legal-but-degenerate values answered
sensibly, heavy requests worked off the event loop while the probes answer, a full queue a
429, and the server still serves afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_process import API_KEY, TINY
from slow_grammar import SLOW_REGEX
from test_bad_input import assert_error

from preheat.engine.request.limits import MAX_GRAMMAR_CHARS

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
    # Whatever a test sent, the server is alive and serves a normal request afterwards.
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    with httpx.Client(base_url=tiny_server.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        r = c.post(CHAT, json=GOOD)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_k": 10**22, "temperature": 0.7}, "top_k"),  # killed the engine: overflow in torch
        ({"top_k": 1e22, "temperature": 0.7}, "top_k"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # garbage tokens before
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"temperature": 1e300}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"4294967296": 1}}, "logit_bias"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "y" * 257}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids.0"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "a"}] * 1025}, "messages"),
    ],
)
def test_out_of_range_values_are_400s_naming_the_field(http, extra, param):
    assert_error(http.post(CHAT, json={**GOOD, **extra}), 400, param=param)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinite_numbers_are_refused(http, literal):
    body = json.dumps(GOOD)[:-1] + f', "temperature": {literal}}}'
    r = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param="temperature")


def test_an_integer_too_long_to_parse_is_a_400(http):
    body = json.dumps(GOOD)[:-1] + f', "seed": {"9" * 5000}}}'
    assert_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400, code="invalid_json")


def test_json_nested_too_deeply_is_a_400(http):
    body = json.dumps(GOOD)[:-1] + ', "user": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400, code="invalid_json")


def test_a_tiny_temperature_is_greedy_not_garbage(http):
    greedy = http.post(CHAT, json={**GOOD, "max_tokens": 12, "temperature": 0}).json()
    tiny = http.post(CHAT, json={**GOOD, "max_tokens": 12, "temperature": 1e-45, "seed": 5}).json()
    assert tiny["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_fifty_thousand_prompts_with_n_16_are_refused_at_once(http):
    body = {"model": TINY, "prompt": ["hello world"] * 50_000, "n": 16, "max_tokens": 1}
    err = assert_error(http.post(COMPLETIONS, json=body), 400, param="prompt")
    assert "256" in err["message"]


def test_prompts_times_n_is_bounded(http):
    body = {"model": TINY, "prompt": ["hi"] * 200, "n": 2, "max_tokens": 1}
    assert_error(http.post(COMPLETIONS, json=body), 400, param="n")


def test_the_request_prompt_token_budget(http):
    # 4 prompts of ~60 tokens x n=8: ~1900 prompt tokens > --max-request-prompt-tokens 1024.
    body = {"model": TINY, "prompt": [[7] * 60] * 4, "n": 8, "max_tokens": 1}
    assert_error(http.post(COMPLETIONS, json=body), 400, param="prompt", code="request_too_large")


def test_more_sequences_than_the_queue_holds_is_a_400_not_a_429(http):
    body = {"model": TINY, "prompt": [[7, 8]] * 11, "n": 3, "max_tokens": 1}  # 33 > 32
    assert_error(http.post(COMPLETIONS, json=body), 400, param="n", code="request_too_large")


def test_a_regex_over_the_size_limit_is_refused_before_compiling(http):
    regex = "(a|b)" * (MAX_GRAMMAR_CHARS // 5 + 1)
    assert_error(http.post(CHAT, json={**GOOD, "regex": regex}), 400, param="regex", code="grammar_too_large")


def test_a_full_queue_answers_429_with_retry_after(tiny_server, http):
    # 32 sequences: 16 run and 16 wait while the first 16 generate their 60 tokens.
    filler = {"model": TINY, "prompt": [[5, 6, 7]] * 16, "n": 2, "max_tokens": 60, "ignore_eos": True,
              "stream": True}
    with http.stream("POST", COMPLETIONS, json=filler) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # queued
        # 16 waiting + these 17 > 32
        late = {"model": TINY, "prompt": [[5, 6]] * 17, "max_tokens": 1}
        refused = http.post(COMPLETIONS, json=late)
        assert_error(refused, 429, code="queue_full")
        assert int(refused.headers["retry-after"]) >= 1
        for _ in lines:
            pass
    # Once the line drained, the same request is served.
    assert http.post(COMPLETIONS, json=late).status_code == 200


def test_probes_answer_while_heavy_requests_run(tiny_server, http):
    """A regex that compiles for far longer than the 2 s limit (stopped there), a 3.5 MB prompt to
    tokenize and a body of 50,000 prompts, all at once: /health and /ready keep answering
    while they are in progress. Asserted on order (probes answered before the heavy requests
    finished), not on a time threshold; the slowest probe is printed for the report."""
    heavy = {
        "slow regex": (CHAT, {**GOOD, "regex": SLOW_REGEX}),
        "huge prompt": (COMPLETIONS, {"model": TINY, "prompt": "word " * 700_000, "max_tokens": 1}),
        "50,000 prompts": (COMPLETIONS, {"model": TINY, "prompt": ["hello world"] * 50_000, "n": 16}),
    }
    done: dict[str, tuple[float, httpx.Response]] = {}

    def send(name: str, path: str, body: dict) -> None:
        r = httpx.post(tiny_server.url + path, json=body, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"})
        done[name] = (time.monotonic(), r)

    idle = []
    for _ in range(20):  # the same probes with nothing running, for comparison in the printout
        t0 = time.monotonic()
        httpx.get(tiny_server.url + "/health", timeout=60)
        idle.append(time.monotonic() - t0)
    threads = [threading.Thread(target=send, args=(name, *req)) for name, req in heavy.items()]
    [t.start() for t in threads]
    probes: list[tuple[float, float, str, int]] = []
    while any(t.is_alive() for t in threads):
        for path in ("/health", "/ready"):
            t0 = time.monotonic()
            status = httpx.get(tiny_server.url + path, timeout=60).status_code
            probes.append((t0, time.monotonic(), path, status))
        time.sleep(0.02)
    [t.join() for t in threads]
    regex_done, regex = done["slow regex"]
    assert_error(regex, 400, param="regex", code="grammar_compile_timeout")
    assert_error(done["huge prompt"][1], 400, param="prompt", code="request_too_large")
    assert_error(done["50,000 prompts"][1], 400, param="prompt")
    during = [p for p in probes if p[1] < regex_done]
    assert {p[2] for p in during} == {"/health", "/ready"}, probes
    assert all(p[3] == 200 for p in during), probes
    busy = sorted(p[1] - p[0] for p in during)
    print(f"/health and /ready while heavy requests ran: {len(during)} probes, median "
          f"{busy[len(busy) // 2] * 1000:.0f} ms, slowest {busy[-1] * 1000:.0f} ms; idle /health: median "
          f"{sorted(idle)[10] * 1000:.0f} ms, slowest {max(idle) * 1000:.0f} ms")
