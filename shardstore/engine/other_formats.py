"""Loading checkpoints other tools wrote directly, under any layout: every format in
``shardstore.other_formats.registry`` (PyTorch DCP, Megatron-Core's torch_dist and its
deprecated zarr backend), read without running their pickles.

``load``, ``load_tensors_metadata``, ``load_sharded_metadata`` and
``load_common_state_dict`` pick these strategies for a local directory without a
shardstore commit record that a registered format detects. Each requested region is
assembled from the saved chunks that overlap it, so a load at another world size, with
another tensor-parallel split or irregular cut, works as on shardstore's own format.
These formats keep no checksums: what the files hold is what loads (convert the
checkpoint, ``shardstore convert``, to have every chunk checked from then on).
"""

from __future__ import annotations

__all__ = [
    "OtherFormatLoadCommonStrategy",
    "OtherFormatLoadShardedStrategy",
    "open_other_format",
    "read_requested",
    "register_default_other_format_strategies",
]

import functools
from pathlib import Path
from typing import Any

import torch

from shardstore.dict_utils import dict_list_map_inplace
from shardstore.engine.common_state import TorchCommonLoadStrategy
from shardstore.engine.strategies import (
    CheckpointDir,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from shardstore.engine.walk import whole_tensor_metadata
from shardstore.errors import CheckpointingException
from shardstore.execution.loaded import local_part, place_loaded, postprocess_loaded
from shardstore.format.records import CommitRecord
from shardstore.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    fill_unknown_last_axes,
)
from shardstore.opened import bare_location
from shardstore.other_formats import registry
from shardstore.other_formats.base import (
    OtherCheckpoint,
    OtherFormat,
    is_object_shard_key,
    place_value,
)
from shardstore.planning.layout import block_shape, region_at
from shardstore.protocol.collectives import Group
from shardstore.protocol.stage import run_stage
from shardstore.stores.base import Location

TORCH_DIST_BACKEND = "torch_dist"  # Megatron-Core's backend name, whose default load strategy is ours


def open_other_format(checkpoint_dir: CheckpointDir | Location) -> OtherCheckpoint:
    """The opened checkpoint of another tool. One load asks for it several times (keys,
    common state, objects, tensors); it is read once for as long as its format's
    metadata file stays the same."""
    location = bare_location(checkpoint_dir)
    path = location.local_path()
    if path is None:
        raise CheckpointingException(
            f"{location.describe()}: checkpoints of other tools are read from local paths only"
        )
    path = Path(path).resolve()
    other_format = registry.detect(location, OtherFormat)
    if other_format is None:
        raise CheckpointingException(
            f"{location.describe()} is no checkpoint of another tool that shardstore reads "
            f"({', '.join(f.title for f in registry.formats(OtherFormat))})"
        )
    try:
        stat = (path / other_format.metadata_file).stat()
    except OSError:
        return other_format.open(path)  # which says what is missing
    return _opened(other_format, path, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _opened(other_format: OtherFormat, path: Path, inode: int, size: int, mtime_ns: int) -> OtherCheckpoint:
    del inode, size, mtime_ns  # the cache key: a rewritten metadata file is read again
    return other_format.open(path)


def read_requested(source: OtherCheckpoint, t: ShardedTensor, allow_lossy_casts: bool = False) -> torch.Tensor:
    """The part of the saved tensor that ``t`` asks for, shaped and typed as ``t``
    (``execution.loaded.place_loaded``: a cast that changes values only where
    ``allow_lossy_casts``)."""
    saved = source.tensors.get(t.key)
    if saved is None:
        raise CheckpointingException(f"{source.path} has no tensor {t.key!r}")
    if saved.shape != t.global_shape and not t.allow_shape_mismatch:
        raise CheckpointingException(
            f"{source.path}: tensor {t.key!r} is stored with global shape {saved.shape}, the state dict expects "
            f"{t.global_shape}"
        )
    block = region_at(t.global_offset, block_shape(t))
    region = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(block, saved.shape))
    x = source.read_region(t.key, region)
    x = postprocess_loaded(x.reshape(local_part(region, t.prepend_axis_num)), t)
    return place_loaded(x, t, str(source.path), allow_lossy_casts)


class OtherFormatLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors from another tool's checkpoint (a registered format), under any layout.

    Args:
        allow_lossy_casts: convert to the requested dtype even where that changes
            values, as ``ZarrLoadShardedStrategy``'s (which ``load`` turns into this one
            for another tool's checkpoint, keeping it).
    """

    def __init__(self, allow_lossy_casts: bool = False) -> None:
        self.allow_lossy_casts = allow_lossy_casts

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> StateDict:
        source = open_other_format(checkpoint_dir)
        return dict_list_map_inplace(
            lambda x: read_requested(source, x, self.allow_lossy_casts) if isinstance(x, ShardedTensor) else x,
            sharded_state_dict,
        )

    def load_with_record(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord | None,
        process_group: Any = None,
    ) -> StateDict:
        """``load`` with failures agreed on every rank (there is no commit record)."""
        group = process_group if isinstance(process_group, Group) else Group(process_group)
        return self.load_with_plan(sharded_state_dict, location, record, None, group)

    def load_with_plan(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord | None, plan: Any,
        group: Group, local_error: BaseException | None = None,
    ) -> StateDict:
        """Collective: each rank reads what it asked for; a failure on any rank (or
        ``local_error``) raises on every rank."""
        return run_stage(
            group, f"Reading checkpoint {location.describe()}", lambda: self.load(sharded_state_dict, location),
            local_error=local_error,
        )

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """Every tensor as a data-less ShardedTensor covering it whole; Megatron's
        reformulated flattened ranges (torch_dist <= 0.14) as the flattened range of all
        their elements, as Megatron-Core's own query gives them."""
        source = open_other_format(checkpoint_dir)
        return {
            key: whole_tensor_metadata(key, t.shape, t.dtype, flattened=_stored_reformulated(t))
            for key, t in source.tensors.items()
        }

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.load_tensors_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        names = [f.name for f in registry.formats(OtherFormat)]
        if loaded_backend not in names:
            raise CheckpointingException(f"{self} reads {', '.join(names)} checkpoints, not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass  # the metadata describes itself

    def __str__(self) -> str:
        return self.__class__.__name__


class OtherFormatLoadCommonStrategy(TorchCommonLoadStrategy):
    """The common state (Megatron's ``common.pt``, plus a plain DCP's non-tensor values)
    and Megatron's ShardedObjects (``<key>/shard_<offset>_<shape>``: DCP items, or
    ``.pt`` files of its zarr backend).

    Args:
        allow_unsafe_pickle: load arbitrary pickles (only for checkpoints you trust), as
            ``TorchCommonLoadStrategy``'s, which ``load`` turns into this one for another
            tool's checkpoint.
    """

    def load_common(self, checkpoint_dir: CheckpointDir | Location) -> StateDict:
        """Megatron's ``common.pt``; a plain DCP's values nested where they were in the
        state dict it saved (its planner's paths: ``optim/param_groups/0/lr``), as a
        shardstore save of that state dict keeps them."""
        source = open_other_format(checkpoint_dir)
        state = source.common_state(self.allow_unsafe_pickle)
        for key in sorted(source.items):
            if not is_object_shard_key(key):
                value = source.read_item(key, self.allow_unsafe_pickle)
                place_value(state, source.saved_paths.get(key, (key,)), value, key)
        return state

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir | Location
    ) -> StateDict:
        source = open_other_format(checkpoint_dir)

        def load_object(obj: Any) -> Any:
            if not isinstance(obj, ShardedObject):
                return obj
            # an old Megatron-Core key lacks the shape's last axis: looked for as Megatron looks
            for stored in (obj.unique_key, obj.old_unique_key if obj.global_shape else None):
                if stored in source.items:
                    return source.read_object_shard(stored, self.allow_unsafe_pickle)
            raise CheckpointingException(f"{source.path} has no sharded object shard {obj.unique_key!r}")

        return dict_list_map_inplace(load_object, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir | Location) -> ShardedStateDict:
        """Data-less ShardedObjects of the checkpoint, keyed by their unique key (an old
        key's shape completed by ``fill_unknown_last_axes`` first, as in Megatron-Core)."""
        source = open_other_format(checkpoint_dir)
        objects = [ShardedObject.empty_from_unique_key(k) for k in source.items if is_object_shard_key(k)]
        fill_unknown_last_axes(objects)
        return {obj.unique_key: obj for obj in objects}

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass  # Megatron's "torch" common backend, or none (plain DCP)

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass


def _stored_reformulated(tensor: Any) -> bool:
    """A Megatron torch_dist tensor stored reformulated (one flat row per block)."""
    stored = tuple(getattr(tensor, "stored_shape", ()) or ())
    return bool(stored) and stored != tuple(tensor.shape)


def register_default_other_format_strategies() -> None:
    """Registers the load strategy of other formats as the default for Megatron's ``torch_dist``."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, TORCH_DIST_BACKEND, 1, OtherFormatLoadShardedStrategy())
