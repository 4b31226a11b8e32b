"""The routing decision: Ready pods + their load + a request's key -> one pod. Pure.

Prefix affinity by rendezvous hashing, balanced by bounded load: the pods are ranked by
prefix.score(key, pod) — the same ranking in every router replica, so two routers do not
halve the affinity — and the request goes to the first pod in that ranking that would not
carry more than `factor` x the mean in-flight load plus `slack` requests. A hot prefix
therefore spills to its second-ranked pod (again the same one in every router) instead of
piling onto one engine. A request without a key goes to the least-loaded pod.

The load is the requests this router has in flight per pod: it forwards at once and keeps no
queue, so that count is what it has put on each engine.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from preheat.router.prefix import score


@dataclass(frozen=True)
class Balance:
    factor: float = 1.5
    slack: int = 2


@dataclass(frozen=True)
class Choice:
    pod: str
    preferred: str | None  # the key's top-ranked pod (None without a key)
    reason: str  # "affinity" | "spill" | "least-loaded"


def ranking(key: str, pods: Collection[str]) -> list[str]:
    return sorted(pods, key=lambda p: (-score(key, p), p))


def choose(in_flight: Mapping[str, int], key: str | None, balance: Balance = Balance(),
           exclude: Collection[str] = ()) -> Choice | None:
    """in_flight: the Ready pods (name -> requests in flight to it). exclude: pods already
    tried for this request. None when no pod is left."""
    pods = {p: n for p, n in in_flight.items() if p not in exclude}
    if not pods:
        return None
    if key is None:
        pod = min(pods, key=lambda p: (pods[p], p))
        return Choice(pod, None, "least-loaded")
    # The mean counts every Ready pod (also excluded ones): a retry must not lower the bar.
    total = sum(in_flight.values()) + 1
    cap = balance.factor * total / max(1, len(in_flight)) + balance.slack
    order = ranking(key, pods)
    for pod in order:
        if pods[pod] + 1 <= cap:
            return Choice(pod, order[0], "affinity" if pod == order[0] else "spill")
    pod = min(order, key=lambda p: pods[p])  # all above the bar: the least loaded of them
    return Choice(pod, order[0], "spill" if pod != order[0] else "affinity")
