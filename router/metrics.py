"""The router's Prometheus metrics (prefixed preheat_router_), one registry per router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.attempts = Counter(
            "preheat_router_requests", "Attempts sent to an engine pod, by outcome: 2xx/4xx/5xx "
            "(answered), no_bytes (failed before any byte reached the client: retried elsewhere "
            "while attempts and the deadline last), aborted (the engine broke off after bytes "
            "reached the client).",
            ["pod", "outcome"], registry=r)
        self.retries = Counter(
            "preheat_router_retries", "Attempts retried on another pod, by the pod that failed "
            "and why (connect, reset, unavailable = 503).", ["pod", "reason"], registry=r)
        self.routed = Counter(
            "preheat_router_routed", "Requests routed, by reason: affinity (to the pod ranked "
            "first for the prefix), spill (that pod was much busier), least-loaded (no prefix).",
            ["reason"], registry=r)
        self.prefix_held = Counter(
            "preheat_router_prefix_routed", "Requests with a prefix, by whether the pod they "
            "went to had been sent that prefix by this router before (held: true/false).",
            ["held"], registry=r)
        self.in_flight = Gauge(
            "preheat_router_pod_in_flight", "Requests this router has in flight per engine pod "
            "(it forwards at once and queues nothing: this is the load it put there).",
            ["pod"], registry=r)
        self.placements = Gauge(
            "preheat_router_placements", "Prefix keys placed on a pod and still live (their "
            "last request within --affinity-window), this router's and its peers'.",
            registry=r)
        self.learned = Counter(
            "preheat_router_placements_learned", "Placements learned from peer routers "
            "(their requests of a key this router had not sent since).", registry=r)
        self.peer_errors = Counter(
            "preheat_router_peer_errors", "Failed pulls of a peer router's placements, by "
            "peer.", ["peer"], registry=r)
        self.engines = Gauge("preheat_router_engines", "Ready serving pods the router sends to.",
                             registry=r)
        self.unroutable = Counter(
            "preheat_router_unroutable", "Requests answered 503 by the router itself: no Ready "
            "pod within the retry deadline, or every attempt failed.", registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
