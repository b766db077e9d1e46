"""Host copies of the tensors a save writes: the blocking part of a save.

A synchronous save writes CPU tensors straight from the caller's memory (``to_host``
returns a view) and streams CUDA tensors through a bounded set of host buffers. An
async save must not keep pointing at the caller's memory: the caller may change its
tensors as soon as ``save`` returns, so ``HostSnapshot`` copies them.

CUDA tensors are copied into pinned buffers (``HostBufferPool``, exact sizes, reused by
later saves) on a dedicated copy stream that first waits for the work already queued on
the caller's stream, so a copy sees what the training step wrote, and never waits for a
device-wide ``synchronize()`` that would also drain other streams. Each batch of copies
is marked by an event (``HostSnapshot.mark``): the writer waits for that batch only,
while the next batch is still being copied.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

import torch


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in contiguous CPU memory: a view when it already is, else one copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


class HostBufferPool:
    """Reusable host buffers by (shape, dtype); pinned for CUDA tensors, so the
    device-to-host copies run at full PCIe speed and without a fresh pin per save.

    Args:
        max_free_bytes: the most bytes of returned buffers kept for reuse (the oldest
            are freed first); None: keep every returned buffer.
    """

    def __init__(self, max_free_bytes: int | None = None) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._returned: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest first, for eviction
        self._free_bytes = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        if self._free[key]:
            buffer = self._free[key].pop()
            del self._returned[id(buffer)]
            self._free_bytes -= buffer.nbytes
            return buffer
        pin = like.device.type == "cuda"
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
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


class HostSnapshot:
    """Copies tensors to host memory that the caller can no longer change.

    Args:
        pool: where CUDA staging buffers come from and return to (None: fresh buffers).
    """

    def __init__(self, pool: HostBufferPool | None = None) -> None:
        self.pool = pool
        self.buffers: list[torch.Tensor] = []
        self._streams: dict[torch.device, Any] = {}  # a copy stream per device

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "cuda" and self.pool is not None:
            stream = self._streams.get(tensor.device)
            if stream is None:
                stream = self._streams[tensor.device] = torch.cuda.Stream(device=tensor.device)
            # ordered after what the caller queued on its stream (the step that wrote it)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            out = self.pool.take(tensor)
            with torch.cuda.stream(stream):
                out.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory stays valid until the copy ran
            self.buffers.append(out)
            return out
        return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)

    def mark(self) -> _Marks:
        """What to wait for (``.synchronize()``) until the copies issued so far landed."""
        return _Marks([stream.record_event() for stream in self._streams.values()])

    def wait(self) -> None:
        """Blocks until every copy issued so far has landed."""
        self.mark().synchronize()

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
