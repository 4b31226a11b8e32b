"""Where the local scheduler puts a pod (TEST HARNESS): a pure function of the pod, the
harness's nodes and the claims it mounts.

The rules a real scheduler applies that matter to Preheat, and nothing else:

- a pod whose PersistentVolumeClaim is missing or not Bound is not scheduled
  (`PodScheduled=False`, reason `Unschedulable`, "pod has unbound immediate
  PersistentVolumeClaims" — the real scheduler's words);
- a claim bound to one node (a ReadWriteOnce local volume: local-path, a zonal disk) pins
  every pod that mounts it to that node ("volume node affinity conflict" elsewhere);
- a lost node takes no pods; `nodeSelector` matches node labels (each node has
  `kubernetes.io/hostname: <name>`);
- among the nodes left, the one with the fewest pods of the same service wins (what the
  operator's default topology spread asks for), then the name.

Not modelled: resources, taints/tolerations, affinity rules, hard spread constraints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeInfo:
    name: str
    lost: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)

    def all_labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.name, **self.labels}


@dataclass(frozen=True)
class ClaimInfo:
    phase: str  # Pending | Bound
    node: str | None = None  # a volume reachable from one node only


@dataclass(frozen=True)
class Placement:
    node: str | None
    message: str = ""  # why not, when node is None


def claims_of(pod: Mapping[str, Any]) -> list[str]:
    return [v["persistentVolumeClaim"]["claimName"]
            for v in (pod.get("spec") or {}).get("volumes") or [] if "persistentVolumeClaim" in v]


def place(pod: Mapping[str, Any], nodes: Sequence[NodeInfo], claims: Mapping[str, ClaimInfo],
          load: Mapping[str, int]) -> Placement:
    """load: pods of the same service per node name."""
    total = len(nodes)
    names = claims_of(pod)
    if any(claims.get(c) is None or claims[c].phase != "Bound" for c in names):
        return Placement(None, f"0/{total} nodes are available: pod has unbound immediate "
                               f"PersistentVolumeClaims. preemption: 0/{total} nodes are "
                               f"available: {total} Preemption is not helpful for scheduling.")
    candidates = [n for n in nodes if not n.lost]
    reasons: list[str] = []
    if len(candidates) < total:
        reasons.append(f"{total - len(candidates)} node(s) had untolerated taint "
                       f"{{node.kubernetes.io/unreachable: }}")
    pinned = {claims[c].node for c in names if claims[c].node}
    if pinned:
        fits = [n for n in candidates if n.name in pinned and len(pinned) == 1]
        if len(fits) < len(candidates):
            reasons.append(f"{len(candidates) - len(fits)} node(s) had volume node affinity conflict")
        candidates = fits
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    if selector:
        fits = [n for n in candidates
                if all(n.all_labels().get(k) == v for k, v in selector.items())]
        if len(fits) < len(candidates):
            reasons.append(f"{len(candidates) - len(fits)} node(s) didn't match Pod's node "
                           f"affinity/selector")
        candidates = fits
    if not candidates:
        return Placement(None, f"0/{total} nodes are available: " + ", ".join(reasons) + ".")
    best = min(candidates, key=lambda n: (load.get(n.name, 0), n.name))
    return Placement(best.name)
