"""shardstore: distributed PyTorch checkpoints as one Zarr v3 hierarchy.

The API follows Megatron-Core's ``dist_checkpointing``: switch by changing the import:

    from shardstore import ShardedTensor, save, load

Submodules are imported on first use. That keeps ``import shardstore`` cheap and, more
importantly, keeps the start-up hook that teaches zarr our data types
(``shardstore._zarr_autoload``, run from a ``.pth`` file) from importing torch.
"""

from __future__ import annotations

__all__ = [
    "CheckpointManager",
    "CheckpointManagerOptions",
    "CheckpointingException",
    "LocalNonpersistentObject",
    "SaveOptions",
    "StorageLayout",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardstoreReader",
    "ShardstoreWriter",
    "StrictHandling",
    "VerifyReport",
    "check_is_distributed_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "verify",
]

from importlib import import_module
from typing import Any

# Where each name of ``__all__`` lives; imported on first access.
_EXPORTS = {
    "CheckpointManager": "shardstore.tools.manager",
    "CheckpointManagerOptions": "shardstore.tools.manager",
    "CheckpointingException": "shardstore.errors",
    "SaveOptions": "shardstore.format.commit",
    "StorageLayout": "shardstore.format.storage_layout",
    "check_is_distributed_checkpoint": "shardstore.compat.megatron.core",
    "LocalNonpersistentObject": "shardstore.mapping",
    "ShardedObject": "shardstore.mapping",
    "ShardedTensor": "shardstore.mapping",
    "ShardedTensorFactory": "shardstore.mapping",
    "ShardstoreReader": "shardstore.compat.dcp.reader",
    "ShardstoreWriter": "shardstore.compat.dcp.writer",
    "StrictHandling": "shardstore.load_strictness",
    "load": "shardstore.compat.megatron.serialization",
    "load_common_state_dict": "shardstore.compat.megatron.serialization",
    "load_content_metadata": "shardstore.compat.megatron.serialization",
    "load_plain_tensors": "shardstore.compat.megatron.serialization",
    "load_sharded_metadata": "shardstore.compat.megatron.serialization",
    "load_tensors_metadata": "shardstore.compat.megatron.serialization",
    "remove_sharded_tensors": "shardstore.compat.megatron.serialization",
    "save": "shardstore.compat.megatron.serialization",
    "verify": "shardstore.format.integrity",
    "VerifyReport": "shardstore.format.integrity",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardstore' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
