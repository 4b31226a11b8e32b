"""Fuzzed, not only enumerated: schemathesis reads the server's own /openapi.json and drives
every operation with generated bodies, valid ones and ones that break the schema. No answer
may be a 5xx (a stream's error event counts), /health stays 200 throughout, and a normal
request succeeds afterwards. Runs against the tiny-model server (conftest.tiny_server), so
a generated request that asks for the whole context still takes milliseconds.

CI-sized: a fixed number of examples with a fixed seed (derandomize), so every run sends the
same bodies and a failure reproduces."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from server_process import API_KEY, TINY

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 120


def test_generated_bodies_never_get_a_5xx_and_the_server_serves_on(tiny_server):
    schema = schemathesis.openapi.from_url(tiny_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize",
                  "GET /health", "GET /ready", "GET /v1/models", "POST /admin/snapshot"):
        assert route in labels, labels
    cases = st.one_of(*(op.as_strategy(generation_mode=mode) for op in operations
                        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)))
    auth = {"Authorization": f"Bearer {API_KEY}"}
    seen: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases, served_model=st.booleans())
    def check(case, served_model: bool) -> None:
        if isinstance(case.body, dict) and served_model:
            case.body["model"] = TINY  # past the model check, into the engine, half the time
        response = case.call(base_url=tiny_server.url, headers=auth, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.as_curl_command()}\n-> {response.status_code} {response.text[:500]}"
        assert '"type":"internal_error"' not in response.text, case.as_curl_command()
        assert httpx.get(tiny_server.url + "/health", timeout=30).status_code == 200

    check()
    print("statuses:", dict(sorted(seen.items())))
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if 400 <= s < 500) > 0  # both kinds ran
    r = httpx.post(tiny_server.url + "/v1/chat/completions", headers=auth, timeout=120,
                   json={"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
