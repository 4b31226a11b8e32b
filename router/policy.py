"""The routing decision: Ready pods + their load + a request's key -> one pod. Pure.

Prefix affinity by rendezvous hashing, balanced by bounded load (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads"): the pods are ranked by
prefix.score(key, pod) — the same ranking in every router replica, so two routers do not
halve the affinity — and the request goes to the first pod that would not carry more than
`factor` x the mean load plus `slack`. A key already placed (placement.py: the pod its
latest request went to, where its freshest prefix is) tries that pod first, then the
ranking. A request without a key goes to the least-loaded pod.

The load (placement.Placements.load) is what this router has put on each pod: its requests
in flight plus the conversations placed there that are between turns. Counting the
conversations, not only the requests in flight, is what balances a few long conversations:
a pod is full once it holds its share of them, and the next new conversation is placed on
the next pod of its ranking before it has a prefix anywhere — the spill costs no cache. A
hot prefix with many requests at once counts each request, and spills as before.

The defaults are the measured trade-off between the cache share and the spread
(benchmarks/routing_sweep.py, benchmarks/results/routing.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from preheat.router.prefix import score


@dataclass(frozen=True)
class Balance:
    """The bar: a pod may carry factor x the mean load + slack. Defaults: measured
    (benchmarks/routing_sweep.py over the benchmark's workload, then the real run)."""
    factor: float = 1.25
    slack: int = 1


@dataclass(frozen=True)
class Choice:
    pod: str
    preferred: str | None  # where the key would go unloaded: its placed or top-ranked pod
    reason: str  # "affinity" | "spill" | "least-loaded"


def ranking(key: str, pods: Collection[str]) -> list[str]:
    return sorted(pods, key=lambda p: (-score(key, p), p))


def cap(load: Mapping[str, int], balance: Balance) -> float:
    """The most load a pod may carry after taking one more request: factor x the mean load
    of the Ready pods with that request counted, plus slack."""
    return balance.factor * (sum(load.values()) + 1) / max(1, len(load)) + balance.slack


def choose(load: Mapping[str, int], key: str | None, balance: Balance = Balance(),
           exclude: Collection[str] = (), placed: str | None = None,
           seated: bool = False) -> Choice | None:
    """load: the Ready pods (name -> load, as placement.Placements.load counts it). exclude:
    pods already tried for this request. placed: the pod the key's latest request went to;
    seated: the key holds a parked seat there that this request takes up — it was counted
    when it was placed, so it stays without passing the bar again (as a ball in bounded-load
    hashing stays where it is). None when no pod is left."""
    pods = {p: n for p, n in load.items() if p not in exclude}
    if not pods:
        return None
    if key is None:
        pod = min(pods, key=lambda p: (pods[p], p))
        return Choice(pod, None, "least-loaded")
    if seated and placed in pods:
        return Choice(placed, placed, "affinity")
    # The mean counts every Ready pod (also excluded ones): a retry must not lower the bar.
    bar = cap(load, balance)
    order = ranking(key, pods)
    if placed in pods:
        order.remove(placed)
        order.insert(0, placed)
    for pod in order:
        if pods[pod] + 1 <= bar:
            return Choice(pod, order[0], "affinity" if pod == order[0] else "spill")
    pod = min(order, key=lambda p: pods[p])  # all above the bar: the least loaded of them
    return Choice(pod, order[0], "spill" if pod != order[0] else "affinity")
