"""What the engine's save (``engine.save``) and load (``engine.load``) share:
the path-or-Location a caller names a checkpoint by (``CheckpointDir``), the walk over a
caller's state dict that converts each leaf and builds each factory once
(``request_visitor``), the ranks a save or load runs on (``group_of``), and a stored
array as a data-less ShardedTensor covering all of it (``tensor_metadata``).

Where the seed API's checkpoint directories lead. Megatron-Core's signatures take a
``checkpoint_dir``: a path or URL from a direct caller, or the Location (or opened
checkpoint) a save or load of ours hands down. These turn one into what the core takes,
once, at the seed API's boundary (``opened`` says how far each is trusted):

* ``open_dir``: the checkpoint to read (``opened.open_read``);
* ``read_location``: where a reader with the seed's signature reads: a handed-down
  Location as it is, a path opened and checked against its commit record;
* ``write_dir``: where a writer with the seed's signature writes (``opened.write_location``:
  a committed checkpoint refused);
* ``holds_committed_checkpoint``: whether one is there, as the coordinator sees it.
"""

from __future__ import annotations

__all__ = [
    "tensor_metadata",
    "whole_tensor_metadata",
    "CONTENT_METADATA_KEY",
    "CheckpointDir",
    "group_of",
    "holds_committed_checkpoint",
    "open_dir",
    "read_location",
    "request_visitor",
    "write_dir",
]

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

from shardstore.errors import CheckpointingException
from shardstore.format.dtypes import from_zarr_name
from shardstore.format.records import ArrayRecord, is_committed
from shardstore.inputs.megatron_objects import convert_leaf
from shardstore.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    ShardedTensorFactory,
)
from shardstore.opened import OpenedCheckpoint, bare_location, open_read, write_location
from shardstore.protocol.collectives import Group
from shardstore.stores.base import Location
from shardstore.utils import (
    holds_sharded_class,
)

CheckpointDir = Union[str, Path, Location]


# Where save(content_metadata=...) keeps it in the common state (Megatron-Core's key).
CONTENT_METADATA_KEY = "content_metadata"


def request_visitor(
    foreign_in_common: list[tuple] | None = None, factories: list[tuple[tuple, ShardedTensorFactory]] | None = None,
    plain: Callable[[tuple, Any], Any] | None = None,
) -> Callable[[tuple, Any, bool], Any]:
    """``flatten``'s visit for a save's or a load's state dict: each leaf converted
    (``inputs.megatron_objects.convert_leaf``, then ``plain``: a load's requests for
    plain tensors stored as arrays, ``inputs.plain_tensors.whole_array_requests``), each
    factory built (and, with ``factories``, remembered with its path for the load's
    merges); with ``foreign_in_common``, the paths of plain values that are (or hold, in
    a tuple) another library's sharded objects (``utils.holds_sharded_class``).

    Factories are built once, as Megatron-Core's ``apply_factories`` builds them: a
    factory in a factory's build is refused (it would be neither stored nor merged)."""
    building: list[ShardedTensorFactory] = []  # the factory whose build is being walked

    def visit(path: tuple, value: Any, expandable: bool) -> Any:
        if expandable:
            value = convert_leaf(path, value)
            if plain is not None:
                value = plain(path, value)
            if isinstance(value, ShardedTensorFactory):
                if factories is not None:
                    factories.append((path, value))
                building[:] = [value]
                return value.build()
        elif isinstance(value, ShardedTensorFactory):
            raise _factory_in_a_build(building[0], value, path)
        if (foreign_in_common is not None and not isinstance(value, (ShardedBase, LocalNonpersistentObject))
                and holds_sharded_class(value)):
            foreign_in_common.append(path)
        return value

    return visit


def _factory_in_a_build(outer: ShardedTensorFactory, inner: ShardedTensorFactory, path: tuple) -> CheckpointingException:
    where = "".join(f"[{k!r}]" for k in path)
    return CheckpointingException(
        f"The build of ShardedTensorFactory {outer.key!r} returned another ShardedTensorFactory {inner.key!r} (at "
        f"{where}): factories are built once, so it would be neither stored nor merged. Have the build return "
        "ShardedTensors (build the inner factory there and merge it in the outer merge_fn)"
    )


def group_of(process_group: dist.ProcessGroup | None, sharded_strategy: Any) -> Group:
    """The ranks a save or load runs on: ``process_group``, else the one the sharded
    strategy was made for (``ZarrSaveShardedStrategy(process_group=...)``, the seed's
    way to name it), else the whole world."""
    if process_group is None:
        process_group = getattr(sharded_strategy, "process_group", None)
    return Group(process_group)


def open_dir(checkpoint_dir: str | os.PathLike | Location | OpenedCheckpoint) -> OpenedCheckpoint:
    """The checkpoint at ``checkpoint_dir``, opened once (``opened.open_read``; one
    already opened is returned as it is)."""
    if isinstance(checkpoint_dir, OpenedCheckpoint):
        return checkpoint_dir
    return open_read(bare_location(checkpoint_dir))


def read_location(checkpoint: str | bytes | os.PathLike | Location | OpenedCheckpoint) -> Location:
    """Where a reader with the seed's signature (a strategy's ``load_common``,
    ``load_sharded_objects``, the zarr module's ``_load_from_array``) reads ``checkpoint``.

    A load hands such a reader the location it opened (checked against the record
    already) and it is used as it is. A path or URL, as a direct caller of the seed's API
    passes, is opened here by ``open_read``: a committed checkpoint's files are then
    checked against its record on that route too (read unchecked, a flipped bit in
    ``common.pt`` came back as a wrong integer), and an unfinished save is refused."""
    if isinstance(checkpoint, OpenedCheckpoint):
        return checkpoint.location
    if isinstance(checkpoint, (str, bytes, os.PathLike)):
        return open_read(bare_location(os.fsdecode(checkpoint) if isinstance(checkpoint, bytes) else checkpoint)).location
    return checkpoint


def write_dir(checkpoint_dir: str | os.PathLike | Location, *, writes_config: bool = False) -> Location:
    """Where a writer with the seed's signature writes into ``checkpoint_dir``
    (``opened.write_location``: refused where a committed shardstore checkpoint is,
    but for a ``metadata.json`` its record does not list, ``writes_config``)."""
    return write_location(bare_location(checkpoint_dir), writes_config=writes_config)


def holds_committed_checkpoint(checkpoint_dir: str | os.PathLike | Location) -> bool:
    """Collective over the default process group (every rank calls it): whether
    ``checkpoint_dir`` holds a committed shardstore checkpoint, as the coordinator sees
    it, so that ranks whose views of a shared file system differ for a moment still
    decide alike and none is left waiting in a later collective. A place shardstore
    cannot open (another scheme, such as Megatron's ``msc://``) holds none of ours.

    Raises:
        CheckpointingException: on every rank, where the coordinator's check failed
            (the storage's error, named)."""
    group = Group()
    answer: bool | CheckpointingException = False
    failure: Exception | None = None
    if group.is_coordinator:
        try:
            location = bare_location(checkpoint_dir)
        except CheckpointingException:
            location = None
        try:
            answer = location is not None and is_committed(location)
        except Exception as exc:  # raised on every rank: the others would wait in the broadcast
            failure = exc
            answer = CheckpointingException(
                f"Could not tell whether {checkpoint_dir} holds a committed shardstore checkpoint: "
                f"{type(exc).__name__}: {exc}"
            )
    answer = group.broadcast_object(answer)
    if isinstance(answer, CheckpointingException):
        raise answer from failure
    return bool(answer)


def tensor_metadata(record: ArrayRecord) -> ShardedTensor:
    """A data-less ShardedTensor covering the whole stored array (one shard); for an
    array saved from flattened ranges, a flattened one (its whole range), as Megatron-Core
    describes a flattened tensor: a load of it gives the 1-D tensor."""
    dtype = from_zarr_name(record.dtype).torch_dtype
    return whole_tensor_metadata(record.key, record.shape, dtype, flattened=record.flattened_block is not None)


def whole_tensor_metadata(
    key: str, shape: tuple[int, ...], dtype: torch.dtype, flattened: bool = False
) -> ShardedTensor:
    """A data-less ShardedTensor covering a whole global tensor of ``shape``; with
    ``flattened`` (and at least one axis), as the flattened range of all its elements."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    if flattened and meta.ndim > 0:
        return ShardedTensor.from_rank_offsets_flat(
            key, meta.flatten(), tuple(shape), flattened_range=slice(0, meta.numel())
        ).without_data()
    return ShardedTensor.from_rank_offsets(key, meta).without_data()
