"""A tiny in-memory world for the decision function: apply actions, play the kubelet."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from preheat.operator.decide import Action, CreatePod, DeletePod, Relabel, SetWarmGate, Target
from preheat.operator.pods import PodView


@dataclass
class World:
    hash: str = "v1"
    pods: dict[str, PodView] = field(default_factory=dict)
    clock: int = 0

    def add(self, role: str, ready: bool = False, hash: str | None = None,
            phase: str = "Running") -> PodView:
        self.clock += 1
        name = f"p{self.clock:04d}"
        self.pods[name] = PodView(name=name, role=role, template_hash=hash or self.hash,
                                  created=f"2025-01-01T00:{self.clock // 60:02d}:{self.clock % 60:02d}Z",
                                  phase=phase, containers_ready=ready, gate=ready)
        return self.pods[name]

    def apply(self, actions: list[Action], new_hash: str) -> None:
        for a in actions:
            if isinstance(a, CreatePod):
                self.add(a.role, ready=False, hash=new_hash, phase="Pending")
            elif isinstance(a, DeletePod):
                del self.pods[a.pod]  # the kubelet's graceful termination is not modelled
            elif isinstance(a, Relabel):
                self.pods[a.pod] = replace(self.pods[a.pod], role=a.role)
            elif isinstance(a, SetWarmGate):
                self.pods[a.pod] = replace(self.pods[a.pod], gate=a.warm)

    def warm_up(self, names: list[str] | None = None) -> None:
        """The kubelet sees /ready turn 200 on these pods (default: all)."""
        for n in names if names is not None else list(self.pods):
            self.pods[n] = replace(self.pods[n], phase="Running", containers_ready=True)

    def observed(self) -> list[PodView]:
        return list(self.pods.values())

    def serving(self, ready: bool | None = None) -> list[PodView]:
        return [p for p in self.pods.values() if p.role == "serving"
                and (ready is None or p.containers_ready == ready)]

    def warm(self, ready: bool | None = None) -> list[PodView]:
        return [p for p in self.pods.values() if p.role == "warm"
                and (ready is None or p.containers_ready == ready)]


def settle(world: World, target: Target, desired_state, max_rounds: int = 200) -> int:
    """Reconcile, then let every pod warm up, until nothing is left to do; returns rounds."""
    for rounds in range(1, max_rounds + 1):
        actions = desired_state(target, world.observed())
        if not actions and all(p.containers_ready for p in world.pods.values()):
            return rounds
        world.apply(actions, target.template_hash)
        world.warm_up()
    raise AssertionError(f"did not converge in {max_rounds} rounds: {world.pods}")
