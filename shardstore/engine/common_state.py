"""The non-sharded part of a checkpoint: ``common.pt`` and the ShardedObjects.

Both are ``torch.save`` pickles, read safely (``shardstore.format.pickles``); a crafted one
that needs more is refused with an error that says how to opt in:
``TorchCommonLoadStrategy(allow_unsafe_pickle=True)`` for checkpoints you trust.
"""

from __future__ import annotations

__all__ = [
    "COMMON_BACKEND", "COMMON_VERSION", "TorchCommonLoadStrategy", "TorchCommonSaveStrategy",
    "register_default_common_strategies",
]

from typing import Any

from shardstore.dict_utils import dict_list_map_inplace, nested_values
from shardstore.engine.strategies import (
    CheckpointDir,
    LoadCommonStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)
from shardstore.engine.walk import open_dir, read_location, write_dir
from shardstore.errors import CheckpointingException
from shardstore.format.pickles import deserialize, deserialize_dict, serialize
from shardstore.format.records import COMMON_FILE, object_path
from shardstore.mapping import (
    ShardedObject,
    ShardedStateDict,
    StateDict,
    fill_unknown_last_axes,
    is_main_replica,
)
from shardstore.stores.base import Location

COMMON_BACKEND = "torch"
COMMON_VERSION = 1


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Saves the common state as ``common.pt`` and each ShardedObject shard as a file."""

    def __init__(self, backend: str = COMMON_BACKEND, version: int = COMMON_VERSION) -> None:
        super().__init__(backend, version)

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: CheckpointDir | Location) -> None:
        write_dir(checkpoint_dir).write_bytes(COMMON_FILE, serialize(common_state_dict))

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir | Location
    ) -> None:
        """Writes this rank's main-replica ShardedObjects (other replicas write nothing)."""
        files = {
            object_path(obj.unique_key): serialize(obj.data)
            for obj in nested_values(sharded_objects_state_dict)
            if isinstance(obj, ShardedObject) and is_main_replica(obj.replica_id)
        }
        write_dir(checkpoint_dir).write_many(files)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Loads ``common.pt`` and ShardedObjects, refusing code-running pickles by default.

    Args:
        allow_unsafe_pickle: load arbitrary pickles (only for checkpoints you trust).
    """

    def __init__(self, allow_unsafe_pickle: bool = False) -> None:
        self.allow_unsafe_pickle = allow_unsafe_pickle

    def load_common(self, checkpoint_dir: CheckpointDir | Location) -> StateDict:
        location = read_location(checkpoint_dir)
        data = location.read_bytes_or_none(COMMON_FILE)
        if data is None:
            raise CheckpointingException(f"Common state {location.describe(COMMON_FILE)} is missing")
        return deserialize_dict(data, location.describe(COMMON_FILE), self.allow_unsafe_pickle)

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir | Location
    ) -> StateDict:
        """The objects' data, each read from its file (``_read_shard``), checked against
        the commit record where the location is a committed checkpoint's."""
        location = read_location(checkpoint_dir)

        def load_object(obj: Any) -> Any:
            if not isinstance(obj, ShardedObject):
                return obj
            rel, data = _read_shard(location, obj)
            if data is None:
                raise CheckpointingException(
                    f"ShardedObject {obj.key!r} shard {obj.unique_key!r} is missing from "
                    f"{location.describe()} (expected {rel}); was it saved with the same "
                    "global_shape and offsets?"
                )
            try:
                return deserialize(data, location.describe(rel), self.allow_unsafe_pickle)
            except CheckpointingException as exc:  # named by the key the caller asked for
                raise CheckpointingException(f"ShardedObject {obj.key!r} (shard {obj.unique_key!r}): {exc}") from exc

        return dict_list_map_inplace(load_object, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir | Location) -> ShardedStateDict:
        """Data-less ShardedObjects of the checkpoint, keyed by their unique key (an old
        key's shape completed by ``fill_unknown_last_axes`` first, as in Megatron-Core)."""
        record = open_dir(checkpoint_dir).require_record()
        objects = [ShardedObject.empty_from_unique_key(shard_key) for shard_key in record.object_shard_files]
        fill_unknown_last_axes(objects)
        return {obj.unique_key: obj for obj in objects}

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != COMMON_BACKEND:
            raise CheckpointingException(
                f"{self} reads common backend {COMMON_BACKEND!r}, the checkpoint has {loaded_backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != COMMON_VERSION:
            raise CheckpointingException(
                f"{self} reads common backend version {COMMON_VERSION}, the checkpoint has {loaded_version}"
            )

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def __str__(self) -> str:
        return self.__class__.__name__


def _read_shard(location: Location, obj: ShardedObject) -> tuple[str, bytes | None]:
    """The path and bytes of ``obj``'s shard file (None: there is none): where this
    library saves it (``object_path``), else where Megatron-Core's common strategy
    writes it (``<unique key>.pt``: Megatron's own save through the plug-in, whose files
    the commit record lists among the caller's), each also under the key an old
    Megatron-Core save gave it (the shape's last axis left out). Returns the first
    place's path where none holds it."""
    keys = (obj.unique_key, obj.old_unique_key) if obj.global_shape else (obj.unique_key,)
    places = [object_path(k) for k in keys] + [f"{k}.pt" for k in keys]
    for rel in places:
        data = location.read_bytes_or_none(rel)
        if data is not None:
            return rel, data
    return places[0], None


def register_default_common_strategies() -> None:
    """Registers the torch common strategies as defaults for backend ``torch`` v1."""
    register_default_strategy(StrategyAction.LOAD_COMMON, COMMON_BACKEND, COMMON_VERSION, TorchCommonLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, COMMON_BACKEND, COMMON_VERSION, TorchCommonSaveStrategy())
