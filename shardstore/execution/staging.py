"""Host staging between the device and storage: the copies a save writes from, and
the pinned memory a load into device tensors reads into.

A synchronous save writes CPU tensors straight from the caller's memory (``to_host``
returns a view) and streams CUDA tensors, and CPU tensors whose memory does not hold
their values in order, through a bounded set of host buffers. An
async save must not keep pointing at the caller's memory: the caller may change its
tensors as soon as ``save`` returns, so ``HostSnapshot`` copies them.

CUDA tensors are copied into pinned buffers (``HostBufferPool``, exact sizes, reused by
later saves) on a dedicated copy stream that first waits for the work already queued on
the caller's stream, so a copy sees what the training step wrote, and never waits for a
device-wide ``synchronize()`` that would also drain other streams. Each batch of copies
is marked by an event (``HostSnapshot.mark``): the writer waits for that batch only,
while the next batch is still being copied.

Loads into CUDA tensors go the other way (``DeviceUploader``): chunks are read into a
pinned slab, and while that slab's host-to-device copies run on a copy stream, the next
wave is read into a second slab. Pinned memory stays within a configured bound, and the
device's DMA engine and the disk work at the same time instead of one after the other.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_LOAD_STAGING_BYTES", "DeviceUploader", "HostBufferPool", "HostSnapshot", "to_host",
]

import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from shardstore.execution.changes import changed_error, same_bytes
from shardstore.format.dtypes import values_in_order


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in CPU memory that holds them (``holds_its_values``): a view
    when it already does, else one copy."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return values_in_order(tensor)


class HostBufferPool:
    """Reusable host buffers by (shape, dtype); pinned for CUDA tensors, so the
    device-to-host copies run at full PCIe speed and without a fresh pin per save.

    Thread-safe: an async save's finalization may give its buffers back on another
    thread (``AsyncCallsQueue`` finalizing with ``no_dist``) while the training thread
    takes buffers for the next save.

    Args:
        max_free_bytes: the most bytes of returned buffers kept for reuse (the oldest
            are freed first); None: keep every returned buffer.
    """

    def __init__(self, max_free_bytes: int | None = None) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._returned: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest first, for eviction
        self._free_bytes = 0
        self._lock = threading.Lock()  # the three above change together

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``like``'s shape and dtype: a returned one, else a new one
        (pinned where ``like`` is a CUDA tensor)."""
        key = (tuple(like.shape), like.dtype)
        with self._lock:
            if self._free[key]:
                buffer = self._free[key].pop()
                del self._returned[id(buffer)]
                self._free_bytes -= buffer.nbytes
                return buffer
        pin = like.device.type == "cuda"
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """Keeps ``buffers`` (no longer read or written) for reuse, within ``max_free_bytes``."""
        with self._lock:
            for b in buffers:
                self._free[(tuple(b.shape), b.dtype)].append(b)
                self._returned[id(b)] = b
                self._free_bytes += b.nbytes
            while self.max_free_bytes is not None and self._free_bytes > self.max_free_bytes and self._returned:
                _, dropped = self._returned.popitem(last=False)
                same = self._free[(tuple(dropped.shape), dropped.dtype)]
                same[:] = [b for b in same if b is not dropped]
                self._free_bytes -= dropped.nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes held in buffers waiting for reuse."""
        return self._free_bytes

    def clear(self) -> None:
        """Frees every buffer waiting for reuse (pinned memory goes back to the system)."""
        with self._lock:
            self._free.clear()
            self._returned.clear()
            self._free_bytes = 0


class _Marks:
    """Events marking the copies issued so far, one per device's copy stream (none for
    CPU copies, which are complete when issued)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


class _CopyStreams:
    """A copy stream per CUDA device, made on first use, shared by a save's snapshot
    (device to host) and a load's uploader (host to device)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def get(self, device: torch.device) -> Any:
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device=device)
        return stream

    def after_caller(self, device: torch.device) -> Any:
        """The device's copy stream, ordered after the work queued so far on the
        caller's current stream (the step that wrote or still uses the tensors)."""
        stream = self.get(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def mark(self) -> _Marks:
        """What to wait for until the copies queued so far on every stream landed."""
        return _Marks([stream.record_event() for stream in self.streams.values()])


class HostSnapshot:
    """Copies tensors to host memory that the caller can no longer change.

    Each copy of a CPU tensor is compared with its source once it landed (``wait``,
    ``landed``): the copy is what the save writes, so a source changed meanwhile by a
    write that PyTorch's version counter does not see (``execution.changes``) fails the
    save. A CUDA tensor's copy is not: comparing would move every byte back to the
    device, doubling the time an async save blocks; its version counter still counts.

    Args:
        pool: where CUDA staging buffers come from and return to (None: fresh buffers).
        where: the checkpoint the copies are saved into, as errors name it.
    """

    def __init__(self, pool: HostBufferPool | None = None, where: str = "") -> None:
        self.pool, self.where = pool, where
        self.buffers: list[torch.Tensor] = []
        self._copies = _CopyStreams()
        self._unchecked: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # key, source, copy

    def copy(self, tensor: torch.Tensor, key: str | None = None) -> torch.Tensor:
        """A host copy of ``tensor``: the caller's data of the array ``key`` (as errors
        name it), compared with it once it landed; None: a copy of one of the save's own
        copies, not compared."""
        tensor = tensor.detach()
        if tensor.device.type == "cuda" and self.pool is not None:
            stream = self._copies.after_caller(tensor.device)
            out = self.pool.take(tensor)
            with torch.cuda.stream(stream):
                out.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory stays valid until the copy ran
            self.buffers.append(out)
        else:
            out = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        if key is not None and tensor.device.type == "cpu":
            self._unchecked.append((key, tensor, out))
        return out

    def _check_copies(self, copies: list[torch.Tensor | None] | None = None) -> None:
        """Compares ``copies`` (default: every copy not compared yet), which must have
        landed, with their sources; each copy is compared once.

        Raises:
            CheckpointingException: naming the checkpoint and the keys whose source no
                longer holds its copy's bytes (``execution.changes.changed_error``)."""
        chosen = None if copies is None else {id(c) for c in copies}
        compared = [pair for pair in self._unchecked if chosen is None or id(pair[2]) in chosen]
        self._unchecked = [pair for pair in self._unchecked if chosen is not None and id(pair[2]) not in chosen]
        keys = list(dict.fromkeys(key for key, source, copy in compared if not same_bytes(source, copy)))
        if error := changed_error(keys, self.where, "its host copies were compared with them", "changed"):
            raise error

    def mark(self) -> _Marks:
        """What to wait for (``.synchronize()``) until the copies issued so far landed."""
        return self._copies.mark()

    def wait(self) -> None:
        """Blocks until every copy issued so far has landed, then compares the copies
        with their sources.

        Raises:
            CheckpointingException: where a source no longer holds its copy's bytes."""
        self.landed(self.mark())

    def landed(self, marks: _Marks, copies: list[torch.Tensor | None] | None = None) -> None:
        """Blocks until the copies ``marks`` marked (``mark``) landed, then compares
        ``copies`` of them (default: every copy) with their sources, as ``wait``."""
        marks.synchronize()
        self._check_copies(copies)

    def release(self, buffers: list[torch.Tensor] | None = None) -> None:
        """Returns pinned buffers to the pool once the I/O that reads them is done:
        ``buffers`` (of this snapshot), or all of them."""
        if buffers is None:
            buffers, self.buffers = self.buffers, []
        else:
            gone = {id(b) for b in buffers}
            buffers = [b for b in self.buffers if id(b) in gone]
            self.buffers = [b for b in self.buffers if id(b) not in gone]
        if self.pool is not None:
            self.pool.give_back(buffers)


# Views into a slab start at multiples of this: every dtype's alignment, and a cache line.
_SLAB_ALIGN = 64
DEFAULT_LOAD_STAGING_BYTES = 1 << 30


def plan_waves(sizes: list[int], wave_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, grouped into waves of at most ``wave_bytes``
    (aligned); a size above it is a wave of its own."""
    waves: list[list[int]] = []
    held = 0
    for i, n in enumerate(sizes):
        n = _aligned(n)
        if not waves or held + n > wave_bytes:
            waves.append([])
            held = 0
        waves[-1].append(i)
        held += n
    return waves


def _aligned(n: int) -> int:
    return -(-n // _SLAB_ALIGN) * _SLAB_ALIGN


HostRead = Callable[[list[tuple[int, torch.Tensor]]], None]


class DeviceUploader:
    """Fills device tensors from storage through pinned host memory, in waves.

    A wave's reads land in one of two pinned slabs (each at most half the bound, and
    no larger than the whole load); its host-to-device copies are queued on a copy
    stream per device, and the next wave is read into the other slab meanwhile. A slab
    is reused only once the copies out of it have landed (an event per wave, no
    device-wide ``synchronize()``).

    Args:
        max_bytes: pinned memory held at once: two slabs of half of it. A tensor larger
            than half gets a pinned buffer of its own size for its wave.

    The slabs live for one ``fill``: a trainer loads once, and pinned memory kept
    after it would be taken from the host for the rest of the run.
    """

    def __init__(self, max_bytes: int = DEFAULT_LOAD_STAGING_BYTES) -> None:
        self.max_bytes = max_bytes
        self._slabs: list[torch.Tensor | None] = [None, None]
        self._copies = _CopyStreams()

    def fill(self, targets: list[torch.Tensor], read: HostRead) -> None:
        """Fills each contiguous tensor of ``targets`` with what ``read`` puts in host
        tensors of its shape and dtype (``read`` gets ``(index into targets, host
        tensor)`` pairs, one wave at a time, and must fill them all before returning).

        Returns once every copy has landed; work the caller queues on its streams
        afterwards is ordered after them."""
        if not targets:
            return
        for device in {t.device for t in targets if t.device.type == "cuda"}:
            self._copies.after_caller(device)  # the targets may still be in use there
        try:
            self._fill(targets, read)
        finally:
            self._slabs = [None, None]

    def _fill(self, targets: list[torch.Tensor], read: HostRead) -> None:
        in_flight: deque[_Marks] = deque()
        half = self.max_bytes // 2
        slab_bytes = min(half, sum(_aligned(t.nbytes) for t in targets))  # a small load pins little
        try:
            for n, wave in enumerate(plan_waves([t.nbytes for t in targets], half)):
                if len(in_flight) == 2:  # the slab this wave reuses: its copies must have landed
                    in_flight.popleft().synchronize()
                hosts = self._views(n % 2, [targets[i] for i in wave], slab_bytes)
                read(list(zip(wave, hosts)))
                for i, host in zip(wave, hosts):
                    self._copy(targets[i], host)
                in_flight.append(self._copies.mark())
        finally:  # also after a failed read: no copy may still read a slab that is freed
            for marks in in_flight:
                marks.synchronize()
        for device, stream in self._copies.streams.items():
            if any(t.device == device for t in targets):
                torch.cuda.current_stream(device).wait_stream(stream)

    def _copy(self, target: torch.Tensor, host: torch.Tensor) -> None:
        # detached: a model's parameters require grad, and autograd refuses in-place
        # writes into them (the same memory is filled either way)
        target = target.detach()
        if target.device.type == "cuda":
            with torch.cuda.stream(self._copies.get(target.device)):
                target.copy_(host, non_blocking=True)
        else:
            target.copy_(host)

    def _views(self, slot: int, like: list[torch.Tensor], slab_bytes: int) -> list[torch.Tensor]:
        """Host tensors shaped like ``like``, carved out of slab ``slot`` (of
        ``slab_bytes``; a wave larger than that is one tensor, which gets a buffer of
        its own)."""
        need = sum(_aligned(t.nbytes) for t in like)
        pin = any(t.device.type == "cuda" for t in like)
        slab = self._slabs[slot]
        if need > slab_bytes:
            slab = torch.empty(need, dtype=torch.uint8, pin_memory=pin)
        elif slab is None or slab.numel() < slab_bytes or slab.is_pinned() != pin:
            slab = self._slabs[slot] = torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=pin)
        views, at = [], 0
        for t in like:
            views.append(slab[at : at + t.nbytes].view(t.dtype).view(t.shape))
            at += _aligned(t.nbytes)
        return views
