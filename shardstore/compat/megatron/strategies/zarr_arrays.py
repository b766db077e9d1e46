"""Arrays one at a time through TensorStore (``engine.zarr_arrays``), under its earlier name.
"""

from __future__ import annotations

__all__ = [
    "READABLE_BACKENDS",
    "SHARDSTORE_BACKEND",
    "ZARR_BACKEND",
    "ZARR_VERSION",
    "_create_or_open_zarr_arrays",
    "_create_zarr_array",
    "_load_from_array",
    "_open_zarr_array_verbose",
    "_save_to_existing_array",
    "_should_create_array",
    "array_spec",
    "consolidated_document",
    "load_zarr_based_sharded_metadata",
    "open_arrays",
    "postprocess_numpy_array",
    "single_tensor_record",
    "tensorstore_context",
]

from shardstore.engine.zarr_arrays import (
    READABLE_BACKENDS,
    SHARDSTORE_BACKEND,
    ZARR_BACKEND,
    ZARR_VERSION,
    _create_or_open_zarr_arrays,
    _create_zarr_array,
    _load_from_array,
    _open_zarr_array_verbose,
    _save_to_existing_array,
    _should_create_array,
    array_spec,
    consolidated_document,
    load_zarr_based_sharded_metadata,
    open_arrays,
    postprocess_numpy_array,
    single_tensor_record,
    tensorstore_context,
)
