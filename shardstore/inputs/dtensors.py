"""DTensors (``torch.distributed.tensor``) as input to ``save`` and ``load``: converted
to shardstore's records once, at the API boundary, like Megatron-Core's objects
(``shardstore.inputs.megatron_objects``).

What FSDP2 (``fully_shard``), tensor parallelism (``parallelize_module``) and
``torch.distributed.checkpoint.state_dict.get_state_dict`` hand over is a nested dict of
DTensors. Each DTensor becomes one array of its GLOBAL shape, keyed by its fully
qualified name as PyTorch DCP names it: the path of dict keys and list indices that
leads to it, joined by ``"."`` (``model.layers.0.weight``,
``optim.state.layers.0.weight.exp_avg``; ``torch.distributed.checkpoint``'s
``flatten_state_dict``). So a checkpoint written by ``shardstore.save`` and one written by
``dcp.save`` through ``shardstore.compat.dcp.writer`` hold the same arrays under the same
keys, and a reader finds a parameter under the name DCP users know.

Placements: ``Shard(d)``, uneven ones included (the last ranks hold fewer rows, or
none), ``Replicate`` (the replica whose coordinates on the replicated mesh dimensions
are all 0 is the main one: replicas are written once, spread over the replicas by
the fully-parallel save; ranks outside the mesh that hold the same blocks, as DP
groups each holding a TP submesh's DTensor do, are replicas too, as DCP deduplicates
them), any number of mesh dimensions (FSDP x TP), and the
``_StridedShard`` FSDP2 uses over tensor parallelism. A local shard that is not one
box of the global tensor (strided sharding whose rows are not consecutive) becomes one
block per run of consecutive rows. ``Partial`` (pending sums) is refused, naming the
key: its local values are not the tensor's.

Each DTensor becomes a ``ShardedTensorFactory`` whose blocks are views of the DTensor's
local tensor: a save writes from that memory, a load reads into it (in place, under
any mesh or world size: the request's own placements say which region each rank
gets) and gives the DTensor itself back. Other values beside DTensors (ShardedTensors,
plain tensors such as the optimizer's ``step``, param groups) keep shardstore's
meaning: plain values form the common state.

The caller's state dict is not modified: its containers are copied where they hold a
DTensor (``with_dtensors_converted``), so ``load(state_dict, ...)`` fills the DTensors
of ``state_dict`` in place and leaves the dict usable, as ``dcp.load`` does.
"""

from __future__ import annotations

__all__ = [
    "Block", "blocks_at", "clashing_names", "dtensor_factory", "fqn", "is_dtensor", "with_dtensors_converted",
]

import itertools
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from shardstore.errors import CheckpointingException
from shardstore.mapping import (
    LocalNonpersistentObject,
    MeshReplicaId,
    ShardedTensor,
    ShardedTensorFactory,
)

logger = logging.getLogger(__name__)

DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it: a DTensor
    exists only once its module was imported)."""
    module = sys.modules.get(DTENSOR_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def fqn(path: tuple[Any, ...]) -> str:
    """The fully qualified name of a state-dict value as DCP's ``flatten_state_dict``
    makes it: the dict keys and list indices on its path, joined by ``"."``."""
    return ".".join(map(str, path))


def clashing_names(state_dict: dict) -> CheckpointingException | None:
    """The error for a state dict holding a DTensor in which two values have one fully
    qualified name (``{"model": {"w": dtensor}, "model.w": 5}``), walked as DCP's
    ``flatten_state_dict`` walks it (a list holding no tensor nor container is one
    value): ``dcp.save`` refuses such a state and a DCP load could not tell the two
    apart. None where there is no DTensor or no clash; a save checks before it writes."""
    leaves: list[tuple[tuple[Any, ...], Any]] = []
    _dcp_leaves(state_dict, (), leaves)
    if not any(is_dtensor(value) for _, value in leaves):
        return None
    first: dict[str, tuple[Any, ...]] = {}
    for path, _ in leaves:
        other = first.setdefault(fqn(path), path)
        if other != path:
            where = ["".join(f"[{k!r}]" for k in p) for p in (other, path)]
            return CheckpointingException(
                f"The state dict holds two values named {fqn(path)!r} once flattened, at {where[0]} and {where[1]}: "
                "a DTensor is stored under its fully qualified name (the keys on its path joined by '.'), as "
                "torch.distributed.checkpoint names it, so the two would be one entry. Nothing was written; rename "
                "one of them (a key without '.' cannot clash)"
            )
    return None


def _dcp_leaves(node: Any, path: tuple[Any, ...], leaves: list[tuple[tuple[Any, ...], Any]]) -> None:
    """The leaves of ``node`` with their paths, as DCP's ``traverse_state_dict`` visits
    them: a dict is walked, a list only where it is not one value (``_is_terminal``)."""
    if isinstance(node, dict):
        for key, value in node.items():
            _dcp_leaves(value, (*path, key), leaves)
    elif isinstance(node, list) and not _is_terminal(node):
        for index, value in enumerate(node):
            _dcp_leaves(value, (*path, index), leaves)
    else:
        leaves.append((path, node))


def _is_terminal(node: list) -> bool:
    """DCP's test: a list is one value unless it holds a tensor, a dict or such a list."""
    return not any(
        isinstance(v, (dict, torch.Tensor)) or (isinstance(v, list) and not _is_terminal(v)) for v in node
    )


def with_dtensors_converted(state_dict: Any) -> Any:
    """``state_dict`` with every DTensor replaced by its factory (``dtensor_factory``),
    keyed by its fully qualified name. The containers on the way to a DTensor are
    copied (the caller's dict keeps its DTensors); a state dict without DTensors is
    returned as it is."""
    converted, changed = _convert(state_dict, ())
    return converted if changed else state_dict


def _convert(value: Any, path: tuple[Any, ...]) -> tuple[Any, bool]:
    if isinstance(value, dict):
        items = {k: _convert(v, (*path, k)) for k, v in value.items()}
        if any(changed for _, changed in items.values()):
            return {k: v for k, (v, _) in items.items()}, True
        return value, False
    if isinstance(value, list):
        elements = [_convert(v, (*path, i)) for i, v in enumerate(value)]
        if any(changed for _, changed in elements):
            return [v for v, _ in elements], True
        return value, False
    if is_dtensor(value):
        return dtensor_factory(fqn(path), value), True
    return value, False


@dataclass(frozen=True)
class Block:
    """One box of the global tensor that this rank's local shard holds.

    Attributes:
        global_offset: where the box starts in the global tensor.
        local_index: the slices of the local tensor that hold it.
    """

    global_offset: tuple[int, ...]
    local_index: tuple[slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.local_index)


def local_blocks(key: str, dtensor: Any) -> list[Block]:
    """The boxes of the global tensor this rank's local shard of ``dtensor`` holds
    (``blocks_at`` at this rank's mesh coordinate; none outside the DTensor's mesh).

    Raises:
        CheckpointingException: a ``Partial`` placement, naming the key.
    """
    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_partial():
            raise CheckpointingException(
                f"DTensor {key!r} has a Partial placement ({placement}) on mesh dimension {mesh_dim}: its local "
                "values are pending reductions, not the tensor's values. To save it, reduce it first, e.g. "
                "dtensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in dtensor.placements]); "
                "to load into it, request a DTensor whose placements are Shard or Replicate"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    return blocks_at(tuple(dtensor.shape), tuple(mesh.shape), tuple(coordinate), placements)


def blocks_at(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]
) -> list[Block]:
    """The boxes of the global tensor held by the local shard at mesh ``coordinate``
    (a pure function of its arguments): one for ``Shard``/``Replicate`` placements, one
    per run of consecutive rows along an axis where strided sharding leaves them
    non-consecutive, none where the shard is empty."""
    runs = [_runs(axis_indices) for axis_indices in _global_indices(global_shape, mesh_shape, coordinate, placements)]
    return [
        Block(tuple(g for g, _, _ in box), tuple(slice(lo, lo + n) for _, lo, n in box))
        for box in itertools.product(*runs)
        if all(n > 0 for _, _, n in box)
    ]


def _global_indices(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]
) -> list[range | list[int]]:
    """Along each axis, the global indices of the local shard's rows, in local order.

    Without strided sharding this is what torch's ``compute_local_shape_and_global_offset``
    computes (one range per axis); with it, torch's own per-placement computation, which
    keeps every index (``_StridedShard`` rows need not be consecutive)."""
    from torch.distributed.tensor import _utils as dtensor_utils
    from torch.distributed.tensor.placement_types import _StridedShard

    if not any(isinstance(p, _StridedShard) for p in placements):
        shape, offset = dtensor_utils._compute_local_shape_and_global_offset(
            global_shape, mesh_shape, list(coordinate), placements
        )
        return [range(o, o + n) for o, n in zip(offset, shape)]
    sizes, indices = list(global_shape), [torch.arange(n) for n in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard() and not isinstance(placement, _StridedShard):
            continue
        dim = placement.dim
        size, index = dtensor_utils._get_shard_size_and_offsets(
            sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim], placement, indices[dim], global_shape[dim], False
        )
        sizes[dim], indices[dim] = size, index[:size]
    return [index.tolist() for index in indices]


def _runs(indices: range | list[int]) -> list[tuple[int, int, int]]:
    """``(global start, local start, length)`` of each run of consecutive indices (an
    empty axis gives one empty run, so the shard has no block)."""
    if isinstance(indices, range):
        return [(indices.start, 0, len(indices))]
    runs: list[tuple[int, int, int]] = []
    for local, index in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == index:
            start, at, n = runs[-1]
            runs[-1] = (start, at, n + 1)
        else:
            runs.append((index, local, 1))
    return runs or [(0, 0, 0)]


def replica_id(dtensor: Any) -> MeshReplicaId:
    """This rank's coordinates on the mesh dimensions the DTensor is replicated over
    (all zeros, or none: the main replica, which writes). Ranks outside the mesh that
    hold the same blocks (another DP group's copy of a TP mesh) are told apart where
    the layout is gathered (``MeshReplicaId``)."""
    coordinate = dtensor.device_mesh.get_coordinate()
    return MeshReplicaId(c for c, p in zip(coordinate, dtensor.placements) if p.is_replicate())


def _sharded_tensor(key: str, data: torch.Tensor, block: Block, global_shape: tuple[int, ...],
                    replica: MeshReplicaId) -> ShardedTensor:
    """One block as a ShardedTensor. Its grid is regular where the block is a cell of
    one (``axis_fragmentations``), else marked irregular: uneven DTensor shards need no
    grid, the storage core derives its chunks from the blocks' offsets."""
    shape = block.shape
    regular = all(n and o % n == 0 and g % n == 0 for o, n, g in zip(block.global_offset, shape, global_shape))
    fragmentations = tuple(g // n for n, g in zip(shape, global_shape)) if regular else None
    return ShardedTensor(key, data, data.dtype, shape, global_shape, block.global_offset, fragmentations, replica)


def dtensor_factory(key: str, dtensor: Any) -> ShardedTensorFactory:
    """The factory that stores ``dtensor`` as the array ``key`` and loads it back into
    the DTensor's own local tensor.

    Its build gives one ShardedTensor per local block (a view of the local tensor; a
    list when there are several; for an empty shard a placeholder that is neither
    saved nor read but keeps its place in a load's result); its merge
    copies what a load did not already read into those views and returns ``dtensor``.
    """
    local = dtensor.to_local().detach()
    global_shape = tuple(dtensor.shape)
    blocks = local_blocks(key, dtensor)
    replica = replica_id(dtensor) if blocks else 0
    if not blocks and dtensor.numel() == 0 and dtensor.device_mesh.get_coordinate() is not None:
        # an empty global tensor: every rank's shard is empty; its main replica still
        # records the (empty) array, so a reader finds it
        blocks = [Block((0,) * len(global_shape), tuple(slice(0, n) for n in global_shape))]
        local = torch.empty(global_shape, dtype=dtensor.dtype, device=local.device)
        replica = MeshReplicaId((int(any(dtensor.device_mesh.get_coordinate())),))
    views = [local[block.local_index] for block in blocks]

    def build(key: str, data: Any, replica_id: Any, flattened_range: Any) -> Any:
        if not views:  # nothing to save or read; the placeholder keeps the merge's place in a load
            return LocalNonpersistentObject(None)
        tensors = [_sharded_tensor(key, view, block, global_shape, replica) for view, block in zip(views, blocks)]
        return tensors[0] if len(tensors) == 1 else tensors

    def merge(loaded: Any) -> Any:
        results = [] if not views else [loaded] if len(views) == 1 else list(loaded)
        for view, result in zip(views, results):
            if result is not view:
                view.copy_(result)
        return dtensor

    return ShardedTensorFactory(key, local, build, merge, replica)
