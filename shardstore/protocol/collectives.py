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

How long a rank waits for its peers is bounded by ONE budget per stage, not per call:
the process group's own timeout (``dist.init_process_group(timeout=...)``) covers all
the waiting of one stage together (``WaitBudget``; a call outside a stage has a budget
of its own). A peer lost for good (dead, or unanswering past the budget) marks the
process group lost: every later collective on it raises at once, so callers that agree
on an earlier failure cannot stack one timeout after another. A peer killed on a host
whose kernel closes its connections is seen at once by the backend.
"""

from __future__ import annotations

__all__ = [
    "OWN_MESSAGE_BYTES", "SLOTS_BYTES", "SLOT_BYTES", "Group", "PeerLost", "PreparedExchange", "RankFailure", "StageFailed", "WaitBudget",
    "failure_message", "travels_packed",
]

import os
import pickle
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardstore.errors import CheckpointingException
from shardstore.format.dtypes import byte_view, holds_its_values
from shardstore.progress import current_operation

# Byte order and width of the length that precedes each pickled message.
_LENGTH_BYTES = 8

# The bytes each rank's message gets in one call of ``Group.gather_to_answer``, and of a
# scatter or broadcast of objects, at first: what fits travels in one call, the size
# inside it; the rest in one call more. A group's slot then grows to the largest message
# its ranks exchanged (a plan's records of a few thousand tensors, a commit's checksums),
# told to every rank inside the reply they all receive, so the next save fits; within
# SLOTS_BYTES over all ranks, what the coordinator receives in one call.
SLOT_BYTES = 16 << 10
SLOTS_BYTES = 64 << 20
# Each process group's slot (``_group_key``), as its ranks last agreed on it. What
# shardstore keeps of a group it holds weakly (here and in ``_LOST``): a group held
# strongly outlives ``destroy_process_group`` with its backend's threads (gloo's), which
# can then abort the process at exit ("terminate called without an active exception").
_SLOTS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


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


class PeerLost(CheckpointingException):
    """A collective that lost a peer: it died, was killed, or did not answer within the
    wait budget. The process group is unusable from then on (``Group`` raises this
    again, at once, for every later collective on it)."""


@dataclass
class WaitBudget:
    """How long one rank may still wait for its peers, over every collective of one
    stage together (seconds; only time spent inside collectives counts, not the rank's
    own work between them)."""

    seconds: float
    spent: float = field(default=0.0)

    def remaining(self) -> float:
        """Seconds left (0 when spent)."""
        return max(0.0, self.seconds - self.spent)


# The process groups that lost a peer (``PeerLost``), and what their first loss said.
# Keyed, weakly, by the group object (for None: the default group as of the loss).
_LOST: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class Group:
    """A view of a process group (or of a single process when none is initialized).

    Every collective waits for its peers at most ``budget``'s remaining seconds (a
    budget of one process-group timeout per call when none is given) and raises
    ``PeerLost`` when a peer is lost."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        self.budget: WaitBudget | None = None
        self.pid = os.getpid()  # the process whose process group this is (not a fork of it)
        if self.active:
            self.rank = dist.get_rank(process_group)
            if self.rank < 0:
                raise CheckpointingException(
                    f"Global rank {dist.get_rank()} is not in the process group it was given (torch.distributed."
                    "new_group returns GroupMember.NON_GROUP_MEMBER to the ranks outside a group): only the group's "
                    "ranks save, load or agree on it; call from those ranks, or pass this rank's own group"
                )
            self.world_size = dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1

    @classmethod
    def local(cls) -> Group:
        """This process alone: every collective is trivial (for calls that any single
        rank may make, such as ``load_plain_tensors``)."""
        group = cls.__new__(cls)
        group.active, group.process_group, group.rank, group.world_size = False, None, 0, 1
        group.budget = None
        group.pid = os.getpid()
        return group

    def budgeted(self, budget: WaitBudget) -> Group:
        """This group, its collectives sharing ``budget`` (one stage's)."""
        view = Group.__new__(Group)
        view.__dict__.update(self.__dict__)
        view.budget = budget
        return view

    def new_budget(self) -> WaitBudget:
        """One stage's budget: the process group's timeout."""
        return WaitBudget(self.timeout_seconds())

    def timeout_seconds(self) -> float:
        """The process group's timeout (what its creator set), in seconds."""
        if not self.active:
            return 0.0
        pg = self.process_group or dist.distributed_c10d._get_default_group()
        try:
            timeout = pg._get_backend(self.device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options: torch's default
            timeout = dist.distributed_c10d._get_default_timeout(dist.get_backend(self.process_group))
        return timeout.total_seconds()

    def key_value_store(self) -> dist.Store | None:
        """The store the process group was created with (``init_process_group``'s
        rendezvous), for what ranks must tell each other outside any collective
        (``protocol.stopped_writers``); None when this process has no process group
        (one rank, or a writer process a save was handed to: spawned, or forked, whose
        copy of the store's connection is the training process's)."""
        if not (self.active and dist.is_initialized()) or not self.in_its_process:
            return None
        return dist.distributed_c10d._get_default_store()

    @property
    def in_its_process(self) -> bool:
        """Whether this is the process the group was made in, not a writer process a
        save was handed to (forked, or spawned and given this group pickled)."""
        return os.getpid() == self.pid

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
        """Every rank's ``obj`` (picklable) on every rank, by group rank."""
        if self.world_size == 1:
            return [obj]
        payload = self._encode(obj)
        sizes = self._all_sizes(payload, "all-gather")
        gathered = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        padded = self._padded(payload, max(sizes))
        self._wait("all-gather", dist.all_gather(gathered, padded, group=self.process_group, async_op=True))
        return [_decode(g) for g in gathered]

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on the coordinator (an empty list elsewhere): what only
        the coordinator needs travels only to it."""
        if self.world_size == 1:
            return [obj]
        payload = self._encode(obj)
        sizes = self._all_sizes(payload, "gather")
        out = ([torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
               if self.is_coordinator else None)
        work = dist.gather(self._padded(payload, max(sizes)), out, dst=self.global_rank(0),
                           group=self.process_group, async_op=True)
        self._wait("gather", work)
        return [_decode(g) for g in out] if out is not None else []

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """The coordinator's ``objs[r]`` on group rank ``r`` (``objs`` is read on the
        coordinator only): each rank receives its own part, not everyone's. One
        ``scatter`` when every part fits the group's slot (``SLOT_BYTES`` at first),
        else two."""
        if self.world_size == 1:
            return objs[0]
        parts = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs] if self.is_coordinator else None
        return pickle.loads(self._deliver_bytes(parts, scatter=True)[0])  # noqa: S301  (a peer of this job's)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from group rank ``src`` on every rank: one ``broadcast`` when it fits
        the group's slot, else two."""
        if self.world_size == 1:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else None
        return pickle.loads(self._deliver_bytes(data, scatter=False, src=src)[0])  # noqa: S301

    def gather_to_answer(
        self, message: bytes, answer: Callable[[list[bytes]], bytes | list[bytes]], *, scatter: bool
    ) -> bytes:
        """Collective: every rank's ``message`` to the coordinator, whose ``answer`` of
        them all (by group rank) comes back: one part per rank (``scatter``: rank r
        receives part r) or one reply for every rank. Returns this rank's part.

        Two calls when every message fits the group's slot (the sizes travel inside
        it); a message beyond it two more, a reply beyond it one more, and the slot
        grows for the next call (``SLOT_BYTES``).
        ``answer`` runs on the coordinator only and must not raise: a failure travels
        in its reply (``protocol.stage`` does so), or the peers wait for the timeout."""
        if self.world_size == 1:
            reply = answer([message])
            return reply[0] if scatter else reply
        _raise_if_lost(self.process_group)
        framed = len(message).to_bytes(_LENGTH_BYTES, "little") + message
        slot = self.slot_bytes()
        heads = self._gather_bytes(framed[:slot], slot)
        if not self.is_coordinator:
            while True:
                part, rest = self._deliver_bytes(None, scatter=scatter)
                if not rest:
                    return part
                self._gather_bytes(framed[slot:], rest)  # the coordinator asked for the rest
        sizes = [_LENGTH_BYTES + int.from_bytes(h[:_LENGTH_BYTES], "little") for h in heads]
        rest = max(sizes) - slot
        if rest > 0:  # some message did not fit: everyone sends what its slot did not hold
            self._deliver_bytes([b""] * self.world_size if scatter else b"", scatter=scatter, rest=rest)
            heads = [h + r for h, r in zip(heads, self._gather_bytes(framed[slot:], rest), strict=True)]
        reply = answer([h[_LENGTH_BYTES:n] for h, n in zip(heads, sizes, strict=True)])
        return self._deliver_bytes(reply, scatter=scatter, grow_to=max(sizes))[0]

    def slot_bytes(self) -> int:
        """The bytes each rank's message gets in one call of ``gather_to_answer`` and
        of an object scatter or broadcast, alike on every rank of the group (``SLOT_BYTES``)."""
        return _of_group(_SLOTS, self.process_group, SLOT_BYTES)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Collective, in place: group rank ``src``'s ``tensor`` lands in every rank's
        ``tensor`` (same shape and dtype on every rank, contiguous, on ``device``)."""
        if self.world_size == 1:
            return
        _raise_if_lost(self.process_group)
        self._wait("broadcast", dist.broadcast(tensor, src=self.global_rank(src), group=self.process_group,
                                               async_op=True))

    def reduce_over_ranks(self, values: Sequence[int], op: str, what: str) -> list[int]:
        """Collective: the elementwise ``op`` (``"min"`` or ``"max"``) of every rank's
        ``values`` (small integers, one all-reduce on the group's device, so NCCL groups
        work too); e.g. how many async saves finished everywhere, or whether any rank
        asks for a save (``max`` of flags)."""
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        _raise_if_lost(self.process_group)
        self._wait(what, dist.all_reduce(tensor, op=reduce_op, group=self.process_group, async_op=True))
        return [int(v) for v in tensor.tolist()]

    def barrier(self) -> None:
        if self.world_size > 1:
            _raise_if_lost(self.process_group)
            self._wait("barrier", dist.barrier(group=self.process_group, async_op=True))

    # ------------------------------------------------------------ waiting, bounded

    def _wait(self, what: str, work: Any) -> None:
        """Waits for ``work`` (an async collective) within the budget; a lost peer or an
        exhausted budget raises ``PeerLost`` and marks the process group lost."""
        budget = self.budget or self.new_budget()
        start = time.monotonic()
        try:
            if budget.remaining() <= 0:  # a wait of 0 would be no timeout at all to c10d
                raise RuntimeError("no time left to wait")
            work.wait(timeout=timedelta(seconds=budget.remaining()))
        except (RuntimeError, ConnectionError) as exc:  # DistBackendError is a RuntimeError
            raise _lose(self.process_group, what, budget, exc) from exc
        finally:
            budget.spent += time.monotonic() - start

    def _all_sizes(self, payload: torch.Tensor, what: str) -> list[int]:
        """Every rank's message size (bytes), by group rank."""
        _raise_if_lost(self.process_group)
        mine = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        self._wait(what, dist.all_gather(sizes, mine, group=self.process_group, async_op=True))
        return [int(s.item()) for s in sizes]

    def _gather_bytes(self, data: bytes, size: int) -> list[bytes]:
        """Collective: every rank's ``data`` (at most ``size`` bytes, zero-padded to it)
        on the coordinator, by group rank (an empty list elsewhere)."""
        out = ([torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
               if self.is_coordinator else None)
        work = dist.gather(self._padded(_on_device(data, self.device), size), out, dst=self.global_rank(0),
                           group=self.process_group, async_op=True)
        self._wait("gather", work)
        return [_host_bytes(o) for o in out] if out is not None else []

    def _deliver_bytes(
        self, reply: bytes | list[bytes] | None, *, scatter: bool, src: int = 0, rest: int = 0, grow_to: int = 0
    ) -> tuple[bytes, int]:
        """Collective: group rank ``src``'s ``reply`` (read there only; one part per
        rank to ``scatter``) on every rank, and ``rest``: how many bytes the sender asks
        every rank to send it next (``gather_to_answer``). One call of the group's slot;
        a second one for what a slot did not hold, whose size every slot says, as it
        says the slot every rank uses from then on (grown to fit ``grow_to`` bytes and
        this reply, within ``SLOTS_BYTES``)."""
        _raise_if_lost(self.process_group)
        slot = self.slot_bytes()
        mine = tail = heads = tails = None
        if self.rank == src:
            parts = reply if scatter else [reply]
            framed = [_framed(p, rest) for p in parts]
            longest = max(len(f) for f in framed) + _SLOT_HEADER_BYTES
            tail_bytes = longest - slot
            header = _slot_header(tail_bytes, self._grown(slot, max(longest, grow_to)))
            body = slot - _SLOT_HEADER_BYTES
            heads = [self._padded(_on_device(header + f[:body], self.device), slot) for f in framed]
            tails = [self._padded(_on_device(f[body:], self.device), max(tail_bytes, 0)) for f in framed]
            mine, tail = heads[self.rank if scatter else 0], tails[self.rank if scatter else 0]
        head = self._one_call(mine, heads, scatter, src, slot)
        tail_bytes = int.from_bytes(head[:_LENGTH_BYTES], "little", signed=True)
        next_slot = int.from_bytes(head[_LENGTH_BYTES:_SLOT_HEADER_BYTES], "little")
        data = head[_SLOT_HEADER_BYTES:]
        if tail_bytes > 0:
            data += self._one_call(tail, tails, scatter, src, tail_bytes)
        _SLOTS[_group_key(self.process_group)] = next_slot  # every rank of the group read the same
        rest_asked = int.from_bytes(data[:_LENGTH_BYTES], "little")
        length = int.from_bytes(data[_LENGTH_BYTES:2 * _LENGTH_BYTES], "little")
        return data[2 * _LENGTH_BYTES: 2 * _LENGTH_BYTES + length], rest_asked

    def _grown(self, slot: int, needed: int) -> int:
        """The slot after a call that needed ``needed`` bytes of it: the next power of
        two that holds them, never smaller than ``slot``, within ``SLOTS_BYTES`` over
        the group's ranks."""
        most = max(SLOT_BYTES, SLOTS_BYTES // self.world_size)
        return max(slot, min(1 << max(needed - 1, 1).bit_length(), most))

    def _one_call(
        self, mine: torch.Tensor | None, parts: list[torch.Tensor] | None, scatter: bool, src: int, size: int,
    ) -> bytes:
        """One ``scatter`` of ``parts`` or ``broadcast`` of ``mine`` (``size`` bytes
        each) from group rank ``src``; what this rank received."""
        box = mine if mine is not None and not scatter else torch.empty(size, dtype=torch.uint8, device=self.device)
        if scatter:
            work = dist.scatter(box, parts, src=self.global_rank(src), group=self.process_group, async_op=True)
        else:
            work = dist.broadcast(box, src=self.global_rank(src), group=self.process_group, async_op=True)
        self._wait("scatter" if scatter else "broadcast", work)
        return _host_bytes(box)

    def _encode(self, obj: Any) -> torch.Tensor:
        """``obj`` pickled, after its length, as bytes on the group's device."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        framed = len(data).to_bytes(_LENGTH_BYTES, "little") + data
        return torch.frombuffer(bytearray(framed), dtype=torch.uint8).to(self.device)

    def _padded(self, payload: torch.Tensor, size: int) -> torch.Tensor:
        """``payload`` extended to ``size`` bytes (collectives move equal sizes)."""
        if payload.numel() == size:
            return payload
        padded = torch.zeros(size, dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload
        return padded

    def exchange(self, sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]]) -> None:
        """Collective among the ranks named: ``sends[peer]`` (this rank's tensors for
        ``peer``) land in the preallocated ``receives[peer]`` of ``peer``, in order. Per
        pair of ranks, the tensors under ``OWN_MESSAGE_BYTES`` travel packed in one
        message, so thousands of small tensors cost one message, not thousands; larger
        ones travel as messages of their own, from and into their own memory where they
        lie on the group's device, contiguous (``prepare_exchange``, then
        ``run_exchange``)."""
        self.run_exchange(self.prepare_exchange(sends, receives))

    def prepare_exchange(
        self, sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]]
    ) -> PreparedExchange:
        """``exchange``'s local part: packs what this rank sends and allocates what it
        receives. Local, so a stage runs it before its agreement (``protocol.stage``):
        a rank out of memory here fails every rank at once, none waits for its sends.

        Both sides split a pair's tensors into the same messages, by size alone (the
        packed small ones first, then each large one, in order; tagged by position)."""
        ops, landed = [], []
        for peer, tensors in sorted(sends.items()):
            for tag, message in enumerate(_messages(tensors)):
                # one large tensor: a view of it where it is contiguous on the group's device
                payload = (byte_view(message[0]) if _alone(message) else torch.cat([byte_view(t) for t in message]))
                payload = payload.to(self.device)
                ops.append(dist.P2POp(dist.isend, payload, self.global_rank(peer), self.process_group, tag))
        for peer, tensors in sorted(receives.items()):
            for tag, message in enumerate(_messages(tensors)):
                if _alone(message) and self._lands_in_place(message[0]):
                    buffer = byte_view(message[0])  # a view: contiguous, as _lands_in_place checked
                else:
                    size = sum(t.numel() * t.element_size() for t in message)
                    buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
                    landed.append((buffer, message))
                ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer), self.process_group, tag))
        return PreparedExchange(ops, landed)

    def _lands_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether a message can be received straight into ``tensor``'s memory."""
        return tensor.device == self.device and holds_its_values(tensor)

    def run_exchange(self, prepared: PreparedExchange) -> None:
        """Collective: ``exchange``'s sends and receives, then the bytes received into
        buffers copied into their tensors."""
        if not prepared.ops:
            return
        _raise_if_lost(self.process_group)
        for work in dist.batch_isend_irecv(prepared.ops):
            self._wait("exchange", work)
        for buffer, tensors in prepared.landed:
            at = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                _land(t.detach(), buffer[at : at + n])  # detached: also into a parameter
                at += n


# A tensor of at least this many bytes travels in an exchange as a message of its own,
# sent from and received into its own memory where it can be (``Group.exchange``):
# packing it cost a copy on each side, and the sum of a rank's blocks at once (a sharded
# save gathers most of a rank's state). Smaller ones are packed, a message per pair.
OWN_MESSAGE_BYTES = 1 << 20


def _messages(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A pair's tensors as its messages, by size alone (both sides agree): those under
    ``OWN_MESSAGE_BYTES`` packed into the first (when there are any), then each larger
    one alone, in order."""
    small = [t for t in tensors if not _large(t)]
    return ([small] if small else []) + [[t] for t in tensors if _large(t)]


def travels_packed(nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` travels in an exchange packed with the pair's other
    small ones (a copy on each side), not as a message of its own."""
    return nbytes < OWN_MESSAGE_BYTES


def _large(tensor: torch.Tensor) -> bool:
    return not travels_packed(tensor.numel() * tensor.element_size())


def _alone(message: list[torch.Tensor]) -> bool:
    """Whether a message is one large tensor (``_messages``), not packed ones."""
    return len(message) == 1 and _large(message[0])


def _land(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Copies the bytes ``data`` into ``tensor``'s values, whatever its strides (a
    strided target's values are not one run of its memory: the bytes are read as its
    dtype first, from a copy aligned for it)."""
    if holds_its_values(tensor):
        byte_view(tensor).copy_(data)  # a view: the tensor holds its values in order
    else:
        tensor.copy_(data.clone().view(tensor.dtype).reshape(tensor.shape))


@dataclass(frozen=True)
class PreparedExchange:
    """An exchange packed and allocated (``Group.prepare_exchange``): the point-to-point
    operations, and each receive buffer with the tensors it fills."""

    ops: list[Any]
    landed: list[tuple[torch.Tensor, list[torch.Tensor]]]


def _framed(data: bytes, rest: int) -> bytes:
    """A reply as it travels: the rest asked for, its length, its bytes."""
    return rest.to_bytes(_LENGTH_BYTES, "little") + len(data).to_bytes(_LENGTH_BYTES, "little") + data


_SLOT_HEADER_BYTES = 2 * _LENGTH_BYTES


def _slot_header(tail_bytes: int, next_slot: int) -> bytes:
    """What a delivered slot starts with: the size of the call that carries what the
    slot does not hold (0 or less: none), and the group's slot from then on."""
    return tail_bytes.to_bytes(_LENGTH_BYTES, "little", signed=True) + next_slot.to_bytes(_LENGTH_BYTES, "little")


def _on_device(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _host_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes()


def _decode(message: torch.Tensor) -> Any:
    """What ``Group._encode`` framed (a peer of the same job pickled it, as
    ``torch.distributed``'s object collectives do)."""
    data = message.cpu().numpy().tobytes()
    length = int.from_bytes(data[:_LENGTH_BYTES], "little")
    return pickle.loads(data[_LENGTH_BYTES : _LENGTH_BYTES + length])  # noqa: S301


def _group_key(process_group: Any) -> Any:
    """The key of ``process_group`` in ``_LOST`` (the default group's object for None,
    so a new default group after ``destroy_process_group`` starts afresh)."""
    if process_group is not None:
        return process_group
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def _of_group(table: weakref.WeakKeyDictionary[Any, Any], process_group: Any, default: Any) -> Any:
    """``process_group``'s entry in ``table`` (``_SLOTS``, ``_LOST``); ``default``
    without one, or without a process group at all."""
    key = _group_key(process_group)
    return default if key is None else table.get(key, default)


def _raise_if_lost(process_group: Any) -> None:
    """Raises ``PeerLost`` at once when ``process_group`` already lost a peer."""
    message = _of_group(_LOST, process_group, None)
    if message is not None:
        raise PeerLost(f"{message} (an earlier collective of this process group lost it; it cannot be used again)")


def _lose(process_group: Any, what: str, budget: WaitBudget, exc: BaseException) -> PeerLost:
    """The ``PeerLost`` of a collective ``what`` that failed with ``exc``, the process
    group marked lost. The message names the operation (save or load) it was part of,
    and what that means for the checkpoint."""
    if isinstance(exc, PeerLost):
        return exc
    operation = current_operation()
    during = f"a checkpoint {operation}" if operation else "a checkpoint operation"
    consequence = {"save": " The checkpoint being saved is not committed.",
                   "load": " The load failed: nothing was loaded."}.get(operation or "", "")
    message = (
        f"Lost contact with the other ranks during {during} ({what}): a rank died, was killed or did not answer "
        f"within {budget.seconds:.0f} s, the process group's timeout ({exc}).{consequence}"
    )
    key = _group_key(process_group)
    if key is not None:  # None: the default group is gone already (destroyed), nothing to mark
        _LOST.setdefault(key, message)
    return PeerLost(message)


class StageFailed(CheckpointingException):
    """A failure every rank of a collective stage knows of: each raises it with the same
    message, naming the failing ranks (so a caller may act on it, e.g. the coordinator
    deletes what the save wrote, without racing a rank that is still at work)."""


def failure_message(failures: list[RankFailure], what: str) -> str:
    """What every rank says when ``failures`` ended the step ``what``."""
    ranks = ", ".join(str(f.rank) for f in failures)
    lines = "\n".join(f"  rank {f.rank}: {f.message}" for f in failures)
    return f"{what} failed on rank(s) {ranks}:\n{lines}"
