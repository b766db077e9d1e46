"""Megatron-Core's ``dist_checkpointing.strategies.zarr`` names, under the name its users
import, and the settings of shardstore's zarr strategies (backend, shard sizes): those names
of ``shardstore.engine.zarr_strategies``, re-exported (the same objects, so a pickle
naming a class by this module loads it, and type checkers see each name). The home module's
other names are its own.
"""

from __future__ import annotations

__all__ = [
    "AUTO_SHARD_MIN_RANKS", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_SHARD_BYTES",
    "DEFAULT_SYNC_STAGING_BYTES", "SHARDSTORE_BACKEND", "ShardBytes", "ZARR_VERSION",
    "ZarrLoadShardedStrategy", "ZarrSaveShardedStrategy", "_create_or_open_zarr_arrays",
    "_create_zarr_array", "_load_from_array", "_open_zarr_array_verbose",
    "_save_to_existing_array", "_should_create_array", "flatten_range",
    "load_zarr_based_sharded_metadata", "logger", "numpy_to_torch_dtype_dict",
    "pad_to_expected_shape", "postprocess_numpy_array", "register_default_zarr_strategies",
    "torch_to_numpy_dtype_dict",
]

from shardstore.engine.zarr_strategies import (
    AUTO_SHARD_MIN_RANKS,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SHARD_BYTES,
    DEFAULT_SYNC_STAGING_BYTES,
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    ShardBytes,
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
    _create_or_open_zarr_arrays,
    _create_zarr_array,
    _load_from_array,
    _open_zarr_array_verbose,
    _save_to_existing_array,
    _should_create_array,
    flatten_range,
    load_zarr_based_sharded_metadata,
    logger,
    numpy_to_torch_dtype_dict,
    pad_to_expected_shape,
    postprocess_numpy_array,
    register_default_zarr_strategies,
    torch_to_numpy_dtype_dict,
)
