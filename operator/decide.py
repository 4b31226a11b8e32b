"""The reconciler's decisions, as a pure function of the target, the observed pods and time.

plan() returns the actions that move the observed pods towards the target. It is
level-triggered: it looks only at what exists now (and the clock), so running it again on
an unchanged world at the same moment returns the same actions, and once those are applied
it returns none until a pod changes or a deadline passes (Plan.recheck_at says when).
Rules, in order:

1. dead pods (Failed/Succeeded) are deleted, which makes room for their replacement; a
   draining pod (a serving pod on its way out, already out of the Service's endpoints) is
   deleted once the endpoint delay has passed;
2. each pod's preheat.dev/warm gate follows the kubelet's verdict on /ready;
3. failover: a serving pod that has been unable to serve for longer than
   `unready_seconds` (crashed or hung after being warm, unschedulable, its node lost) is
   replaced by promoting a ready warm pod of the current template, and deleted in the
   same step. Without such a warm pod the pool gets one extra pod per failing serving pod,
   promoted when ready. A warm pod that fails the same way is deleted and the pool
   refilled. Repeated failovers back off (failover_delay) so a template that keeps failing
   cannot cause a create/delete storm. A serving pod that is merely still starting is
   swapped for a ready warm pod (it goes back into the pool) — capacity now, nothing lost;
4. serving count -> replicas: promote warm pods of the current template first (ready ones
   first, never an outdated one), create the rest; surplus serving pods leave (failing,
   unready, outdated, newest first): a ready current one is demoted into the pool while it
   has room, a ready one otherwise drains out of the endpoints first, an unready one is
   deleted at once;
5. rollout (Deployment semantics with the pool in front): outdated warm pods are deleted
   at once (they may never be promoted); up to `max_surge` extra new pods start in the
   pool; an outdated serving pod is replaced by promoting a ready new warm pod — only while
   the pool keeps `warm_pool` ready new pods, or when nothing more can start — and then
   drains; with `max_unavailable` > 0 outdated serving pods may also go before their
   replacement is ready, as long as that many ready serving pods are missing at most;
6. warm count -> warm_pool (+ rollout surge + failover surge).
Rules 4-6 repeat until none has more to do, so that one call is a fixed point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from preheat.operator.pods import PodView, parse_time
from preheat.operator.resources import ROLE_DRAINING, ROLE_SERVING, ROLE_WARM

# Failover back-off: the first FREE_FAILOVERS of a streak happen at once; after that each
# waits BACKOFF_BASE_S * 2^k (at most BACKOFF_MAX_S) after the previous one. A streak ends
# when STREAK_RESET_S pass without a failover (as the kubelet's CrashLoopBackOff resets).
FREE_FAILOVERS = 3
BACKOFF_BASE_S = 10.0
BACKOFF_MAX_S = 300.0
STREAK_RESET_S = 600.0


@dataclass(frozen=True)
class Target:
    replicas: int
    warm_pool: int
    template_hash: str
    allow_create: bool = True  # False while Degraded: new pods could not start
    max_surge: int = 1  # resolved from spec.rollout (ints, not percents, here)
    max_unavailable: int = 0
    unready_seconds: float = 5.0  # spec.failover.unreadySeconds
    drain_seconds: float = 0.0  # endpoint delay; 0: a leaving serving pod is deleted at once


@dataclass(frozen=True)
class FailoverHistory:
    """The current failover streak, kept in the status (status.failover) across passes."""
    count: int = 0
    last: float | None = None  # epoch seconds


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
class Retire:
    """Take a ready serving pod out of the Service (role=draining) before deleting it."""
    pod: str
    reason: str  # "ScaledDown" | "RolledOut"


@dataclass(frozen=True)
class DeletePod:
    pod: str
    # "Replaced" | "ScaledDown" | "PoolShrunk" | "RolledOut" | "FailedOver" | "Drained"
    reason: str


@dataclass(frozen=True)
class SetWarmGate:
    pod: str
    warm: bool


Action = CreatePod | Relabel | Retire | DeletePod | SetWarmGate


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    history: FailoverHistory  # after this plan's failovers
    recheck_at: float | None = None  # the next moment a time-based rule may fire
    backoff_until: float | None = None  # a failover is held back until then
    failing: tuple[str, ...] = ()  # serving pods failing and not yet replaced
    failovers: tuple[tuple[str, str, str], ...] = ()  # (failed pod, promoted pod or "", why)


def failover_delay(count: int) -> float:
    """Seconds the next failover waits after the previous one, `count` into a streak."""
    if count < FREE_FAILOVERS:
        return 0.0
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (count - FREE_FAILOVERS))


def next_failover_at(h: FailoverHistory, now: float) -> float:
    if h.last is None or now - h.last > STREAK_RESET_S:
        return -math.inf
    return h.last + failover_delay(h.count)


def _bump(h: FailoverHistory, now: float) -> FailoverHistory:
    fresh = h.last is None or now - h.last > STREAK_RESET_S
    return FailoverHistory(1 if fresh else h.count + 1, now)


def _ready(p: PodView) -> bool:
    return p.containers_ready


def _serves_now(p: PodView) -> bool:
    """Ready as the Service sees it this moment: warm, gate open, Ready condition True. A
    planned swap waits for this, so that the pod it promotes takes traffic at once."""
    return p.containers_ready and p.gate and p.ready_condition == "True"


def failing_since(p: PodView, serving: bool) -> tuple[float, str] | None:
    """Since when, and why, a pod has been unable to serve; None while it serves or is still
    starting (a pod that was never warm is starting, not failing — except a serving pod the
    scheduler cannot place, or one whose container already crashed).

    A container that died is no readiness blip: its restart is a whole cold start, so the
    grace is not waited for ("Crashed" counts from `unready_seconds` before the death)."""
    created = parse_time(p.created) or 0.0
    if serving and p.unschedulable_since is not None:
        return p.unschedulable_since, "Unschedulable"
    if p.gate and p.containers_ready and p.ready_condition in ("False", "Unknown"):
        # Ready went down after our gate opened, with the containers still ready: the node
        # controller marked the pod (node lost). Before the gate opened it is just starting.
        since = p.ready_changed if p.ready_changed is not None else created
        gate_since = p.gate_changed if p.gate_changed is not None else -math.inf
        if since >= gate_since:
            return since, "NodeNotReady"
        return None
    if not p.containers_ready and (p.was_warm or (serving and p.restarts > 0)):
        since = p.containers_ready_changed if p.containers_ready_changed is not None else created
        # Second-precision timestamps: a death within a second of turning unready caused it.
        if p.container_died_at is not None and p.container_died_at >= since - 1:
            return -math.inf, "Crashed"
        return since, "CrashLoop" if p.restarts > 0 else "Unready"
    return None


def _by_preference_to_keep(pods: list[PodView], target_hash: str,
                           failing: frozenset[str] = frozenset()) -> list[PodView]:
    """Order pods most-expendable first: failing, unready, outdated, then newest."""
    newest_first = sorted(pods, key=lambda p: (p.created, p.name), reverse=True)
    return sorted(newest_first, key=lambda p: (p.name not in failing, _ready(p),
                                               p.template_hash == target_hash))


def _by_preference_to_promote(pods: list[PodView]) -> list[PodView]:
    """Ready before starting, oldest (furthest along) first."""
    return sorted(pods, key=lambda p: (not _ready(p), p.created, p.name))


_PHANTOM = "\0new-"  # a pod this plan creates: counted by the rules, never acted on by name


def _phantom(role: str, target_hash: str, i: int) -> PodView:
    return PodView(name=f"{_PHANTOM}{i}", role=role, template_hash=target_hash, created="~")


def _is_phantom(p: PodView) -> bool:
    return p.name.startswith(_PHANTOM)


@dataclass
class _State:
    """The world as this plan will have left it, updated as actions are chosen."""
    target: Target
    now: float | None
    serving: list[PodView]
    warm: list[PodView]
    failing: dict[str, tuple[float, str]] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    recheck: list[float] = field(default_factory=list)
    history: FailoverHistory = field(default_factory=FailoverHistory)
    backoff_until: float | None = None
    failovers: list[tuple[str, str, str]] = field(default_factory=list)
    created: int = 0

    @property
    def H(self) -> str:
        return self.target.template_hash

    def current_warm_ready(self) -> list[PodView]:
        return _by_preference_to_promote(
            [p for p in self.warm if p.template_hash == self.H and _ready(p)
             and p.name not in self.failing])

    def failover_allowed(self) -> bool:
        if self.now is None:
            return False
        at = next_failover_at(self.history, self.now)
        if self.now >= at:
            return True
        self.backoff_until = at
        self.recheck.append(at)
        return False

    def failed_over(self, pod: str, promoted: str, why: str) -> None:
        assert self.now is not None
        self.history = _bump(self.history, self.now)
        self.failovers.append((pod, promoted, why))

    def promote(self, p: PodView) -> None:
        self.actions.append(Relabel(p.name, ROLE_SERVING, "Promoted"))
        self.warm.remove(p)
        self.serving.append(replace(p, role=ROLE_SERVING))

    def leave(self, p: PodView, reason: str) -> None:
        """A serving pod goes: a ready one drains out of the endpoints first."""
        self.serving.remove(p)
        if _ready(p) and p.name not in self.failing and self.target.drain_seconds > 0:
            self.actions.append(Retire(p.name, reason))
            if self.now is not None:
                self.recheck.append(self.now + self.target.drain_seconds)
        else:
            self.actions.append(DeletePod(p.name, reason))

    def create(self, role: str, reason: str, n: int) -> None:
        if n <= 0 or not self.target.allow_create:
            return
        for _ in range(n):
            self.actions.append(CreatePod(role, reason))
            pod = _phantom(role, self.H, self.created)
            self.created += 1
            (self.serving if role == ROLE_SERVING else self.warm).append(pod)


def plan(target: Target, observed: list[PodView], now: float | None = None,
         history: FailoverHistory = FailoverHistory()) -> Plan:
    """now: epoch seconds; None turns the time-based rules off (no pod is ever failing long
    enough, no draining pod is ever done)."""
    live = [p for p in observed if not p.terminating]
    st = _State(target=target, now=now, serving=[], warm=[], history=history)

    # 1. the dead, and drained pods whose endpoint delay is over
    for p in live:
        if p.dead:
            st.actions.append(DeletePod(p.name, "Replaced"))
    live = [p for p in live if not p.dead]
    for p in [p for p in live if p.role == ROLE_DRAINING]:
        until = (p.draining_since or -math.inf) + target.drain_seconds
        if now is not None and now >= until:
            st.actions.append(DeletePod(p.name, "Drained"))
        elif now is not None:
            st.recheck.append(until)
    live = [p for p in live if p.role != ROLE_DRAINING]

    # 2. the warm gate
    for p in live:
        if p.gate != _ready(p):
            st.actions.append(SetWarmGate(p.name, _ready(p)))

    st.serving = [p for p in live if p.role == ROLE_SERVING]
    for p in live:
        if p.role != ROLE_SERVING:
            if p.role != ROLE_WARM:  # role label lost or edited by hand: back into the pool
                st.actions.append(Relabel(p.name, ROLE_WARM, "Adopted"))
                p = replace(p, role=ROLE_WARM)
            st.warm.append(p)

    # 3. failover
    if now is not None:
        for p in st.serving + st.warm:
            found = failing_since(p, p.role == ROLE_SERVING)
            if found is None:
                continue
            since, why = found
            if now >= since + target.unready_seconds:
                st.failing[p.name] = found
            else:
                st.recheck.append(since + target.unready_seconds)
    for p in sorted((p for p in st.serving if p.name in st.failing),
                    key=lambda p: st.failing[p.name][0]):
        candidates = st.current_warm_ready()
        if not candidates or not st.failover_allowed():
            break
        st.promote(candidates[0])
        st.serving.remove(p)
        st.actions.append(DeletePod(p.name, "FailedOver"))
        st.failed_over(p.name, candidates[0].name, st.failing.pop(p.name)[1])
    for p in [p for p in st.warm if p.name in st.failing]:
        if not st.failover_allowed():
            break
        st.warm.remove(p)
        st.actions.append(DeletePod(p.name, "FailedOver"))
        st.failed_over(p.name, "", st.failing.pop(p.name)[1])
    # A serving pod still starting makes way for a ready warm one (and keeps warming).
    for p in [p for p in st.serving if not _ready(p) and p.name not in st.failing
              and p.template_hash == st.H and failing_since(p, True) is None]:
        candidates = st.current_warm_ready()
        if not candidates:
            break
        st.promote(candidates[0])
        st.serving.remove(p)
        st.warm.append(replace(p, role=ROLE_WARM))
        st.actions.append(Relabel(p.name, ROLE_WARM, "Demoted"))

    while True:
        before = len(st.actions)
        _serving_count(st)
        _rollout(st)
        _pool(st)
        if len(st.actions) == before:
            break

    future = [t for t in st.recheck if now is None or t > now]
    return Plan(actions=st.actions, history=st.history,
                recheck_at=min(future) if future else None,
                backoff_until=st.backoff_until,
                failing=tuple(sorted(n for n in st.failing
                                     if any(p.name == n for p in st.serving))),
                failovers=tuple(st.failovers))


def _serving_count(st: _State) -> None:
    t = st.target
    if len(st.serving) < t.replicas:
        deficit = t.replicas - len(st.serving)
        # Never an outdated pod, nor one that would count as failing once serving (the
        # scheduler cannot place it, its container crashed): it would only be failed over.
        usable = [p for p in st.warm if p.template_hash == st.H and p.name not in st.failing
                  and failing_since(p, True) is None and not _is_phantom(p)]
        for p in _by_preference_to_promote(usable)[:deficit]:
            st.promote(p)
            deficit -= 1
        st.create(ROLE_SERVING, "ScaledUp", deficit)
    elif len(st.serving) > t.replicas:
        failing = frozenset(st.failing)
        for p in _by_preference_to_keep(st.serving, st.H, failing)[: len(st.serving) - t.replicas]:
            pool_ok = [q for q in st.warm if q.name not in st.failing]
            if _ready(p) and p.name not in failing and p.template_hash == st.H and \
                    len(pool_ok) < t.warm_pool and not _is_phantom(p):
                st.serving.remove(p)
                st.warm.append(replace(p, role=ROLE_WARM))
                st.actions.append(Relabel(p.name, ROLE_WARM, "Demoted"))
            elif _is_phantom(p):
                continue  # never happens: phantoms fill a deficit, not a surplus
            else:
                st.leave(p, "ScaledDown")


def _rolling(st: _State) -> bool:
    return any(p.template_hash != st.H for p in st.serving + st.warm)


def _rollout(st: _State) -> None:
    t = st.target
    if not _rolling(st):
        return
    # Outdated warm pods can never be promoted again: they go at once, making room.
    for p in [p for p in st.warm if p.template_hash != st.H]:
        st.warm.remove(p)
        st.actions.append(DeletePod(p.name, "RolledOut"))
    budget = t.replicas + t.warm_pool + t.max_surge
    while True:
        old = [p for p in st.serving if p.template_hash != st.H]
        fresh = [p for p in st.current_warm_ready() if _serves_now(p)]
        if not old or not fresh:
            break
        starting = any(p.template_hash == st.H and not _ready(p) for p in st.warm)
        room = budget - len(st.serving) - len(st.warm)
        # Keep warm_pool ready new pods standing by while more can still start.
        if len(fresh) <= t.warm_pool and (room > 0 or starting):
            break
        victim = _by_preference_to_keep(old, st.H, frozenset(st.failing))[0]
        st.promote(fresh[0])
        st.leave(victim, "RolledOut")
    # maxUnavailable: outdated serving pods may go ahead of their replacement while no more
    # than that many ready serving pods are missing.
    while t.max_unavailable > 0:
        old = [p for p in st.serving if p.template_hash != st.H]
        if not old:
            break
        victim = _by_preference_to_keep(old, st.H, frozenset(st.failing))[0]
        ready = sum(_ready(p) and p.name not in st.failing for p in st.serving)
        after = ready - (1 if _ready(victim) and victim.name not in st.failing else 0)
        if after < t.replicas - t.max_unavailable:
            break
        st.leave(victim, "RolledOut")


def _pool(st: _State) -> None:
    t = st.target
    ok = [p for p in st.warm if p.name not in st.failing]
    uncovered = sum(1 for p in st.serving if p.name in st.failing)
    old_serving = sum(p.template_hash != st.H for p in st.serving)
    if old_serving:
        # Surge: new pods start in the pool, within replicas + warm_pool + max_surge pods.
        budget = t.replicas + t.warm_pool + t.max_surge
        room = max(0, budget - len(st.serving) - len(st.warm))
        want = t.warm_pool + min(t.max_surge, old_serving)
        n = min(room, want - len(ok))
        n = max(n, t.warm_pool + uncovered - len(ok))  # failover comes before the budget
        st.create(ROLE_WARM, "PoolBackfill", n)
        return
    target = t.warm_pool + uncovered
    if len(ok) < target:
        st.create(ROLE_WARM, "PoolBackfill", target - len(ok))
        return
    # One at a time, most expendable first (unready, then newest).
    while len(ok) > target:
        candidates = [p for p in _by_preference_to_keep(ok, st.H) if not _is_phantom(p)]
        if not candidates:
            break
        p = candidates[0]
        ok.remove(p)
        st.warm.remove(p)
        st.actions.append(DeletePod(p.name, "PoolShrunk"))


def desired_state(target: Target, observed: list[PodView], now: float | None = None,
                  history: FailoverHistory = FailoverHistory()) -> list[Action]:
    """The actions of plan(); for callers that need nothing else."""
    return plan(target, observed, now, history).actions
