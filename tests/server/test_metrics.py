"""/metrics is valid Prometheus text and its counters move as requests run."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL

pytestmark = pytest.mark.slow

REQUIRED = [
    "preheat_prompt_tokens", "preheat_generation_tokens", "preheat_prefix_cache_hit_tokens",
    "preheat_cache_hit_rate", "preheat_time_to_first_token_seconds",
    "preheat_time_per_output_token_seconds", "preheat_e2e_request_latency_seconds",
    "preheat_num_requests_running", "preheat_num_requests_waiting",
    "preheat_kv_cache_usage_ratio", "preheat_ready",
    "preheat_num_preemptions", "preheat_prefill_deferred",
    "preheat_spec_draft_tokens", "preheat_spec_accepted_tokens",
    # registered for the warm-start code
    "preheat_cuda_graph_capture_seconds", "preheat_warmup_seconds", "preheat_warmup_requests",
    "preheat_snapshot_restored_tokens", "preheat_snapshot_restore_seconds",
    "preheat_snapshot_saved_tokens", "preheat_snapshot_rejected", "preheat_kv_cache_capacity_tokens",
    # what the operator sizes spec.snapshot.size with (issue 31)
    "preheat_kv_cache_bytes_per_token", "preheat_snapshot_max_tokens",
    "preheat_model_weight_cache_bytes",
    # vLLM's names, for the Gateway API Inference Extension and KEDA recipes
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
]


def scrape(url: str) -> dict[str, float]:
    """Every sample as {name{labels}: value}; parsing fails loudly on malformed text."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    families = list(text_string_to_metric_families(r.text))
    for fam in families:
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    samples["__families__"] = {f.name for f in families}  # type: ignore[assignment]
    return samples


def test_all_metric_names_are_exposed(server):
    families = scrape(server.url)["__families__"]
    missing = [name for name in REQUIRED if name not in families]
    assert not missing


def test_ready_gauge_is_one_when_ready(server):
    m = scrape(server.url)
    assert m["preheat_ready"] == 1
    assert m["preheat_phase{phase=ready}"] == 1 and m["preheat_phase{phase=loading}"] == 0


def test_counters_move_with_requests(server, client):
    before = scrape(server.url)
    prompt = "Count: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"
    for _ in range(2):  # the second run finds the first's prompt in the prefix cache
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    after = scrape(server.url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("preheat_prompt_tokens_total") >= 2 * 16
    assert delta("preheat_generation_tokens_total") >= 2
    assert delta("preheat_prefix_cache_hit_tokens_total") >= 16
    assert delta("preheat_time_to_first_token_seconds_count") == 2
    assert delta("preheat_e2e_request_latency_seconds_count") == 2
    assert delta("preheat_time_per_output_token_seconds_count") >= 1
    assert delta("preheat_requests_total{finish_reason=length}") == 2
    assert 0 < after["preheat_cache_hit_rate"] <= 1
    assert 0 <= after["preheat_kv_cache_usage_ratio"] <= 1
    for ours, vllm in (("preheat_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
                       ("preheat_num_requests_running", "vllm:num_requests_running"),
                       ("preheat_num_requests_waiting", "vllm:num_requests_waiting")):
        assert after[vllm] == after[ours]


def test_errors_are_counted(server, http):
    before = scrape(server.url).get("preheat_request_errors_total{status=404}", 0.0)
    http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    after = scrape(server.url)["preheat_request_errors_total{status=404}"]
    assert after == before + 1


def test_scheduler_totals_become_counters_that_only_count_increases():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from preheat.engine.metrics import Metrics

    registry = CollectorRegistry()
    m = Metrics(registry)
    for preempted, deferred in [(0, 0), (2, 3), (2, 3), (5, 4)]:
        m.record_scheduler(SimpleNamespace(preemptions_total=preempted, deferred_total=deferred))
    assert registry.get_sample_value("preheat_num_preemptions_total") == 5
    assert registry.get_sample_value("preheat_prefill_deferred_total") == 4


def test_speculative_totals_become_the_spec_counters():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from preheat.engine.metrics import Metrics

    registry = CollectorRegistry()
    m = Metrics(registry)
    assert registry.get_sample_value("preheat_spec_draft_tokens_total") == 0  # exported before any
    for drafted, accepted in [(0, 0), (8, 3), (8, 3), (20, 11)]:
        m.record_scheduler(SimpleNamespace(spec_draft_tokens_total=drafted, spec_accepted_tokens_total=accepted))
    assert registry.get_sample_value("preheat_spec_draft_tokens_total") == 20
    assert registry.get_sample_value("preheat_spec_accepted_tokens_total") == 11


def test_the_snapshot_sizing_gauges_describe_the_loaded_model(server):
    m = scrape(server.url)
    # The embedded SmolLM2-135M in float32 (SERVER_FLAGS): 30 layers x (K, V) x 3 KV heads
    # x 64 x 4 bytes.
    assert m["preheat_kv_cache_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    # Its GGUF is converted once and loaded from the weight cache: ~135M float32 parameters.
    assert 0.4e9 < m["preheat_model_weight_cache_bytes"] < 0.7e9


def test_kv_capacity_gauge_is_the_pool_size_in_tokens(server):
    # SERVER_FLAGS cap the pool at --max-total-tokens 16384 (pages of 16).
    assert scrape(server.url)["preheat_kv_cache_capacity_tokens"] == 16384
