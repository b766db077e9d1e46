"""The collectives a save or load needs, on whatever process group the trainer set up.

Everything goes through ``torch.distributed``: NCCL with CUDA tensors in production,
gloo on CPU in tests. Without an initialized process group, shardstore runs as a
single rank and every collective is trivial, so a checkpoint can be saved or loaded
from a plain script.

Tensors that travel through a collective live on the device the backend needs (CUDA
for NCCL, CPU otherwise); nothing here calls a CUDA-only function unconditionally.

A save and a load call these only through ``protocol.stage.run_stage``, which makes a
failure on any rank the same error on every rank (a bare collective leaves the peers of
a rank that gave up waiting until the process group times out). Outside a save and a
load: Megatron's ``exchange_utils`` helpers (the fully-parallel wrappers around other
libraries' strategies), the async queue's and the checkpoint manager's small
agreements.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardstore.errors import CheckpointingException


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, in a form that survives pickling across ranks."""

    rank: int
    message: str
    details: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, f"{type(exc).__name__}: {exc}", details)


class Group:
    """A view of a process group (or of a single process when none is initialized)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        if self.active:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1

    @classmethod
    def local(cls) -> Group:
        """This process alone: every collective is trivial (for calls that any single
        rank may make, such as ``load_plain_tensors``)."""
        group = cls.__new__(cls)
        group.active, group.process_group, group.rank, group.world_size = False, None, 0, 1
        return group

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that writes the commit record and other single files."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where tensors must live to travel through this group's collectives."""
        if self.active and dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        if not self.active or self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with _peer_failures("all-gather"):
            dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on the coordinator (an empty list elsewhere): what only
        the coordinator needs travels only to it."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        with _peer_failures("gather"):
            dist.gather_object(obj, out, dst=self.global_rank(0), group=self.process_group)
        return out or []

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """The coordinator's ``objs[r]`` on group rank ``r`` (``objs`` is read on the
        coordinator only): each rank receives its own part, not everyone's."""
        if self.world_size == 1:
            return objs[0]
        out: list[Any] = [None]
        with _peer_failures("scatter"):
            dist.scatter_object_list(
                out, objs if self.is_coordinator else None, src=self.global_rank(0), group=self.process_group
            )
        return out[0]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from group rank ``src`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with _peer_failures("broadcast"):
            dist.broadcast_object_list(box, src=self.global_rank(src), group=self.process_group)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Collective, in place: group rank ``src``'s ``tensor`` lands in every rank's
        ``tensor`` (same shape and dtype on every rank, contiguous, on ``device``)."""
        if self.world_size == 1:
            return
        with _peer_failures("broadcast"):
            dist.broadcast(tensor, src=self.global_rank(src), group=self.process_group)

    def reduce_over_ranks(self, values: Sequence[int], op: str, what: str) -> list[int]:
        """Collective: the elementwise ``op`` (``"min"`` or ``"max"``) of every rank's
        ``values`` (small integers, one all-reduce on the group's device, so NCCL groups
        work too); e.g. how many async saves finished everywhere, or whether any rank
        asks for a save (``max`` of flags)."""
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        with _peer_failures(what):
            dist.all_reduce(tensor, op=reduce_op, group=self.process_group)
        return [int(v) for v in tensor.tolist()]

    def barrier(self) -> None:
        if self.world_size > 1:
            with _peer_failures("barrier"):
                dist.barrier(group=self.process_group)

    def exchange(self, sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]]) -> None:
        """Collective among the ranks named: ``sends[peer]`` (this rank's tensors for
        ``peer``) land in the preallocated ``receives[peer]`` of ``peer``, in order. One
        packed byte buffer per pair of ranks, so thousands of small tensors cost one
        message, not thousands."""
        ops, landed = [], []
        for peer, tensors in sorted(sends.items()):
            packed = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors]).to(self.device)
            ops.append(dist.P2POp(dist.isend, packed, self.global_rank(peer), self.process_group))
        for peer, tensors in sorted(receives.items()):
            buffer = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer), self.process_group))
            landed.append((buffer, tensors))
        if not ops:
            return
        with _peer_failures("exchange"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buffer, tensors in landed:
            at = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                t.detach().reshape(-1).view(torch.uint8).copy_(buffer[at : at + n])  # also into a parameter
                at += n


@contextmanager
def _peer_failures(what: str) -> Iterator[None]:
    """A collective that fails because a peer died or timed out (the backend's
    connection error or timeout) becomes a CheckpointingException that says so."""
    try:
        yield
    except (RuntimeError, ConnectionError) as exc:  # DistBackendError is a RuntimeError
        raise CheckpointingException(
            f"Lost contact with the other ranks during a checkpoint {what}: a rank died, was "
            f"killed or timed out ({exc}). The checkpoint being saved is not committed."
        ) from exc


class StageFailed(CheckpointingException):
    """A failure every rank of a collective stage knows of: each raises it with the same
    message, naming the failing ranks (so a caller may act on it, e.g. the coordinator
    deletes what the save wrote, without racing a rank that is still at work)."""


def failure_message(failures: list[RankFailure], what: str) -> str:
    """What every rank says when ``failures`` ended the step ``what``."""
    ranks = ", ".join(str(f.rank) for f in failures)
    lines = "\n".join(f"  rank {f.rank}: {f.message}" for f in failures)
    return f"{what} failed on rank(s) {ranks}:\n{lines}"
