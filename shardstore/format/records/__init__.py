"""The on-disk format's records (version 9; 1 to 8 read), one idea per module:

- ``names``: what the checkpoint's files and markers are called (``COMMIT_RECORD``,
  ``SAVE_MARKER``, ``STAGING_TAG``, ...), chunk keys and object shard paths, what a
  checkpoint key may be (``check_key``) and the groups keys imply.
- ``encoding``: the compact JSON the record is written in, its checksums and its own
  digest (``seal_record``).
- ``array_record``: one array's record (``ArrayRecord``), its Zarr metadata and the
  bounds its summary read back must respect.
- ``record_parts``: the other parts of the commit record (``ObjectRecord``,
  ``ReusedChunks``, ``DcpMetadata``, ``ArrayPlaces``).
- ``commit_record``: the commit record (``CommitRecord``), the root ``zarr.json`` as
  written (``to_json``, consolidated metadata) and read back and checked (``from_json``).
- ``reading``: a checkpoint's record read (``read_commit_record``, ``is_committed``), or
  what is there instead, another tool's checkpoint among it; ``markers``: the markers
  saves leave; ``claim_document``: an in-place save's claim.

A checkpoint is one Zarr v3 group (docs/format.md):

    <checkpoint>/zarr.json        root group, written LAST: the commit record
    <checkpoint>/metadata.json    backends that wrote it (shardstore.core)
    <checkpoint>/common.pt        non-sharded state
    <checkpoint>/<key>/zarr.json  one Zarr v3 array per ShardedTensor key (the GLOBAL tensor)
    <checkpoint>/<key>/c.i.j      its chunks, crc32c on each (``c/i/j`` before version 3)
    <checkpoint>/__objects__/...  ShardedObjects, one file per shard
    <checkpoint>/packs/<r>-<n>.zip small arrays packed by rank r (feature ``packs``)

The names below are re-exported from their modules; every other name is imported from
the module that holds it.
"""

from __future__ import annotations

__all__ = [
    "COMMIT_RECORD",
    "COMMON_FILE",
    "DELETION_MARKER",
    "MAX_CHUNK_BYTES",
    "MAX_RECORD_BYTES",
    "OBJECTS_DIR",
    "REPLACED_TAG",
    "SAVE_MARKER",
    "STAGING_TAG",
    "ZARR_JSON",
    "ArrayPlaces",
    "ArrayRecord",
    "CommitRecord",
    "DcpMetadata",
    "ObjectRecord",
    "ReusedChunks",
    "StatePath",
    "array_group_collisions",
    "check_key",
    "file_digest",
    "group_metadata",
    "is_committed",
    "object_path",
    "own_markers",
    "parent_groups",
    "read_commit_record",
    "read_marker",
    "sharded_backend",
    "state_paths",
    "write_commit_record",
]

from shardstore.format.records.array_record import MAX_CHUNK_BYTES, ArrayRecord
from shardstore.format.records.commit_record import (
    MAX_RECORD_BYTES,
    CommitRecord,
    group_metadata,
    write_commit_record,
)
from shardstore.format.records.encoding import file_digest
from shardstore.format.records.markers import own_markers, read_marker
from shardstore.format.records.names import (
    COMMIT_RECORD,
    COMMON_FILE,
    DELETION_MARKER,
    OBJECTS_DIR,
    REPLACED_TAG,
    SAVE_MARKER,
    STAGING_TAG,
    ZARR_JSON,
    array_group_collisions,
    check_key,
    object_path,
    parent_groups,
)
from shardstore.format.records.reading import is_committed, read_commit_record, sharded_backend
from shardstore.format.records.record_parts import (
    ArrayPlaces,
    DcpMetadata,
    ObjectRecord,
    ReusedChunks,
    StatePath,
    state_paths,
)
