"""Quantity parsing (checked against the kubernetes package's) and reading a gauge from the
engine's real /metrics output."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.utils import parse_quantity as k8s_parse_quantity

from preheat.engine.metrics import Metrics
from preheat.operator.quantity import parse_quantity
from preheat.operator.scrape import metrics_url, parse_gauge

SUFFIXES = ["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "n", "u"]


@settings(max_examples=int(__import__("os").environ.get("PREHEAT_HYPOTHESIS_EXAMPLES", 150)),
          deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 999), st.sampled_from(SUFFIXES),
       st.booleans())
def test_quantities_parse_as_the_kubernetes_client_parses_them(whole, frac, suffix, decimal):
    text = f"{whole}.{frac}{suffix}" if decimal else f"{whole}{suffix}"
    assert math.isclose(parse_quantity(text), float(k8s_parse_quantity(text)), rel_tol=1e-12)


@pytest.mark.parametrize("text", ["1e3", "1E3", "1E", ".5", "+3", "0.8", "4", 4, 2.5])
def test_exponents_signs_and_numbers(text):
    assert math.isclose(parse_quantity(text), float(k8s_parse_quantity(text)))


@pytest.mark.parametrize("bad", ["", "lots", "1.2.3", "5 m", "m", "1Kb", True])
def test_what_is_not_a_quantity_is_refused(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


def test_the_engines_gauges_are_read_from_its_own_metrics_text():
    m = Metrics()
    m.num_waiting.set(3)
    m.num_running.set(8)
    m.kv_usage.set(0.625)
    text, _ = m.render()
    text = text.decode() if isinstance(text, bytes) else text
    assert parse_gauge(text, "preheat_num_requests_waiting") == 3.0
    assert parse_gauge(text, "preheat_num_requests_running") == 8.0
    assert parse_gauge(text, "preheat_kv_cache_usage_ratio") == 0.625
    assert parse_gauge(text, "preheat_no_such_gauge") is None


def test_a_labelled_or_non_finite_sample_is_not_the_gauge():
    text = ('# TYPE x gauge\nx{shard="1"} 4\n'
            '# TYPE y gauge\ny NaN\n'
            '# TYPE z gauge\nz 2\n')
    assert parse_gauge(text, "x") is None
    assert parse_gauge(text, "y") is None
    assert parse_gauge(text, "z") == 2.0


def test_the_metrics_url_is_the_pod_ip_and_the_named_container_port():
    pod = {"status": {"podIP": "10.1.2.3"},
           "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]}}
    assert metrics_url(pod) == "http://10.1.2.3:8000/metrics"
    assert metrics_url({"status": {"podIP": "fd00::7"}, "spec": {}}) == "http://[fd00::7]:8000/metrics"
    assert metrics_url({"status": {}}) is None
