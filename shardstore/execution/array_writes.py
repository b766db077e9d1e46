"""One process writes a checkpoint array by array (``tools.array_writer``): the arrays
of a save it opened and began (``SavePipeline.open``, ``SavePipeline.begin``), each whole,
its ``zarr.json`` first; the groups' documents; and, where a write fails, the files it
may have left, removed.
"""

from __future__ import annotations

__all__ = ["ArrayWrites"]

import itertools
from collections.abc import Iterable

import numpy as np

from shardstore.execution import (
    save as rank_save,  # through its module: a test that replaces write_ops reaches it
)
from shardstore.execution.changes import SourceVersions, in_place_ops
from shardstore.execution.pipeline import SavePipeline
from shardstore.execution.save import WriteOp, node_document_files
from shardstore.format.chunks import DEFAULT_IO_CONCURRENCY, WrittenChunk
from shardstore.format.records import ZARR_JSON, ArrayRecord
from shardstore.mapping import ShardedObject, ShardedTensor
from shardstore.planning.checks import check_storable_keys, local_records
from shardstore.planning.layout import GatheredShards, region_at


class ArrayWrites:
    """The writes of one process into ``save`` (begun): what it writes is reported in
    ``save.written``, which ``SavePipeline.commit`` commits."""

    def __init__(self, save: SavePipeline) -> None:
        self.save = save

    def check_storable(self, tensors: list[ShardedTensor], objects: list[ShardedObject]) -> None:
        """A save's key check (``planning.checks.check_storable_keys``, the target's name
        limits) on what one process is about to write, before any of it is written
        (the collective ``plan`` checks every rank's keys itself)."""
        where = self.save.describe()
        layout = GatheredShards.from_gathered([local_records(tensors, objects, self.save.group.rank, where)])
        check_storable_keys(layout, self.save.target.name_limits, where)

    def write_array(
        self, record: ArrayRecord, value: np.ndarray, source: ShardedTensor | None = None,
    ) -> list[WrittenChunk]:
        """One process: the whole array ``record`` (its ``zarr.json``, then every chunk)
        from ``value`` (host memory, the array's shape). ``source``: the tensor whose
        memory ``value`` may be; changed during the writes, it fails them
        (``execution.changes``). A write that fails, that way or any other, reports no
        chunk for the commit and removes every file it may have written
        (``unwrite_array``) before it raises."""
        versions = SourceVersions.of([source] if source is not None else [])
        reported = len(self.save.written)
        try:
            self.save.location.write_many(node_document_files([record], (), self.save.pending.options.zarr_metadata))
            op = WriteOp(record.key, region_at((0,) * len(record.shape), record.shape), value)
            written = rank_save.write_ops(self.save.pending, {record.key: record}, [op], DEFAULT_IO_CONCURRENCY)
            self.save.written += written
            in_place = in_place_ops([op], [source] if source is not None else [])
            if changed := versions.error_after_writes(self.save.describe(), in_place, {record.key: record}, written):
                raise changed
        except Exception:
            del self.save.written[reported:]
            self.unwrite_array(record)  # its failure raises, the write's as its context
            raise
        return written

    def array_files(self, record: ArrayRecord) -> list[str]:
        """The files of the array ``record`` that ``write_array`` may write, relative to
        the save's location: its ``zarr.json`` and every chunk of its grid."""
        chunks = (f"{record.key}/{record.chunk_key(index)}" for index in itertools.product(*map(range, record.chunk_grid)))
        return [f"{record.key}/{ZARR_JSON}", *chunks]

    def unwrite_array(self, record: ArrayRecord) -> None:
        """Removes what ``write_array`` of ``record`` may have written (``array_files``;
        ours: nothing else writes into a save's location, and a key is written once),
        then the array's directories where that left them empty (``rmdir`` never removes
        a file)."""
        for rel in self.array_files(record):
            self.save.location.remove(rel)
        parts = record.key.split("/")
        for depth in range(len(parts), 0, -1):
            path = self.save.location.local_path("/".join(parts[:depth]))
            if path is None:
                return
            try:
                path.rmdir()
            except OSError:  # not empty (another array's files below it), or gone
                return

    def write_groups(self, groups: Iterable[str]) -> None:
        """One process: the ``zarr.json`` of each of ``groups`` where the save's options
        keep a document per node (none for a consolidated-only save)."""
        self.save.location.write_many(node_document_files((), groups, self.save.pending.options.zarr_metadata))
