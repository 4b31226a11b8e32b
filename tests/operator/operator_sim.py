"""A tiny in-memory world for the decision function: apply actions, play the kubelet, and
move a clock (epoch seconds) for the time-based rules (failover grace, endpoint delay)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace

from preheat.operator.decide import (
    Action,
    CreatePod,
    DeletePod,
    FailoverHistory,
    Relabel,
    Retire,
    SetWarmGate,
    Target,
    plan,
)
from preheat.operator.pods import PodView

T0 = 1_735_689_600.0  # 2025-01-01T00:00:00Z


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class World:
    hash: str = "v1"
    pods: dict[str, PodView] = field(default_factory=dict)
    serial: int = 0
    now: float = T0
    history: FailoverHistory = field(default_factory=FailoverHistory)

    def add(self, role: str, ready: bool = False, hash: str | None = None,
            phase: str = "Running", tick: bool = True) -> PodView:
        self.serial += 1
        if tick:
            self.now += 1  # creation timestamps have second precision: keep them apart
        name = f"p{self.serial:04d}"
        self.pods[name] = PodView(name=name, role=role, template_hash=hash or self.hash,
                                  created=rfc3339(self.now), phase=phase,
                                  containers_ready=ready, gate=ready, was_warm=ready,
                                  containers_ready_changed=self.now,
                                  gate_changed=self.now if ready else None,
                                  ready_condition="True" if ready else "False",
                                  ready_changed=self.now)
        return self.pods[name]

    def tick(self, seconds: float) -> None:
        self.now += seconds

    def apply(self, actions: list[Action], new_hash: str) -> None:
        for a in actions:
            if isinstance(a, CreatePod):
                self.add(a.role, ready=False, hash=new_hash, phase="Pending", tick=False)
            elif isinstance(a, DeletePod):
                del self.pods[a.pod]  # the kubelet's graceful termination is not modelled
            elif isinstance(a, Relabel):
                self.pods[a.pod] = replace(self.pods[a.pod], role=a.role)
            elif isinstance(a, Retire):
                self.pods[a.pod] = replace(self.pods[a.pod], role="draining",
                                           draining_since=self.now)
            elif isinstance(a, SetWarmGate):
                p = self.pods[a.pod]
                self.pods[a.pod] = replace(p, gate=a.warm, was_warm=True, gate_changed=self.now,
                                           ready_condition="True" if a.warm and p.containers_ready
                                           else "False", ready_changed=self.now)

    def warm_up(self, names: list[str] | None = None) -> None:
        """The kubelet sees /ready turn 200 on these pods (default: all)."""
        for n in names if names is not None else list(self.pods):
            p = self.pods[n]
            if p.role == "draining" or p.containers_ready:
                continue
            self.pods[n] = replace(p, phase="Running", containers_ready=True,
                                   containers_ready_changed=self.now,
                                   unschedulable_since=None)

    def crash(self, name: str, died: bool = False) -> None:
        """The container restarted in place: unready from now. died: the kubelet also
        reported when it exited (real kubelets do); without it, only the restart count shows."""
        p = self.pods[name]
        self.pods[name] = replace(p, containers_ready=False, containers_ready_changed=self.now,
                                  restarts=p.restarts + 1, ready_condition="False",
                                  ready_changed=self.now,
                                  container_died_at=self.now if died else p.container_died_at)

    def hang(self, name: str) -> None:
        """The readiness probe fails (alive but stuck): unready from now, no restart."""
        p = self.pods[name]
        self.pods[name] = replace(p, containers_ready=False, containers_ready_changed=self.now,
                                  ready_condition="False", ready_changed=self.now)

    def lose_node(self, name: str) -> None:
        """The node controller marks the pod's Ready False; the containers look ready."""
        p = self.pods[name]
        self.pods[name] = replace(p, ready_condition="False", ready_changed=self.now)

    def unschedulable(self, name: str) -> None:
        p = self.pods[name]
        self.pods[name] = replace(p, phase="Pending", containers_ready=False,
                                  unschedulable_since=self.now,
                                  unschedulable_message="0/3 nodes are available")

    def observed(self) -> list[PodView]:
        return list(self.pods.values())

    def plan(self, target: Target):
        return plan(target, self.observed(), self.now, self.history)

    def step(self, target: Target) -> list[Action]:
        """One reconcile: plan at the current time, apply, remember the failover streak."""
        p = self.plan(target)
        self.history = p.history
        self.apply(p.actions, target.template_hash)
        return p.actions

    def serving(self, ready: bool | None = None) -> list[PodView]:
        return [p for p in self.pods.values() if p.role == "serving"
                and (ready is None or p.containers_ready == ready)]

    def warm(self, ready: bool | None = None) -> list[PodView]:
        return [p for p in self.pods.values() if p.role == "warm"
                and (ready is None or p.containers_ready == ready)]


def settle(world: World, target: Target, desired_state=None, max_rounds: int = 200) -> int:
    """Reconcile, then let every pod warm up and time pass, until nothing is left to do;
    returns rounds."""
    for rounds in range(1, max_rounds + 1):
        actions = world.plan(target).actions
        if not actions and all(p.containers_ready for p in world.pods.values()) and \
                not any(p.role == "draining" for p in world.pods.values()):
            return rounds
        world.step(target)
        world.warm_up()
        world.tick(1 + target.drain_seconds)
    raise AssertionError(f"did not converge in {max_rounds} rounds: {world.pods}")
