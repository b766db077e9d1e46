"""One process writes a checkpoint array by array (conversions, imports): memory holds
one array at a time, however large the checkpoint.

The result is the same checkpoint a ``save`` at world size 1 writes: the same staging,
commit record (every chunk's crc32c bound into it) and atomic publication
(``shardstore.format.commit``); nothing is visible at the target until ``commit``, and a
writer that fails or is abandoned leaves nothing that looks complete. Keys go through
the save's one check (``planning.checks.check_storable_keys``, the target's name limits):
an array's before any of its bytes, the sharded objects' before ``commit`` writes
anything.

    with CheckpointWriter("/ckpt/imported") as writer:
        for key, tensor in source:
            writer.write_array(key, tensor)
        writer.commit(common_state={"iteration": 7}, objects={"rng_state/shard_0_1": state})
"""

from __future__ import annotations

__all__ = ["CheckpointWriter"]

import os
from collections.abc import Iterable
from dataclasses import replace
from types import TracebackType
from typing import Any, Literal

import torch

from shardstore.engine.common_state import (
    COMMON_BACKEND,
    COMMON_VERSION,
    TorchCommonSaveStrategy,
)
from shardstore.engine.zarr_strategies import (
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    checked_max_chunk_bytes,
    single_tensor_record,
)
from shardstore.errors import CheckpointingException
from shardstore.execution import ArrayWrites, SavePipeline
from shardstore.format import (
    ArrayPlaces,
    ArrayRecord,
    CheckpointingConfig,
    CommitRecord,
    ObjectRecord,
    SaveOptions,
    StorageLayout,
    array_group_collisions,
    parent_groups,
    tensor_to_numpy,
)
from shardstore.mapping import ShardedObject, ShardedTensor
from shardstore.opened import bare_location
from shardstore.stores import Location


class CheckpointWriter:
    """Writes a checkpoint from one process, one whole array at a time.

    Args:
        checkpoint_dir: the target (local path, ``s3://``, or a Location).
        overwrite: replace a committed checkpoint there (as ``save(overwrite=True)``).
        max_chunk_bytes: upper bound on one stored chunk, in bytes: a spelling of
            ``layout.max_chunk_bytes`` (``StorageLayout.of``).
        planned_arrays: what will be written, when known up front (key -> a tensor of
            its shape and dtype, e.g. on the ``meta`` device), and
        planned_objects: the unique keys of the sharded objects: their keys are checked
            before anything is written, as ``save`` checks its keys.
        array_places: where an import found the arrays whose keys do not spell their
            places (``SaveOptions.array_places``), recorded in the commit record.
        layout: where the bytes go (``StorageLayout``; each array is written whole).

    Raises:
        ValueError: a ``max_chunk_bytes`` that is no positive number of bytes, above
            what readers accept, or contradicting ``layout``, naming the field.
    """

    def __init__(
        self, checkpoint_dir: str | os.PathLike | Location, overwrite: bool = False,
        max_chunk_bytes: int | Literal["auto"] = "auto",
        planned_arrays: dict[str, torch.Tensor] | None = None, planned_objects: Iterable[str] = (),
        array_places: ArrayPlaces | None = None, layout: StorageLayout | None = None,
    ) -> None:
        if max_chunk_bytes != "auto":
            max_chunk_bytes = checked_max_chunk_bytes(max_chunk_bytes)
        layout = StorageLayout.of(layout, max_chunk_bytes=max_chunk_bytes)
        config = CheckpointingConfig(SHARDSTORE_BACKEND, ZARR_VERSION, COMMON_BACKEND, COMMON_VERSION)
        options = SaveOptions(overwrite=overwrite, array_places=array_places, layout=layout)
        self._save = SavePipeline.open(bare_location(checkpoint_dir), options=options, config=config)
        self._writes = ArrayWrites(self._save)
        self.max_chunk_bytes = int(self._save.options.layout.max_chunk_bytes)
        self._writes.check_storable(
            [ShardedTensor.from_rank_offsets(key, tensor) for key, tensor in (planned_arrays or {}).items()],
            [ShardedObject.empty_from_unique_key(key) for key in planned_objects],
        )
        self._save.begin()
        self._arrays: dict[str, ArrayRecord] = {}
        self._failed: dict[str, ArrayRecord] = {}  # arrays whose write failed, not written since
        self._done = False

    def describe(self) -> str:
        return self._save.describe()

    def write_array(self, key: str, tensor: torch.Tensor) -> ArrayRecord:
        """Writes ``tensor`` (on CPU) whole as the array ``key``; returns its record.

        Raises:
            CheckpointingException: ``tensor`` changed while it was written
                (``execution.changes``), or its write failed: the array is not
                recorded and its files are removed (``ArrayWrites.write_array``); write
                it again or commit without it."""
        sharded = ShardedTensor.from_rank_offsets(key, tensor.detach().cpu())
        self._writes.check_storable([sharded], [])
        if key in self._arrays:
            raise CheckpointingException(f"Array {key!r} was already written to {self.describe()}")
        record = single_tensor_record(sharded, self.max_chunk_bytes)
        try:
            self._writes.write_array(record, tensor_to_numpy(sharded.data.contiguous()).reshape(record.shape), sharded)
        except BaseException:
            self._failed[key] = record
            raise
        self._failed.pop(key, None)
        self._arrays[key] = record
        return record

    def commit(self, common_state: dict[str, Any] | None = None, objects: dict[str, Any] | None = None) -> None:
        """Writes the common state and sharded objects (by unique key, e.g.
        ``rng_state/shard_0_2``), then the commit record, and publishes the checkpoint.

        Raises:
            CheckpointingException: before anything is written, where files of an array
                whose ``write_array`` failed are still there (their removal was cut
                short), naming the arrays: write them again, or abandon the writer."""
        self._refuse_leftovers()
        shards = [replace(ShardedObject.empty_from_unique_key(k), data=v) for k, v in (objects or {}).items()]
        self._writes.check_storable([], shards)
        if clashes := array_group_collisions([*self._arrays, *(objects or {})]):
            raise CheckpointingException(f"Cannot commit {self.describe()}: clashing keys {clashes[0]}")
        common = TorchCommonSaveStrategy()
        location = self._save.location
        common.save_common(common_state or {}, location)
        common.save_sharded_objects(shards, location)
        self._writes.write_groups(parent_groups(list(self._arrays)))
        location.make_durable()
        by_key: dict[str, list[str]] = {}
        for s in shards:
            by_key.setdefault(s.key, []).append(s.unique_key)
        record = CommitRecord(
            arrays=dict(self._arrays),
            objects={k: ObjectRecord(k, tuple(sorted(v))) for k, v in by_key.items()},
            world_size=1,
        )
        self._save.commit(record)
        self._done = True

    def _refuse_leftovers(self) -> None:
        if not self._failed:
            return
        stored = set(self._save.location.list_files())
        left = {key: [f for f in self._writes.array_files(r) if f in stored] for key, r in self._failed.items()}
        if left := {key: files for key, files in left.items() if files}:
            named = ", ".join(f"{key!r} ({len(files)} files, e.g. {files[0]})" for key, files in left.items())
            raise CheckpointingException(
                f"Cannot commit {self.describe()}: the write of {named} failed and left files the commit record "
                "would not list (verify would name them). Write those arrays again, or abandon the writer"
            )

    def abandon(self) -> None:
        """Deletes what this writer wrote; the target keeps what it held."""
        if not self._done:
            self._done = True
            self._save.abandon()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.abandon()
        elif not self._done:
            self.abandon()
            raise CheckpointingException(f"CheckpointWriter for {self.describe()} closed without commit()")

