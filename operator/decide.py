"""The reconciler's decisions, as a pure function of the target and the observed pods.

desired_state() returns the actions that move the observed pods one step towards the
target. It is level-triggered: it looks only at what exists now, so running it again on
an unchanged world returns the same actions, and once those are applied it returns none
(until a pod changes, e.g. becomes ready). Rules, in order:

1. dead pods (Failed/Succeeded) are deleted, which makes room for their replacement;
2. each pod's preheat.dev/warm gate follows the kubelet's verdict on /ready;
3. serving count -> replicas: promote warm pods first (ready ones first), create the
   rest; surplus serving pods are demoted into the pool while it has room, else deleted
   (unready, then outdated, then newest first);
4. rollout: once the surge pod is warm, retire one outdated pod — a serving one is
   replaced by promoting a warm current pod in the same step, so serving capacity
   never drops: a new pod is warm before an old one goes;
5. warm count -> warmPool.size (+1 surge slot while outdated pods remain).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from preheat.operator.pods import PodView
from preheat.operator.resources import ROLE_SERVING, ROLE_WARM


@dataclass(frozen=True)
class Target:
    replicas: int
    warm_pool: int
    template_hash: str
    allow_create: bool = True  # False while Degraded: new pods could not start


@dataclass(frozen=True)
class CreatePod:
    role: str
    reason: str


@dataclass(frozen=True)
class Relabel:
    pod: str
    role: str
    reason: str  # "Promoted" | "Demoted" | "Adopted"


@dataclass(frozen=True)
class DeletePod:
    pod: str
    reason: str  # "Replaced" | "ScaledDown" | "PoolShrunk" | "RolledOut"


@dataclass(frozen=True)
class SetWarmGate:
    pod: str
    warm: bool


Action = CreatePod | Relabel | DeletePod | SetWarmGate


def _ready(p: PodView) -> bool:
    return p.containers_ready


def _by_preference_to_keep(pods: list[PodView], target_hash: str,
                           outdated_first: bool = False) -> list[PodView]:
    """Order pods most-expendable first: unready, then outdated, then newest.

    outdated_first puts outdated pods before unready ones (the pool: an outdated warm pod
    is going away anyway, a starting current one is the next warm pod)."""
    newest_first = sorted(pods, key=lambda p: (p.created, p.name), reverse=True)
    if outdated_first:
        return sorted(newest_first, key=lambda p: (p.template_hash == target_hash, _ready(p)))
    return sorted(newest_first, key=lambda p: (_ready(p), p.template_hash == target_hash))


def _by_preference_to_promote(pods: list[PodView], target_hash: str) -> list[PodView]:
    """Ready before starting, current before outdated, oldest (furthest along) first."""
    return sorted(pods, key=lambda p: (not _ready(p), p.template_hash != target_hash,
                                       p.created, p.name))


def desired_state(target: Target, observed: list[PodView]) -> list[Action]:
    actions: list[Action] = []
    live = [p for p in observed if not p.terminating]

    for p in live:
        if p.dead:
            actions.append(DeletePod(p.name, "Replaced"))
    live = [p for p in live if not p.dead]

    for p in live:
        if p.gate != _ready(p):
            actions.append(SetWarmGate(p.name, _ready(p)))

    H = target.template_hash
    serving = [p for p in live if p.role == ROLE_SERVING]
    warm = [p for p in live if p.role != ROLE_SERVING]
    for i, p in enumerate(warm):
        if p.role != ROLE_WARM:  # role label lost or edited by hand: back into the pool
            actions.append(Relabel(p.name, ROLE_WARM, "Adopted"))
            warm[i] = replace(p, role=ROLE_WARM)
    created = False

    # 3. serving count
    if len(serving) < target.replicas:
        deficit = target.replicas - len(serving)
        for p in _by_preference_to_promote(warm, H)[:deficit]:
            actions.append(Relabel(p.name, ROLE_SERVING, "Promoted"))
            warm.remove(p)
            serving.append(replace(p, role=ROLE_SERVING))
            deficit -= 1
        if target.allow_create:
            actions.extend(CreatePod(ROLE_SERVING, "ScaledUp") for _ in range(deficit))
            created = created or deficit > 0
    elif len(serving) > target.replicas:
        for p in _by_preference_to_keep(serving, H)[: len(serving) - target.replicas]:
            serving.remove(p)
            if len(warm) < target.warm_pool:
                actions.append(Relabel(p.name, ROLE_WARM, "Demoted"))
                warm.append(replace(p, role=ROLE_WARM))
            else:
                actions.append(DeletePod(p.name, "ScaledDown"))

    # Steps 4 and 5 repeat until neither has more to do, so that one call is a fixed point.
    while True:
        before = len(actions)
        # 4. rollout: retire outdated pods only while the pods standing exceed the target
        # (the surge pod is up) and every current pod is warm. In a normal rollout that is
        # exactly one pod per surge; leftovers beyond the target go at once.
        if not created:
            while True:
                old_serving = [p for p in serving if p.template_hash != H]
                old_warm = [p for p in warm if p.template_hash != H]
                current = [p for p in serving + warm if p.template_hash == H]
                fresh = [p for p in warm if p.template_hash == H and _ready(p)]
                surplus = len(serving) + len(warm) > target.replicas + target.warm_pool
                if not (old_serving or old_warm) or not surplus or not all(map(_ready, current)):
                    break
                if old_serving and fresh:
                    victim = _by_preference_to_keep(old_serving, H)[0]
                    actions.append(Relabel(fresh[0].name, ROLE_SERVING, "Promoted"))
                    actions.append(DeletePod(victim.name, "RolledOut"))
                    serving.remove(victim)
                    warm.remove(fresh[0])
                    serving.append(replace(fresh[0], role=ROLE_SERVING))
                elif old_warm:
                    victim = _by_preference_to_keep(old_warm, H)[0]
                    actions.append(DeletePod(victim.name, "RolledOut"))
                    warm.remove(victim)
                else:
                    break

        # 5. warm pool size; outdated pods still standing (after scaling) need a surge slot
        rolling = any(p.template_hash != H for p in serving + warm)
        pool_target = target.warm_pool + (1 if rolling else 0)
        if len(warm) < pool_target:
            if target.allow_create:
                n = pool_target - len(warm)
                actions.extend(CreatePod(ROLE_WARM, "PoolBackfill") for _ in range(n))
                created = True
        else:
            # One at a time: deleting an outdated pod may end the rollout and its surge slot.
            while len(warm) > pool_target:
                p = _by_preference_to_keep(warm, H, outdated_first=True)[0]
                warm.remove(p)
                actions.append(DeletePod(p.name, "PoolShrunk"))
                rolling = any(q.template_hash != H for q in serving + warm)
                pool_target = target.warm_pool + (1 if rolling else 0)
        if len(actions) == before or created:
            break

    return actions
