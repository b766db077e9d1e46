"""Irregular sharding grids, stored with the machinery of flattened ranges.

A ShardedTensor with ``axis_fragmentations=None`` is cut at arbitrary offsets: Megatron
0.16's distributed optimizer cuts its 1-D buffers so (e.g. 13 + 11 of 24 elements,
``sharded_param_state_dp_reshardable``). Such shards cannot define a regular chunk
grid, but each of them is a contiguous range of the global tensor in C order, which is
exactly what a flattened range of the whole tensor is. So at the API boundary each
irregular shard becomes a factory whose ShardedTensor covers the whole global tensor as
its block, with the shard's elements as its ``flattened_range``; the storage core then
gives the array a regular chunk grid, writes the chunks inside one rank's range
directly and assembles the few straddling ones by exchange (one writer per chunk, as
for any flattened range), and reading back reads only the rows the range touches. A
request with ``allow_shape_mismatch`` whose global shape differs from the stored one
reads the whole stored tensor instead, fits it to the requested shape (padded with
zeros or truncated), then takes the range: each such shard reads all of it. The
factory's merge gives the loaded data back its shard's shape. A global tensor with no
elements has no range to take: each of its shards is given as the whole (empty) tensor.

Saves and loads reshard freely between irregular, flattened and regular layouts: the
stored array is the same global tensor. An irregular shard that is not contiguous in C
order (cut irregularly along an inner axis) is refused, naming the key.
"""

from __future__ import annotations

__all__ = ["contiguous_range", "irregular_as_flat", "is_irregular"]

import math

import torch

from shardstore.errors import CheckpointingException
from shardstore.mapping import ReplicaId, ShardedTensor, ShardedTensorFactory


def is_irregular(t: ShardedTensor) -> bool:
    return t.axis_fragmentations is None


def contiguous_range(offset: tuple[int, ...], extent: tuple[int, ...], shape: tuple[int, ...]) -> range | None:
    """The C-order element range of the box ``offset`` + ``extent`` in an array of
    ``shape``, or None when the box is not one contiguous range."""
    if math.prod(extent) == 0:
        return range(0, 0)
    split = next((axis for axis, n in enumerate(extent) if n > 1), len(extent))
    if any(e != n for e, n in zip(extent[split + 1 :], shape[split + 1 :])):
        return None
    start = 0
    for off, n in zip(offset, shape):
        start = start * n + off
    return range(start, start + math.prod(extent))


def irregular_as_flat(t: ShardedTensor) -> ShardedTensorFactory:
    """The factory that stores irregular shard ``t`` as a flattened range of its whole
    global tensor (see the module docstring)."""
    if t.flattened_range is not None:
        raise CheckpointingException(
            f"ShardedTensor {t.key!r}: a flattened range on an irregular grid (axis_fragmentations=None) "
            "is not supported; give the shard's own region instead"
        )
    extent = (1,) * t.prepend_axis_num + tuple(t.local_shape)
    for off, n, size in zip(t.global_offset, extent, t.global_shape):
        if off < 0 or off + n > size:
            raise CheckpointingException(
                f"ShardedTensor {t.key!r}: region at offset {t.global_offset} of shape {extent} lies outside the "
                f"global shape {t.global_shape}"
            )
    elements = contiguous_range(t.global_offset, extent, t.global_shape)
    if elements is None:
        raise CheckpointingException(
            f"ShardedTensor {t.key!r}: irregular grid (axis_fragmentations=None) with a shard at offset "
            f"{t.global_offset} of shape {extent} that is not contiguous in the global shape {t.global_shape}. "
            "shardstore stores irregular shards that are contiguous ranges of the global tensor (Megatron's "
            "distributed-optimizer buffers); cut along the first axis, or use a regular grid"
        )
    local_shape, global_shape, dtype = tuple(t.local_shape), tuple(t.global_shape), t.dtype
    flat_range, mismatch = slice(elements.start, elements.stop), t.allow_shape_mismatch

    def build(key: str, data: torch.Tensor | None, replica_id: ReplicaId, _: slice | None) -> ShardedTensor:
        if math.prod(global_shape) == 0:
            # no elements to range over: a flattened range of length 0 is a rank holding none of
            # a tensor, which a save leaves out, so the array would never be stored
            whole = data.reshape(global_shape) if data is not None else None
            return ShardedTensor(
                key, whole, dtype, global_shape, global_shape, (0,) * len(global_shape), None, replica_id, 0,
                mismatch,
            )
        flat = data.reshape(-1) if data is not None else None
        # axis_fragmentations stays None: the layout marks the shard irregular
        # (ShardRecord.irregular), so the record does not call it a caller's flattened range
        return ShardedTensor(
            key, flat, dtype, global_shape, global_shape, (0,) * len(global_shape), None,
            replica_id, 0, mismatch, flat_range,
        )

    def merge(loaded: torch.Tensor) -> torch.Tensor:
        return loaded.reshape(local_shape)

    return ShardedTensorFactory(t.key, t.data, build, merge, t.replica_id)
