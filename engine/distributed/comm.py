"""The collectives every tensor-parallel rank takes part in, in one place.

Two process groups: the *compute* group (NCCL on GPUs, gloo on CPU) carries the all-reduces
inside the forward pass; the *control* group (always gloo, on host tensors; the same group
as compute on CPU) carries rank 0's messages (engine/distributed/messages.py) and the KV
moved for snapshots and the L2/L3 tiers. Rank 0 drives: it sends, the workers receive and
follow, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from preheat.engine.distributed.messages import HEADER, MIN_CAPACITY, Op, frame, grown_capacity, unframe

# Which interface the collectives' sockets bind: set to loopback unless the operator chose one.
LOOPBACK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

log = logging.getLogger(__name__)


class TensorParallelFailure(RuntimeError):
    """A rank is gone or a collective failed: the engine cannot go on (it is declared dead,
    /health answers 503, and the pod is restarted)."""


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sums a row-parallel layer's partial output over the ranks (the compute group), in
    place: `DecoderLayer.reduce` on every rank."""
    dist.all_reduce(t)
    return t


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """Rank r of a GPU engine on cuda:i runs on cuda:i+r; on CPU every rank runs on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class Comm:
    """One rank's end of the groups. Created after `init_process_group` on every rank, in
    the same order (new_group is itself a collective)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.ctrl: Any = dist.new_group(backend="gloo") if backend_for(device) != "gloo" else None
        self.capacity = MIN_CAPACITY

    @staticmethod
    def init(store: Any, rank: int, size: int, device: torch.device, timeout_s: float) -> Comm:
        # The ranks are processes of one pod: their sockets stay on the loopback interface
        # (gloo's pairs, NCCL's bootstrap), never reachable from the pod network.
        for var in LOOPBACK_ENV:
            os.environ.setdefault(var, "lo")
        dist.init_process_group(
            backend_for(device), store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s),
            **({"device_id": device} if device.type == "cuda" else {}),
        )  # fmt: skip
        return Comm(rank, size, device)

    # ------------------------------------------------------------ messages (rank 0 -> workers)

    def send(self, op: Op, payload: torch.Tensor | None = None) -> None:
        """Rank 0: one broadcast (two when the message outgrows the agreed capacity)."""
        payload = torch.zeros(0, dtype=torch.int64) if payload is None else payload
        grown = grown_capacity(self.capacity, HEADER + payload.numel())
        if grown is not None:
            dist.broadcast(frame(Op.RESIZE, torch.zeros(0, dtype=torch.int64), self.capacity, grown), 0,
                           group=self.ctrl)  # fmt: skip
            self.capacity = grown
        dist.broadcast(frame(op, payload, self.capacity, self.capacity), 0, group=self.ctrl)

    def receive(self) -> tuple[Op, torch.Tensor]:
        """A worker: the next message (RESIZE handled here)."""
        while True:
            buf = torch.empty(self.capacity, dtype=torch.int64)
            dist.broadcast(buf, 0, group=self.ctrl)
            op, payload, self.capacity = unframe(buf)
            if op is not Op.RESIZE:
                return op, payload

    # ------------------------------------------------------------ KV pages (host tensors)

    def gather_to_rank0(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `local` (same shape and dtype on all ranks) on rank 0; None elsewhere.
        Travels as bytes, so any KV dtype (fp8 too) does."""
        data = local.contiguous().view(torch.uint8)
        parts = [torch.empty_like(data) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(data, parts, dst=0, group=self.ctrl)
        if parts is None:
            return None
        return [p.view(local.dtype).view(local.shape) for p in parts]

    def scatter_from_rank0(self, parts: list[torch.Tensor] | None, like: torch.Tensor) -> torch.Tensor:
        """Rank 0 hands parts[r] to rank r; every rank gets a tensor shaped and typed `like`."""
        out = torch.empty_like(like.contiguous().view(torch.uint8))
        chunks = [p.contiguous().view(torch.uint8) for p in parts] if self.rank == 0 and parts is not None else None
        dist.scatter(out, chunks, src=0, group=self.ctrl)
        return out.view(like.dtype).view(like.shape)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # peers already gone: nothing left to tear down cleanly
                log.debug("destroy_process_group: %s", exc)
