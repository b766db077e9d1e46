"""Host copies of the tensors a save writes: the blocking part of a save.

A synchronous save writes CPU tensors straight from the caller's memory (``to_host``
returns a view). An async save must not: the caller may change its tensors as soon as
``save`` returns, so ``HostSnapshot`` copies them, CUDA tensors into pinned buffers
that are reused by the next save once this one is finalized.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in contiguous CPU memory: a view when it already is, else one copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


class HostBufferPool:
    """Reusable host buffers by (shape, dtype); pinned for CUDA tensors, so the
    device-to-host copies run at full PCIe speed and without a fresh pin per save."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        if self._free[key]:
            return self._free[key].pop()
        pin = like.device.type == "cuda"
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        for b in buffers:
            self._free[(tuple(b.shape), b.dtype)].append(b)


class HostSnapshot:
    """Copies tensors to host memory that the caller can no longer change.

    Args:
        pool: where CUDA staging buffers come from and return to (None: fresh buffers).
    """

    def __init__(self, pool: HostBufferPool | None = None) -> None:
        self.pool = pool
        self.buffers: list[torch.Tensor] = []
        self._cuda = False

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "cuda" and self.pool is not None:
            out = self.pool.take(tensor)
            out.copy_(tensor, non_blocking=True)
            self.buffers.append(out)
            self._cuda = True
            return out
        return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)

    def wait(self) -> None:
        """Blocks until every non-blocking device-to-host copy has landed."""
        if self._cuda:
            torch.cuda.synchronize()

    def release(self) -> None:
        """Returns the pinned buffers to the pool (after the I/O that reads them)."""
        if self.pool is not None:
            self.pool.give_back(self.buffers)
        self.buffers = []
