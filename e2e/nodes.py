"""The harness's nodes (TEST HARNESS): names only, shared by the scheduler, the kubelet and
the node controller. There are no Node objects in the API emulator; a node is where the
local kubelet says a pod runs (spec.nodeName), and "losing" one is what the harness does
to its pods (see docs/e2e.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from e2e.placement import NodeInfo

DEFAULT_NODES = ("node-a", "node-b", "node-c")


@dataclass
class ClusterNodes:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)

    @classmethod
    def named(cls, names: tuple[str, ...] = DEFAULT_NODES) -> ClusterNodes:
        return cls({n: NodeInfo(n) for n in names})

    def all(self) -> list[NodeInfo]:
        return list(self.nodes.values())

    def lost(self, name: str) -> bool:
        return name in self.nodes and self.nodes[name].lost

    def lose(self, name: str) -> None:
        self.nodes[name] = replace(self.nodes[name], lost=True)

    def restore(self, name: str) -> None:
        self.nodes[name] = replace(self.nodes[name], lost=False)
