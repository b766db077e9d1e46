"""Arrays one at a time through TensorStore: the helpers that open and create a
checkpoint's Zarr arrays (``tensorstore_context``, ``array_spec``, ``open_arrays``), and
the module functions named after Megatron-Core's zarr strategy (``_create_zarr_array``,
``_load_from_array``, ``load_zarr_based_sharded_metadata``, ...) for callers of that
API, which work on single tensors. ``engine.zarr_strategies`` offers them too; its strategies
plan whole saves and loads instead.
"""

from __future__ import annotations

__all__ = [
    "READABLE_BACKENDS", "SHARDSTORE_BACKEND", "ZARR_BACKEND", "ZARR_VERSION",
    "_create_or_open_zarr_arrays", "_create_zarr_array", "_load_from_array",
    "_open_zarr_array_verbose", "_save_to_existing_array", "_should_create_array", "array_spec",
    "consolidated_document", "load_zarr_based_sharded_metadata", "open_arrays", "postprocess_numpy_array",
    "single_tensor_record", "tensorstore_context",
]

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import torch

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.engine.strategies import (
    CheckpointDir,
)
from shardstore.engine.walk import open_dir, write_dir
from shardstore.errors import CheckpointingException
from shardstore.execution.load import load_tensors, plan_read
from shardstore.execution.loaded import (
    place_loaded,
    postprocess_loaded,
)
from shardstore.execution.staging import (
    to_host,
)
from shardstore.format.chunks import DEFAULT_IO_CONCURRENCY
from shardstore.format.dtypes import (
    from_torch,
    from_zarr_name,
    numpy_to_tensor,
    numpy_to_torch_dtype_dict,
    tensor_to_numpy,
)
from shardstore.format.features import PACKED_ARRAYS_ATTRIBUTE, ZarrMetadata
from shardstore.format.records import (
    MAX_RECORD_BYTES,
    ZARR_JSON,
    ArrayRecord,
    is_committed,
    sharded_backend,
)
from shardstore.format.storage_layout import (
    DEFAULT_MAX_CHUNK_BYTES,
)
from shardstore.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from shardstore.opened import bare_location
from shardstore.planning.layout import (
    Region,
    ShardRecord,
    block_shape,
    chunk_shape_for,
    region_at,
)
from shardstore.stores.base import Location, kvstore_spec, usable_cpus

# What metadata.json names as the sharded backend. Megatron-Core's own zarr backend is
# ("zarr", 1): a shardstore checkpoint must not claim it, or Megatron would open ours
# with its reader and get nothing. "zarr" stays registered as an alias, so code asking
# for the default "zarr" strategy gets shardstore's.
SHARDSTORE_BACKEND = "shardstore"
ZARR_BACKEND = "zarr"
READABLE_BACKENDS = (SHARDSTORE_BACKEND, ZARR_BACKEND)  # "zarr": checkpoints of shardstore <= 0.1
ZARR_VERSION = 1


def tensorstore_context(location: Location, io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> ts.Context:
    """One context per save or load: no chunk cache (data passes through once)."""
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": 0},
            "data_copy_concurrency": {"limit": usable_cpus()},
            "file_io_concurrency": {"limit": io_concurrency},
            **location.store.chunk_access().context,
        }
    )


def array_spec(location: Location, record: ArrayRecord, for_write: bool) -> dict[str, Any]:
    """TensorStore spec that opens ``record``'s array without reading its ``zarr.json``.

    Writes store chunks even when they equal the fill value, and reads refuse missing
    chunks, so a lost chunk is an error instead of silent zeros.
    """
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": kvstore_spec(location, record.key),
        "metadata": record.zarr_metadata(),
    }
    if for_write:
        spec["store_data_equal_to_fill_value"] = True
    else:
        spec["fill_missing_data_reads"] = False
    return spec


def open_arrays(
    location: Location, records: list[ArrayRecord], context: ts.Context, for_write: bool
) -> dict[str, ts.TensorStore]:
    """Opens many arrays concurrently (no I/O: the metadata is assumed, not read)."""
    futures = {
        r.key: ts.open(
            array_spec(location, r, for_write), open=True, assume_metadata=True, context=context
        )
        for r in records
    }
    handles = {}
    for key, future in futures.items():
        try:
            handles[key] = future.result()
        except Exception as exc:
            raise CheckpointingException(
                f"Cannot open array {key!r} of checkpoint {location.describe()}: {exc}"
            ) from exc
    return handles


def _ts_index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(s.start, s.stop) for s in region)


def single_tensor_record(t: ShardedTensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> ArrayRecord:
    """Array metadata derived from one tensor: chunks follow its own block shape."""
    shard = ShardRecord.from_sharded_tensor(t, 0, 0)
    chunk = chunk_shape_for([shard], tuple(t.global_shape), from_torch(t.dtype).itemsize, max_chunk_bytes)
    return ArrayRecord(t.key, tuple(t.global_shape), from_torch(t.dtype).zarr_name, chunk)


def _should_create_array(ten: ShardedTensor) -> bool:
    """The main replica holding the first element creates the array."""
    return (
        is_main_replica(ten.replica_id)
        and not any(ten.global_offset)
        and (ten.flattened_range is None or ten.flattened_range.start == 0)
    )


def _create_zarr_array(sharded_tensor: ShardedTensor, checkpoint_dir: CheckpointDir | Location) -> ts.TensorStore:
    """Creates the array of ``sharded_tensor``'s key (writes its ``zarr.json``)."""
    return _create_array_in(write_dir(checkpoint_dir), sharded_tensor)


def _create_array_in(location: Location, sharded_tensor: ShardedTensor) -> ts.TensorStore:
    """``_create_zarr_array`` into a location ``write_location`` gave."""
    record = single_tensor_record(sharded_tensor)
    location.write_bytes(f"{record.key}/{ZARR_JSON}", json.dumps(record.zarr_metadata()).encode())
    return open_arrays(location, [record], tensorstore_context(location), for_write=True)[record.key]


def _create_or_open_zarr_arrays(
    sharded_tensors: list[ShardedTensor], checkpoint_dir: CheckpointDir | Location
) -> list[ts.TensorStore | None]:
    """Arrays for the given tensors: created by the first chunk's main replica, opened
    (from storage) by other main replicas, None for non-main replicas.

    The arrays created here must exist before others open them (a barrier in between
    when several ranks take part).
    """
    location = write_dir(checkpoint_dir)
    arrays: list[ts.TensorStore | None] = [
        _create_array_in(location, t) if _should_create_array(t) else None for t in sharded_tensors
    ]
    for i, t in enumerate(sharded_tensors):
        if arrays[i] is None and is_main_replica(t.replica_id):
            arrays[i] = _open_array(location, t.key, "r+")
    return arrays


def _save_to_existing_array(sharded_tensor: ShardedTensor, arr: ts.TensorStore | None) -> None:
    """Writes a non-flat tensor's data into its region of ``arr`` (no-op for None)."""
    if arr is None:
        return
    if sharded_tensor.flattened_range is not None:
        raise CheckpointingException(
            f"{sharded_tensor.key!r}: flattened ranges need the cross-rank chunk exchange; "
            "save them with ZarrSaveShardedStrategy"
        )
    extent = block_shape(sharded_tensor)
    value = tensor_to_numpy(to_host(sharded_tensor.data)).reshape(extent)
    arr[_ts_index(region_at(sharded_tensor.global_offset, extent))].write(value).result()


def _open_zarr_array_verbose(path: str | Path, mode: str, **open_kwargs: Any) -> ts.TensorStore:
    """Opens the array stored at ``path`` (a local path or a URL such as
    ``s3://bucket/ckpt/key``; reads its ``zarr.json``), with a clear error."""
    parent, _, name = os.fspath(path).rstrip("/").rpartition("/")
    return _open_array(bare_location(parent or "."), name, mode, **open_kwargs)


def _open_array(location: Location, key: str, mode: str, **open_kwargs: Any) -> ts.TensorStore:
    """Opens the array ``key`` of ``location`` (reads its ``zarr.json``, or, where it has
    none, takes its document from the consolidated metadata of ``location``'s root
    ``zarr.json``: a checkpoint saved with ``zarr_metadata="consolidated_only"``; a packed
    array, feature ``packs``, read-only from its pack), with a clear error. Internal
    callers hold the location already: no path is split again (which ``Path`` would do
    wrongly for a URL: ``s3://`` becomes ``s3:/``)."""
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": kvstore_spec(location, key)}
    options = {"read": True, "write": mode != "r", **open_kwargs}
    try:
        return ts.open(spec, open=True, **options).result()
    except Exception as exc:
        root = _root_document(location) if "NOT_FOUND" in str(exc) else None
        if (pack := _packed_array_pack(root, key)) is not None:
            return _open_packed_array(location, key, pack, mode, **open_kwargs)
        document = _consolidated_document(root, key)
        if document is None:
            raise CheckpointingException(
                f"Cannot open Zarr array at {location.describe(key)} (mode {mode!r}): {exc}. A checkpoint saved "
                "with zarr_metadata='consolidated_only' keeps no zarr.json per array: open it from the "
                "checkpoint's root directory and the array's full key"
            ) from exc
    try:
        return ts.open({**spec, "metadata": document}, open=True, assume_metadata=True, **options).result()
    except Exception as exc:
        raise CheckpointingException(
            f"Cannot open Zarr array at {location.describe(key)} (mode {mode!r}) with its document from the "
            f"root's consolidated metadata: {exc}"
        ) from exc


def _open_packed_array(location: Location, key: str, pack: str, mode: str, **open_kwargs: Any) -> ts.TensorStore:
    """Opens the packed array ``key`` (feature ``packs``) from ``pack``, a Zarr v3
    hierarchy in a stored zip, through TensorStore's ``zip`` kvstore: read-only.

    Raises:
        CheckpointingException: a mode that writes, or the pack unreadable."""
    if mode != "r":
        raise CheckpointingException(
            f"Cannot open Zarr array {key!r} of {location.describe()} in mode {mode!r}: it is packed into {pack} "
            "(SaveOptions.pack_arrays_up_to), which is read-only; open it with mode 'r', or save the checkpoint "
            "again without packing"
        )
    base = kvstore_spec(location)
    spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": {**base, "path": f"{base['path']}{pack}"},
                                           "path": f"{key}/"}}
    try:
        return ts.open(spec, open=True, read=True, **open_kwargs).result()
    except Exception as exc:
        raise CheckpointingException(
            f"Cannot open Zarr array {key!r} from its pack {location.describe(pack)}: {exc}; `shardstore verify "
            f"{location.describe()}` checks the pack"
        ) from exc


def _root_document(location: Location) -> dict[str, Any] | None:
    """``location``'s root ``zarr.json``, parsed, or None where it has none.

    Raises:
        CheckpointingException: a root that is no JSON object."""
    data = location.read_bytes_or_none(ZARR_JSON, max_bytes=MAX_RECORD_BYTES)
    try:
        root = json.loads(data) if data is not None else None
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise CheckpointingException(f"{location.describe(ZARR_JSON)} is not a Zarr group's document: {exc}") from exc
    if root is not None and not isinstance(root, dict):
        raise CheckpointingException(f"{location.describe(ZARR_JSON)} is not a Zarr group's document: not an object")
    return root


def _packed_array_pack(root: dict[str, Any] | None, key: str) -> str | None:
    """The pack the root document's ``packed_arrays`` attribute names for ``key`` (format
    version 8), or None."""
    attributes = root.get("attributes") if root is not None else None
    packed = attributes.get(PACKED_ARRAYS_ATTRIBUTE) if isinstance(attributes, dict) else None
    pack = packed.get(key) if isinstance(packed, dict) else None
    return pack if isinstance(pack, str) else None


def consolidated_document(location: Location, key: str) -> dict[str, Any] | None:
    """The array ``key``'s metadata document as the consolidated metadata of
    ``location``'s root ``zarr.json`` lists it (extension data types beside Zarr's own
    listing, ``EXTENSION_METADATA``), or None where there is none, and where the root
    is no shardstore record of a consolidated-only save (a per-array ``zarr.json``
    missing from any other checkpoint is damage, not a layout)."""
    return _consolidated_document(_root_document(location), key)


def _consolidated_document(root: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """``consolidated_document`` of a parsed root document."""
    try:
        consolidated = root.get("consolidated_metadata") if root is not None else None
        layout = root.get("attributes", {}).get("shardstore", {}).get("zarr_metadata") if root is not None else None
    except AttributeError as exc:
        raise CheckpointingException(f"the root {ZARR_JSON} is not a Zarr group's document: {exc}") from exc
    if not isinstance(consolidated, dict) or layout != ZarrMetadata.CONSOLIDATED_ONLY.value:
        return None
    for listing in (consolidated.get("metadata"), consolidated.get(EXTENSION_METADATA)):
        if isinstance(listing, dict) and isinstance(listing.get(key), dict):
            return listing[key]
    return None


def _load_from_array(sharded_tensor: ShardedTensor, checkpoint_dir: CheckpointDir | Location) -> torch.Tensor:
    """Loads one tensor from its array. A committed shardstore checkpoint is read as
    ``load`` reads it (``load_tensors``: every chunk bound by the commit record, a
    missing one an error, never the fill value). Megatron's zarr functions write arrays
    into a bare directory, with no commit record: read as it is (the array's own
    ``zarr.json``, or its document in the root's consolidated metadata, ``_open_array``;
    each chunk's crc32c, a codec of the array, is checked by TensorStore)."""
    location = bare_location(checkpoint_dir)
    if _holds_shardstore_checkpoint(location):
        opened = open_dir(checkpoint_dir)
        return load_tensors([sharded_tensor], opened.location, opened.require_record())[0]
    arr = _open_array(location, sharded_tensor.key, "r")
    stored = ArrayRecord(
        sharded_tensor.key, tuple(arr.shape), str(arr.dtype.name), tuple(arr.chunk_layout.read_chunk.shape)
    )
    op = plan_read(sharded_tensor, stored, f"checkpoint {location.describe()}")
    try:
        array = arr[_ts_index(op.region)].read().result()
    except Exception as exc:  # TensorStore's DATA_LOSS (a chunk's crc32c), a missing chunk file, I/O
        raise CheckpointingException(
            f"Reading {sharded_tensor.key!r} from checkpoint {location.describe()} failed: {exc}; "
            f"`shardstore verify {location.describe()}` lists every damaged chunk"
        ) from exc
    return place_loaded(op.finish(numpy_to_tensor(array, from_zarr_name(stored.dtype).torch_dtype)), sharded_tensor,
                        f"checkpoint {location.describe()}")


def _holds_shardstore_checkpoint(location: Location) -> bool:
    """Whether ``location`` holds a committed shardstore checkpoint (its commit record,
    and a ``metadata.json`` naming our backend), rather than the bare arrays of
    Megatron's zarr functions or another tool's Zarr group."""
    return is_committed(location) and sharded_backend(location) in READABLE_BACKENDS


def postprocess_numpy_array(
    loaded_array: np.ndarray, sharded_tensor: ShardedTensor, apply_flattened_range: bool = True
) -> torch.Tensor:
    """Turns a loaded numpy array into the tensor ``sharded_tensor`` asks for (no copy
    when no padding or cast is needed)."""
    x = numpy_to_tensor(np.ascontiguousarray(loaded_array), _torch_dtype_of(loaded_array.dtype))
    x = x.reshape(x.shape[sharded_tensor.prepend_axis_num :]) if x.ndim > len(sharded_tensor.local_shape) else x
    return postprocess_loaded(x, sharded_tensor, apply_flattened_range)


def _torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    for known_numpy, known_torch in numpy_to_torch_dtype_dict.items():
        if known_numpy == dtype:
            return known_torch
    raise CheckpointingException(f"numpy dtype {dtype} has no torch equivalent")


def load_zarr_based_sharded_metadata(
    checkpoint_dir: CheckpointDir | Location,
    get_shape_dtype_fn: Callable[[str], tuple[tuple[int, ...], np.dtype]],
) -> ShardedStateDict:
    """Data-less ShardedTensors for every array of the checkpoint.

    Args:
        checkpoint_dir: checkpoint root
        get_shape_dtype_fn: returns ``(shape, numpy dtype)`` for an array's path
    """
    opened = open_dir(checkpoint_dir)
    sharded = {}
    for key in opened.require_record().arrays:
        shape, dtype = get_shape_dtype_fn(opened.describe(key))
        meta = torch.empty(tuple(shape), dtype=_torch_dtype_of(np.dtype(dtype)), device="meta")
        sharded[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
    return sharded
