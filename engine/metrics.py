"""Prometheus metrics of the engine, all prefixed `preheat_`.

One `Metrics` object owns one registry, so tests can build as many servers as they like.
The process-wide instance (`default_metrics()`) is the one `preheat serve` exposes at
/metrics; the warm-start code (warmup, snapshots, CUDA-graph capture) records into it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PHASES = ("downloading", "loading", "restoring", "warming", "ready", "draining")

# Latency buckets from a 135M model on one CPU core up to a big model under load.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_STARTUP_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# A page set copied from host memory is sub-millisecond; from disk, milliseconds to a second.
_TIER_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TIERS = ("l1", "l2", "l3")

@dataclass(frozen=True)
class MetricDef:
    """One metric: the attribute that holds it on Metrics, its kind, name, help, labels."""

    attr: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def make(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        extra = {"buckets": self.buckets} if self.buckets is not None else {}
        return self.kind(self.name, self.help, self.labels, registry=registry, **extra)


# Every metric the engine exports, in the order /metrics lists them. Counters are named
# without `_total` (prometheus_client appends it).
METRICS: tuple[MetricDef, ...] = (
    # --- tokens and cache ---
    MetricDef("prompt_tokens", Counter, "preheat_prompt_tokens", "Prompt tokens processed."),
    MetricDef("generation_tokens", Counter, "preheat_generation_tokens", "Tokens generated."),
    MetricDef(
        "prefix_cache_hit_tokens", Counter, "preheat_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache instead of computed.",
    ),
    MetricDef(
        "cache_hit_rate", Gauge, "preheat_cache_hit_rate",
        "Prefix-cache hit tokens / prompt tokens since start.",
    ),
    # --- latency ---
    MetricDef(
        "ttft", Histogram, "preheat_time_to_first_token_seconds",
        "Arrival to first generated token.", buckets=_TTFT_BUCKETS,
    ),
    MetricDef(
        "tpot", Histogram, "preheat_time_per_output_token_seconds",
        "Mean time between generated tokens after the first, per request.", buckets=_TPOT_BUCKETS,
    ),
    MetricDef("e2e", Histogram, "preheat_e2e_request_latency_seconds", "Arrival to last token.", buckets=_E2E_BUCKETS),
    # --- requests ---
    MetricDef(
        "requests", Counter, "preheat_requests",
        "Finished generation requests by finish reason.",
        ("finish_reason",),
    ),
    MetricDef(
        "request_errors", Counter, "preheat_request_errors",
        "Requests refused with an error, by HTTP status.",
        ("status",),
    ),
    MetricDef("num_running", Gauge, "preheat_num_requests_running", "Requests in the running batch."),
    MetricDef(
        "preemptions", Counter, "preheat_num_preemptions",
        "Running requests preempted (pages freed, recomputed later) because the KV pool ran short.",
    ),
    MetricDef(
        "deferred", Counter, "preheat_prefill_deferred",
        "Admissions put off one step because another request was computing the same uncached prefix.",
    ),
    MetricDef(
        "spec_draft_tokens", Counter, "preheat_spec_draft_tokens",
        "Speculative decoding: draft tokens verified by the model (--speculative-method).",
    ),
    MetricDef(
        "spec_accepted_tokens", Counter, "preheat_spec_accepted_tokens",
        "Speculative decoding: draft tokens the model accepted (each one a decode step saved).",
    ),
    MetricDef("num_waiting", Gauge, "preheat_num_requests_waiting", "Requests queued for admission."),
    MetricDef("kv_usage", Gauge, "preheat_kv_cache_usage_ratio", "Fraction of KV pages in use."),
    MetricDef(
        "kv_capacity_tokens", Gauge, "preheat_kv_cache_capacity_tokens",
        "Size of the KV pool in tokens (pages x page size): with --kv-cache-dtype fp8 about twice what the same memory holds in the model dtype.",
    ),
    MetricDef(
        "kv_bytes_per_token", Gauge, "preheat_kv_cache_bytes_per_token",
        "Bytes of K and V one token takes in a snapshot, all layers (fp8 KV: half): the "
        "operator sizes spec.snapshot.size with it.",
    ),
    # The same three gauges under vLLM's names, which the Gateway API Inference
    # Extension's endpoint picker and common KEDA / prometheus-adapter recipes read.
    # vllm:kv_cache_usage_perc is a fraction (1 = full), as vLLM's is.
    MetricDef("vllm_num_running", Gauge, "vllm:num_requests_running", "Requests in the running batch (vLLM's name)."),
    MetricDef("vllm_num_waiting", Gauge, "vllm:num_requests_waiting", "Requests queued for admission (vLLM's name)."),
    MetricDef(
        "vllm_kv_usage", Gauge, "vllm:kv_cache_usage_perc",
        "Fraction of KV pages in use, 1 = full (vLLM's name).",
    ),
    MetricDef(
        "kv_request_pages", Gauge, "preheat_kv_cache_request_pages",
        "KV pages owned by running requests (not yet handed to the prefix cache).",
    ),
    # --- readiness ---
    MetricDef("ready", Gauge, "preheat_ready", "1 when /ready answers 200, else 0."),
    MetricDef("phase", Gauge, "preheat_phase", "1 for the current readiness phase.", ("phase",)),
    MetricDef(
        "model_download_bytes", Counter, "preheat_model_download_bytes",
        "Bytes of model files this process downloaded (hub, S3 or a peer; 0 when read from the cache).",
    ),
    MetricDef(
        "model_download_source_bytes", Counter, "preheat_model_download_source_bytes",
        "The same bytes by where they came from: peer (a Ready engine of the service), hub or s3 (the origin).",
        ("source",),
    ),
    # --- warm start (recorded by warmup, snapshot and CUDA-graph code) ---
    MetricDef(
        "cuda_graph_capture_seconds", Gauge, "preheat_cuda_graph_capture_seconds",
        "Time spent capturing CUDA graphs.",
    ),
    MetricDef(
        "warmup_seconds", Gauge, "preheat_warmup_seconds",
        "Time spent running warmup plans (the built-in warmup and the templates).",
    ),
    MetricDef(
        "warmup_requests", Counter, "preheat_warmup_requests",
        "Requests run by warmup: the built-in warmup and the templates.",
    ),
    MetricDef(
        "snapshot_restored_tokens", Gauge, "preheat_snapshot_restored_tokens",
        "Tokens of KV restored from a snapshot.",
    ),
    MetricDef(
        "snapshot_restore_seconds", Gauge, "preheat_snapshot_restore_seconds",
        "Time spent restoring the snapshot.",
    ),
    MetricDef(
        "snapshot_saved_tokens", Gauge, "preheat_snapshot_saved_tokens",
        "Tokens of KV in the last snapshot written.",
    ),
    MetricDef(
        "snapshot_max_tokens", Gauge, "preheat_snapshot_max_tokens",
        "--snapshot-max-tokens: the most tokens of KV one snapshot holds (0 without --snapshot-dir).",
    ),
    MetricDef(
        "weight_cache_bytes", Gauge, "preheat_model_weight_cache_bytes",
        "Bytes of the converted weights this engine loaded from its weight cache "
        "(--weight-cache-dir), and of the matrices it keeps there packed for the CPU kernels; "
        "0 when it reads the model in place and packs nothing.",
    ),
    MetricDef(
        "snapshot_rejected", Counter, "preheat_snapshot_rejected",
        "Snapshots refused (incompatible, truncated, tampered...).",
        ("reason",),
    ),
    MetricDef(
        "snapshot_peer_fetches", Counter, "preheat_snapshot_peer_fetches",
        "Snapshot fetches from a peer at start-up, by result: fetched, present (already here), none (no peer ready or nothing cached), unreachable, refused, timeout, error.",
        ("result",),
    ),
    MetricDef(
        "snapshot_peer_fetch_seconds", Gauge, "preheat_snapshot_peer_fetch_seconds",
        "Time the last peer fetch took.",
    ),
    # --- KV tiers (engine counters, synced after every step by record_tiers) ---
    MetricDef(
        "kv_tier_hit_tokens", Counter, "preheat_kv_tier_hit_tokens",
        "Prompt tokens found in a KV tier instead of computed: l1 = device pool (radix match), l2 = host memory, l3 = disk (brought back to L1).",
        ("tier",),
    ),
    MetricDef(
        "l2_to_l1_latency", Histogram, "preheat_l2_to_l1_latency_seconds",
        "Time to bring a matched prefix's pages from L2 (or L3 through L2) back into L1.", buckets=_TIER_BUCKETS,
    ),
    MetricDef(
        "kv_disk_evictions", Counter, "preheat_kv_disk_evictions",
        "KV pages dropped from the L3 disk tier to stay within its capacity.",
    ),
    MetricDef(
        "kv_tier_errors", Counter, "preheat_kv_tier_errors",
        "Failed reads and writes of the L2 (host) and L3 (disk) KV tiers, each treated as a cache miss: a full or failing disk, a corrupt page, no host memory.",
        ("tier", "op"),
    ),
    MetricDef(
        "startup_seconds", Histogram, "preheat_startup_step_seconds",
        "Duration of each start-up step.",
        ("step",), buckets=_STARTUP_BUCKETS,
    ),
)


class Metrics:
    prompt_tokens: Counter
    generation_tokens: Counter
    prefix_cache_hit_tokens: Counter
    cache_hit_rate: Gauge
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    requests: Counter
    request_errors: Counter
    num_running: Gauge
    preemptions: Counter
    deferred: Counter
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter
    num_waiting: Gauge
    kv_usage: Gauge
    kv_capacity_tokens: Gauge
    kv_bytes_per_token: Gauge
    vllm_num_running: Gauge
    vllm_num_waiting: Gauge
    vllm_kv_usage: Gauge
    kv_request_pages: Gauge
    ready: Gauge
    phase: Gauge
    model_download_bytes: Counter
    model_download_source_bytes: Counter
    cuda_graph_capture_seconds: Gauge
    warmup_seconds: Gauge
    warmup_requests: Counter
    snapshot_restored_tokens: Gauge
    snapshot_restore_seconds: Gauge
    snapshot_saved_tokens: Gauge
    snapshot_max_tokens: Gauge
    weight_cache_bytes: Gauge
    snapshot_rejected: Counter
    snapshot_peer_fetches: Counter
    snapshot_peer_fetch_seconds: Gauge
    kv_tier_hit_tokens: Counter
    l2_to_l1_latency: Histogram
    kv_disk_evictions: Counter
    kv_tier_errors: Counter
    startup_seconds: Histogram

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for d in METRICS:
            setattr(self, d.attr, d.make(self.registry))
        self._lock = threading.Lock()
        self._prompt_total = 0
        self._hit_total = 0
        self._tier_seen = {t: 0 for t in TIERS}
        self._disk_evictions_seen = 0
        self._tier_errors_seen: dict[tuple[str, str], int] = {}
        self._scheduler_seen = {
            "preemptions_total": 0,
            "deferred_total": 0,
            "spec_draft_tokens_total": 0,
            "spec_accepted_tokens_total": 0,
        }
        for t in TIERS:
            self.kv_tier_hit_tokens.labels(tier=t)  # exported as 0 before the first hit
        self.set_phase("loading")

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        for p in PHASES:
            self.phase.labels(phase=p).set(1 if p == phase else 0)
        self.ready.set(1 if phase == "ready" else 0)

    def record_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_cache_hit_tokens.inc(cached_tokens)
        with self._lock:
            self._prompt_total += prompt_tokens
            self._hit_total += cached_tokens
            if self._prompt_total:
                self.cache_hit_rate.set(self._hit_total / self._prompt_total)

    def record_finished(
        self, finish_reason: str, ttft: float | None, e2e: float, output_tokens: int
    ) -> None:
        self.requests.labels(finish_reason=finish_reason or "unknown").inc()
        if ttft is not None:
            self.ttft.observe(ttft)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))
        self.e2e.observe(e2e)

    def record_scheduler(self, stats: object) -> None:
        """Moves the engine's running totals into the counters (by their increase)."""
        for attr, counter in (
            ("preemptions_total", self.preemptions),
            ("deferred_total", self.deferred),
            ("spec_draft_tokens_total", self.spec_draft_tokens),
            ("spec_accepted_tokens_total", self.spec_accepted_tokens),
        ):
            now = getattr(stats, attr, None)
            if isinstance(now, int) and now > self._scheduler_seen[attr]:
                counter.inc(now - self._scheduler_seen[attr])
                self._scheduler_seen[attr] = now

    def record_tiers(self, engine: object) -> None:
        """Moves the engine's tier counters into Prometheus. Call it on the step thread: it
        drains `engine.tier_restore_seconds`, which the step thread appends to. Engines
        without tiers (or fakes) are skipped."""
        hits = getattr(engine, "tier_hit_tokens", None)
        if isinstance(hits, dict):
            for tier in TIERS:
                now = int(hits.get(tier, 0))
                if now > self._tier_seen[tier]:
                    self.kv_tier_hit_tokens.labels(tier=tier).inc(now - self._tier_seen[tier])
                self._tier_seen[tier] = now
        restores = getattr(engine, "tier_restore_seconds", None)
        if isinstance(restores, list) and restores:
            drained, restores[:] = list(restores), []
            for seconds in drained:
                self.l2_to_l1_latency.observe(seconds)
        tiers = getattr(engine, "tiers", None)
        counts = getattr(tiers, "error_counts", None)
        if callable(counts):
            for (tier, op), now in counts().items():
                seen = self._tier_errors_seen.get((tier, op), 0)
                if now > seen:
                    self.kv_tier_errors.labels(tier=tier, op=op).inc(now - seen)
                self._tier_errors_seen[(tier, op)] = now
        l3 = getattr(tiers, "l3", None)
        evictions = getattr(getattr(l3, "stats", None), "evictions", None)
        if isinstance(evictions, int):
            if evictions > self._disk_evictions_seen:
                self.kv_disk_evictions.inc(evictions - self._disk_evictions_seen)
            self._disk_evictions_seen = evictions

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_default: Metrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> Metrics:
    """The process-wide metrics that `preheat serve` exposes."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Metrics()
        return _default
