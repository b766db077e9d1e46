"""The N-D flattened-tensor reformulation, with Megatron-Core's names and meaning
(``dist_checkpointing.strategies.resharding``).

A flattened ShardedTensor (distributed optimizer: ``from_rank_offsets_flat``) is a
contiguous range of a rank's N-D block ``[x, y, z]`` of a global tensor ``[X, Y, Z]``.
Megatron's torch_dist format stores such a tensor "reformulated", as a
``[X // x, Y // y, Z // z, x * y * z]`` tensor (one flat row per block), so a load under
another block grid must ask for the saved blocks instead: ``get_reformulation_metadata``
says how the checkpoint was saved, ``apply_nd_flattened_tensors_reformulation`` turns
each request whose blocks differ from the saved ones into requests of the whole saved
blocks it overlaps, and ``restore_nd_flattened_tensors_formulation`` cuts the loaded
blocks back into the requested range.

shardstore stores every tensor as its N-D global array and ``load`` reads any region of
it, so a flattened request under another block grid loads as it is: nothing here is
needed for that. The functions exist so that code written against Megatron's API (its
optimizer-resharding paths, its tests) runs on shardstore unchanged: the reformulated
requests load with ``shardstore.load`` and restore to the same bits.

What a checkpoint says about a flattened tensor (``get_reformulation_metadata``):

* shardstore's own format: the commit record keeps, for each array saved from
  flattened ranges, the block shape of the ranges' N-D blocks (``ArrayRecord.flattened_block``);
* Megatron-Core <= 0.14 torch_dist checkpoints: the reformulated shape DCP stored and the
  original shape in Megatron's ``mcore_data``;
* anything else (an array saved from whole blocks or irregular cuts, a shardstore record
  from before the block shape was kept, other formats): no saved block grid to follow,
  and none needed, so the metadata names the requested tensor's own formulation, which
  ``apply_nd_flattened_tensors_reformulation`` leaves as it is.
"""

from __future__ import annotations

__all__ = [
    "ReformulationRestoreMetadata", "TensorReformulationMetadata",
    "apply_nd_flattened_tensors_reformulation", "get_reformulation_metadata",
    "is_nd_flattened_tensor", "nd_flattened_tensor_reformulated_global_shape",
    "reformulate_single_nd_flattened_tensor", "restore_nd_flattened_tensors_formulation",
]

import logging
import math
import warnings
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch

from shardstore.dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from shardstore.engine.other_formats import open_other_format
from shardstore.engine.strategies import CheckpointDir
from shardstore.engine.walk import open_dir
from shardstore.errors import CheckpointingException
from shardstore.format.records import ArrayRecord
from shardstore.mapping import (
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from shardstore.opened import OpenedCheckpoint
from shardstore.stores.base import Location

logger = logging.getLogger(__name__)


@dataclass
class TensorReformulationMetadata:
    """How a checkpoint stored one flattened tensor.

    Attributes:
        ckpt_orig_global_shape: the tensor's global shape as the application saw it.
        ckpt_reform_global_shape: the block grid it was saved with, reformulated:
            ``(blocks along each axis..., elements per block)``.
    """

    ckpt_orig_global_shape: tuple[int, ...]
    ckpt_reform_global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.ckpt_orig_global_shape = tuple(self.ckpt_orig_global_shape)
        self.ckpt_reform_global_shape = tuple(self.ckpt_reform_global_shape)
        if not self.ckpt_orig_global_shape:
            raise CheckpointingException("TensorReformulationMetadata needs the original global shape (got ())")


# What ``restore_nd_flattened_tensors_formulation`` needs: the factories that made the
# reformulated requests, nested as in the state dict (Megatron's definition).
ReformulationRestoreMetadata = ShardedStateDict


def nd_flattened_tensor_reformulated_global_shape(sh_ten: ShardedTensor) -> tuple[int, ...]:
    """The reformulated global shape of flattened ``sh_ten``'s block grid: blocks along
    each axis (``axis_fragmentations``), then the elements of one block."""
    if not is_nd_flattened_tensor(sh_ten) or sh_ten.axis_fragmentations is None:
        raise CheckpointingException(f"{sh_ten} is not a flattened ShardedTensor on a regular grid")
    return tuple(sh_ten.axis_fragmentations) + (math.prod(sh_ten.local_shape),)


def is_nd_flattened_tensor(sh_ten: Any) -> bool:
    """Whether ``sh_ten`` is a flattened ShardedTensor (``flattened_range`` set; 1-D ones
    included, as in Megatron-Core)."""
    return isinstance(sh_ten, ShardedTensor) and sh_ten.flattened_range is not None


def get_reformulation_metadata(
    sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir | Location
) -> dict[str, TensorReformulationMetadata]:
    """How the checkpoint stored every flattened tensor of ``sharded_state_dict``, by key
    (see the module docstring for where each format keeps it). Reads only the
    checkpoint's metadata, on the calling rank.

    Raises:
        CheckpointingException: an N-D flattened tensor whose key the checkpoint does not
            hold (a 1-D one is skipped with a warning, as Megatron-Core does for its
            legacy 1-D format).
    """
    opened = open_dir(checkpoint_dir)
    location = opened.location
    saved = _saved_formulations(opened)
    metadata: dict[str, TensorReformulationMetadata] = {}
    for sh_ten in nested_values(sharded_state_dict):
        if not is_nd_flattened_tensor(sh_ten):
            continue
        if sh_ten.key not in saved:
            if len(sh_ten.global_shape) == 1:
                warnings.warn(
                    f"{location.describe()} holds no tensor {sh_ten.key!r}: no reformulation metadata for the 1-D "
                    f"flattened tensor {sh_ten}; skipping it",
                    stacklevel=2,
                )
                continue
            raise CheckpointingException(
                f"Cannot find global shape metadata for N-D flattened tensor {sh_ten} in checkpoint "
                f"{location.describe()}: it holds no tensor {sh_ten.key!r}"
            )
        shape, reformulated = saved[sh_ten.key]
        if reformulated is None:  # no saved block grid to follow: the request's own (see the module docstring)
            reformulated = nd_flattened_tensor_reformulated_global_shape(sh_ten)
        metadata[sh_ten.key] = TensorReformulationMetadata(shape, reformulated)
    return metadata


def _saved_formulations(opened: OpenedCheckpoint) -> dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]]:
    """``{key: (global shape, reformulated shape or None)}`` of every tensor stored."""
    if opened.other_format is not None:
        tensors = open_other_format(opened.location).tensors
        return {
            key: (tuple(t.shape), _stored_reformulation(t))
            for key, t in tensors.items()
        }
    record = opened.require_record()
    return {key: (tuple(a.shape), _record_reformulation(a)) for key, a in record.arrays.items()}


def _record_reformulation(array: ArrayRecord) -> tuple[int, ...] | None:
    """The reformulated shape of a shardstore array saved from flattened ranges."""
    block = array.flattened_block
    if block is None or any(b <= 0 or n % b for n, b in zip(array.shape, block)):
        return None
    return tuple(n // b for n, b in zip(array.shape, block)) + (math.prod(block),)


def _stored_reformulation(tensor: Any) -> tuple[int, ...] | None:
    """The stored shape of a Megatron torch_dist tensor kept reformulated (else None)."""
    stored = tuple(getattr(tensor, "stored_shape", ()) or ())
    return stored if stored and stored != tuple(tensor.shape) else None


def apply_nd_flattened_tensors_reformulation(
    sharded_state_dict: ShardedStateDict,
    reformulation_metadata: dict[str, TensorReformulationMetadata],
) -> tuple[ShardedStateDict, ReformulationRestoreMetadata]:
    """Replaces, in place, every flattened ShardedTensor whose block grid differs from
    the saved one (``reformulation_metadata[key].ckpt_reform_global_shape``) with a dict
    of requests for the whole saved blocks it overlaps, keyed
    ``(global offset, saved block shape)``. Load the result, then give it to
    ``restore_nd_flattened_tensors_formulation`` with the returned restore metadata.

    A flattened tensor saved with the grid it is requested with stays as it is; so do a
    1-D one without metadata (Megatron's legacy 1-D format) and one requested with
    another global shape than the saved one (``allow_shape_mismatch``: ``load`` reads it
    zero-padded or truncated, which the saved blocks cannot give).

    Raises:
        CheckpointingException: an N-D flattened tensor without metadata, or metadata
            whose block grid does not tile the tensor.
    """

    def maybe_reformulate(sh_ten: Any) -> Any:
        if not is_nd_flattened_tensor(sh_ten):
            return sh_ten
        rmd = reformulation_metadata.get(sh_ten.key)
        if rmd is None:
            if len(sh_ten.global_shape) == 1:
                return sh_ten
            raise CheckpointingException(
                f"Missing reformulation metadata for tensor {sh_ten}. Existing keys: {sorted(reformulation_metadata)}"
            )
        if rmd.ckpt_reform_global_shape == nd_flattened_tensor_reformulated_global_shape(sh_ten):
            return sh_ten
        if sh_ten.global_shape != rmd.ckpt_orig_global_shape:  # allow_shape_mismatch: load pads or truncates it
            return sh_ten
        return reformulate_single_nd_flattened_tensor(sh_ten, rmd)

    dict_list_map_inplace(maybe_reformulate, sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)

    def unlink_data(factory: ShardedTensorFactory) -> ShardedTensorFactory:
        factory.data = None  # the restore allocates anew; keep no reference to the request's buffer
        return factory

    dict_list_map_inplace(unlink_data, factories)
    return sharded_state_dict, factories


def restore_nd_flattened_tensors_formulation(
    state_dict: StateDict, formulation_restore_metadata: ReformulationRestoreMetadata
) -> StateDict:
    """The inverse of ``apply_nd_flattened_tensors_reformulation`` on the loaded state
    dict: each reformulated tensor's loaded blocks become its requested flat range
    again (in place; the state dict is returned)."""
    return apply_factory_merges(state_dict, formulation_restore_metadata)


def reformulate_single_nd_flattened_tensor(
    sh_ten: ShardedTensor, reformulation_metadata: TensorReformulationMetadata
) -> ShardedTensorFactory:
    """The factory that turns flattened ``sh_ten`` into requests for the saved blocks
    overlapping its block (each a whole block, flattened), and merges what they load
    into ``sh_ten``'s flat range of its own block.

    Raises:
        CheckpointingException: the saved grid does not tile the saved shape, is of
            another rank than ``sh_ten``'s, or splits a prepended axis; ``sh_ten`` has
            another global shape than the saved one.
    """
    rmd = reformulation_metadata
    request = sh_ten.without_data()
    if request.axis_fragmentations is None:
        raise CheckpointingException(f"{sh_ten} has no regular grid to reformulate")
    saved_grid = rmd.ckpt_reform_global_shape[:-1]
    if len(saved_grid) != len(request.axis_fragmentations) or len(saved_grid) != len(rmd.ckpt_orig_global_shape):
        raise CheckpointingException(
            f"{sh_ten}: saved reformulated shape {rmd.ckpt_reform_global_shape} does not match the tensor's "
            f"{len(request.axis_fragmentations)} axes"
        )
    if any(f <= 0 or n % f for n, f in zip(rmd.ckpt_orig_global_shape, saved_grid)):
        raise CheckpointingException(
            f"{sh_ten}: saved block grid {saved_grid} does not tile the saved shape {rmd.ckpt_orig_global_shape}"
        )
    if request.global_shape != rmd.ckpt_orig_global_shape:
        raise CheckpointingException(
            f"{sh_ten}: requested with global shape {request.global_shape}, saved with "
            f"{rmd.ckpt_orig_global_shape}: the saved blocks cannot give it padded or truncated; load it as it is "
            "(apply_nd_flattened_tensors_reformulation leaves it so)"
        )
    saved_block = tuple(n // f for n, f in zip(rmd.ckpt_orig_global_shape, saved_grid))  # prepended axes included
    prepended = request.prepend_axis_num
    if saved_block[:prepended] != (1,) * prepended:
        raise CheckpointingException(f"{sh_ten}: the saved blocks {saved_block} split a prepended axis")
    saved_local_shape = saved_block[prepended:]

    # Saved block indices along each axis that overlap this request's block: its extent
    # in units of saved blocks, from floor(start) to ceil(end).
    overlapping = []
    for chunk_index, saved_fragm, app_fragm in zip(
        request.local_chunk_offset_in_global(), saved_grid, request.axis_fragmentations
    ):
        first = chunk_index * saved_fragm // app_fragm
        stop = -(-(chunk_index + 1) * saved_fragm // app_fragm)
        overlapping.append(range(first, stop))
    logger.debug(
        "%s: reading %s saved blocks of grid %s for block %s of grid %s", request.key,
        [len(r) for r in overlapping], saved_grid, request.local_chunk_offset_in_global(), request.axis_fragmentations,
    )
    saved_requests = {}
    for index in product(*overlapping):
        offset = tuple(i * b for i, b in zip(index, saved_block))
        saved_requests[(offset, saved_local_shape)] = ShardedTensor(
            request.key, None, request.dtype, saved_local_shape, rmd.ckpt_orig_global_shape, offset, saved_grid,
            request.replica_id, prepended, request.allow_shape_mismatch,
            flattened_range=slice(0, rmd.ckpt_reform_global_shape[-1]),  # the whole saved block
        )

    def build(key: str, data: torch.Tensor | None, replica_id: Any, flattened_range: slice | None) -> ShardedStateDict:
        return saved_requests

    @torch.no_grad()
    def merge(loaded: StateDict) -> torch.Tensor:
        if not loaded:
            raise CheckpointingException(f"{request}: nothing was loaded to restore it from")
        device = next(iter(loaded.values())).device
        block = torch.empty(request.local_shape, dtype=request.dtype, device=device)
        mine = tuple(request.global_offset[prepended:])
        for (offset, shape), flat in loaded.items():
            theirs = offset[prepended:]
            source, target = flat.view(shape), block
            for axis, (s0, n, m0, m) in enumerate(zip(theirs, shape, mine, request.local_shape)):
                lo, hi = max(s0, m0), min(s0 + n, m0 + m)
                source = source.narrow(axis, lo - s0, hi - lo)
                target = target.narrow(axis, lo - m0, hi - lo)
            target.copy_(source)
        return block.flatten()[request.flattened_range]

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id, sh_ten.flattened_range)
