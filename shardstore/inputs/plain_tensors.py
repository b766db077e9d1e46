"""Plain ``torch.Tensor`` values (not DTensors, not ShardedTensors) stored as arrays of
their own, and asked for again by ``shardstore.load``.

``dcp.save(model.state_dict(), storage_writer=ShardstoreWriter(...))`` of a plain model
(DDP, one process, most fine-tuning scripts) hands every tensor to the writer as a
replicated item: DCP's ``WriteItemType.TENSOR``, the whole tensor, on every rank that
holds it. Pickled into ``common.pt`` such a tensor has no per-chunk checksum, cannot be
read by plain zarr or TensorStore and is read whole by every rank; so each one at least
``min_array_bytes`` big becomes an array of its global shape under its fully qualified
name, written by ONE of the ranks that hold it (``assign_writers``: the largest first,
each to the holder with the fewest bytes to write so far, the sharded bytes included).

Why a threshold (``DEFAULT_MIN_ARRAY_BYTES`` = 1 KiB): an array costs a metadata file, a
chunk file, a record entry and a TensorStore open, while ``common.pt`` holds thousands
of small tensors cheaply (docs/measurements/small-tensors.md). Below 1 KiB (an
optimizer's ``step``, a LayerNorm bias of 256 float32 values) nothing is gained by an
array: checksums of whole files still cover ``common.pt``, and no reader wants a scalar
as an array. ``min_array_bytes=0`` writes every non-empty tensor of at least one
dimension as an array.

Tensors that describe their own place in a global tensor (torch >= 2.14's
``torch.distributed.checkpoint.CheckpointableTensor`` protocol: ``global_shape``,
``global_offsets``, ``local_offsets``, ``local_sizes``) reach the writer as sharded
items (``WriteItemType.SHARD``), like DTensors; ``checkpointable_tensor_protocol()`` is
that protocol where torch has it, else None (torch 2.13 has not).
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_MIN_ARRAY_BYTES", "HeldTensor", "assign_writers",
    "checkpointable_tensor_protocol", "stored_as_array", "whole_array_requests",
]

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardstore.inputs.dtensors import fqn, is_dtensor
from shardstore.mapping import ReplicaId, ShardedTensor, ShardedTensorFactory

DEFAULT_MIN_ARRAY_BYTES = 1024


@functools.cache
def checkpointable_tensor_protocol() -> type | None:
    """torch's ``CheckpointableTensor`` protocol (torch >= 2.14), or None. Imported at
    the first call, not with this module: ``torch.distributed.checkpoint`` imported after
    ``init_process_group`` makes ``torch.distributed.nn.functional`` hold the default
    process group in its defaults, so ``destroy_process_group`` no longer ends its
    threads and the process could abort at exit."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:  # a torch built without distributed
        return None
    return getattr(dcp, "CheckpointableTensor", None)


def is_plain_tensor(value: Any) -> bool:
    """A tensor that is the whole of itself: not a DTensor, not a tensor that describes
    its shards by torch's ``CheckpointableTensor`` protocol (only a subclass can)."""
    if not isinstance(value, torch.Tensor) or is_dtensor(value):
        return False
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return True
    protocol = checkpointable_tensor_protocol()
    return protocol is None or not isinstance(value, protocol)


def stored_as_array(shape: tuple[int, ...], nbytes: int, min_array_bytes: int) -> bool:
    """Whether a plain tensor of ``shape`` and ``nbytes`` bytes becomes an array (else it
    stays in the common state): every non-empty one of at least one dimension at or
    above the threshold (a scalar, such as an optimizer's ``step``, is a value)."""
    return len(shape) > 0 and nbytes > 0 and nbytes >= min_array_bytes


@dataclass(frozen=True)
class HeldTensor:
    """A plain tensor a rank holds, as ``assign_writers`` weighs it.

    Attributes:
        key: its fully qualified name (the array's name).
        nbytes: its size in bytes.
    """

    key: str
    nbytes: int


def assign_writers(held: Sequence[Sequence[HeldTensor]], sharded_bytes: Sequence[int]) -> dict[str, int]:
    """One writer rank per plain tensor, among the ranks that hold it, balanced by bytes
    (a pure function: the coordinator's plan, testable without ranks).

    Largest first, each to the holder with the fewest bytes to write so far (its
    sharded bytes included), the lowest rank on ties: the greedy rule that stays within
    4/3 of the best balance.

    Args:
        held: per rank, the plain tensors it holds (a replicated tensor on several).
        sharded_bytes: per rank, the bytes of sharded items it writes anyway.

    Returns:
        ``{key: rank}``.
    """
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, tensors in enumerate(held):
        for tensor in tensors:
            holders.setdefault(tensor.key, []).append(rank)
            sizes[tensor.key] = tensor.nbytes
    load = list(sharded_bytes)
    writers: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        writers[key] = rank
        load[rank] += sizes[key]
    return writers


def whole_array_requests(arrays: Mapping[str, Any], main: bool) -> Callable[[tuple, Any], Any]:
    """A load request's leaf converter (``convert(path, value)``, in the request's one
    walk): a plain tensor whose fully qualified name is an array of the checkpoint
    (``arrays``, by key) becomes a request for that whole array, read into the tensor
    itself (in place, as ``dcp.load`` fills it: ``_filled_in_place``); any other value is
    returned as it is. ``main``: this rank's requests are the main replica (one rank's,
    for the load's coverage check)."""

    def convert(path: tuple, value: Any) -> Any:
        if arrays and is_plain_tensor(value):
            key = fqn(path)
            if key in arrays:
                return _filled_in_place(key, value, 0 if main else 1)
        return value

    return convert


def _filled_in_place(key: str, tensor: torch.Tensor, replica_id: ReplicaId) -> ShardedTensorFactory:
    """The request for the whole array ``key`` that leaves its values in ``tensor``: the
    load reads into it directly where it can (a contiguous tensor of the stored dtype),
    the merge copies the result in where not (another dtype, a view that is not
    contiguous) and gives ``tensor`` back. A meta tensor holds no values: its result is
    the loaded tensor."""

    def build(key: str, data: torch.Tensor, replica_id: ReplicaId, _: Any) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)

    def merge(loaded: torch.Tensor) -> torch.Tensor:
        if loaded is tensor or tensor.is_meta:
            return loaded
        with torch.no_grad():
            tensor.copy_(loaded)
        return tensor

    return ShardedTensorFactory(key, tensor, build, merge, replica_id)
