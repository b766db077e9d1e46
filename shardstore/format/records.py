"""The on-disk format (version 9; 1 to 8 read): array metadata, group nodes and the commit record.

A checkpoint is one Zarr v3 group:

    <checkpoint>/zarr.json        root group, written LAST: the commit record
    <checkpoint>/metadata.json    backends that wrote it (shardstore.core)
    <checkpoint>/common.pt        non-sharded state
    <checkpoint>/<key>/zarr.json  one Zarr v3 array per ShardedTensor key (the GLOBAL tensor)
    <checkpoint>/<key>/c.i.j      its chunks, crc32c on each (``c/i/j`` before version 3)
    <checkpoint>/__objects__/...  ShardedObjects, one file per shard
    <checkpoint>/packs/<r>-<n>.zip small arrays packed by rank r (feature ``packs``,
                                  ``SaveOptions.pack_arrays_up_to``): a stored zip
                                  that is a Zarr v3 hierarchy of its own (``format.packs``)

The root ``zarr.json`` carries ``attributes.shardstore`` (our record, read by
``load``) and Zarr consolidated metadata (read by zarr-python), so one read lists every
array. zarr-python parses every document of the consolidated metadata when it opens the
group, and without shardstore it knows no bfloat16 or float8: one such array there made
the whole checkpoint unreadable to it, float32 arrays included. So the consolidated
``metadata`` lists the groups and the arrays of Zarr's core data types only; the arrays
of extension data types are listed beside it, under ``EXTENSION_METADATA``, where plain
zarr-python does not look and shardstore's zarr plug-in (``shardstore._zarr_autoload``)
finds them. Each array's own ``zarr.json`` names its data type as TensorStore writes it
(``"bfloat16"``), for every reader.

Everything read back is validated here: a malformed record gives a
``CheckpointingException`` that names the checkpoint, never a crash or a huge allocation.

The record binds every byte a reader uses: chunks are listed with their crc32c, the
other files (``common.pt``, objects, ``metadata.json``) with theirs, and every array's
and group's ``zarr.json`` and the consolidated metadata are derived from the record
(``CommitRecord.node_documents``), so ``verify`` compares them with what is stored.
From version 4 the record carries its own digest, ``record_digest``: the crc32c of the
root ``zarr.json`` exactly as written, taken while the digest's own value read
``crc32c:00000000`` (``seal_record``). Any change to that file, to the record or to the
consolidated metadata, is found whenever the record is read, for one crc32c pass over
its bytes. A save may keep the nodes' documents in the consolidated metadata only
(``ZarrMetadata.CONSOLIDATED_ONLY``, feature ``consolidated_only``, ``CommitRecord.stored_documents``).

Versions and features (``format.features``): every save writes version 9, frozen, and
lists the features its checkpoint uses in ``requires``. A reader refuses a version it
does not know, a feature it does not know (by name), and a record that uses a feature
it does not list (or, before 9, one newer than its version).
"""

from __future__ import annotations

__all__ = [
    "ArrayPlaces",
    "ArrayRecord",
    "CHUNK_DIGESTS",
    "CHUNK_SEPARATOR",
    "COMMIT_RECORD",
    "COMMON_FILE",
    "CORE_DATA_TYPES",
    "CommitRecord",
    "DELETION_MARKER",
    "DIGEST_HEX_DIGITS",
    "DcpMetadata",
    "FILE_DIGESTS",
    "FIRST_SEALED_VERSION",
    "FORMAT_VERSION",
    "HEX_DIGITS",
    "LEGACY_CHUNK_SEPARATOR",
    "MAX_CHUNK_BYTES",
    "MAX_DELETION_MARKER_BYTES",
    "MAX_ELEMENTS",
    "MAX_KEY_LENGTH",
    "MAX_MARKER_BYTES",
    "MAX_NDIM",
    "MAX_RECORD_BYTES",
    "MAX_SEGMENT_LENGTH",
    "MAX_UNBOUND_CHUNKS",
    "OBJECTS_DIR",
    "ObjectRecord",
    "OtherCheckpointFiles",
    "PACKED_ARRAYS_ATTRIBUTE",
    "PACKS_DIR",
    "READABLE_FORMAT_VERSIONS",
    "RECORD_DIGEST",
    "REPLACED_TAG",
    "REPLACING_PHASE",
    "RESERVED_NAMES",
    "RESERVED_ROOT_NAMES",
    "ReusedChunks",
    "SAVE_MARKER",
    "STAGING_TAG",
    "StatePath",
    "UNSEALED_DIGEST",
    "UnsupportedFormatVersion",
    "ZARR_JSON",
    "ZarrMetadata",
    "array_group_collisions",
    "check_key",
    "check_storable_key",
    "checksum",
    "file_digest",
    "chunk_key",
    "group_metadata",
    "interrupted_replacement",
    "is_committed",
    "is_megatron_object_file",
    "marker_save_id",
    "read_marker",
    "name_other_formats_with",
    "object_path",
    "other_checkpoint_beside",
    "other_checkpoint_files",
    "other_checkpoint_kind",
    "own_markers",
    "parent_groups",
    "read_commit_record",
    "seal_record",
    "sharded_backend",
    "state_paths",
    "unfinished_saves",
    "write_commit_record",
    "zero_fill_value",
]

import functools
import itertools
import json
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

import crc32c
import xxhash

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.errors import CheckpointingException
from shardstore.format.codecs import BYTES_CRC32C, ChunkCodec, codec_for
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.consolidated import ZarrMetadata, zarr_metadata_from_json
from shardstore.format.dtypes import CORE_DATA_TYPES, from_zarr_name
from shardstore.format.features import (
    FORMAT_VERSION,
    UnsupportedFormatVersion,
    allowed_by,
    check_uses,
    required_by,
)
from shardstore.format.pack_listing import (
    PACK_NAME,
    PACKED_ARRAYS_ATTRIBUTE,
    PACKS_DIR,
    packs_from_json,
)
from shardstore.format.readers_attribute import READERS_ATTRIBUTE, readers_note
from shardstore.format.removal_marker import REMOVAL_MARKER, leftover_files
from shardstore.format.sharding import MAX_FLAT_INNER_CHUNKS, ShardingIndexed, spans_blocks
from shardstore.stores.base import Location, NameLimits, atomic_temp_of

# Versions this shardstore reads. Version 1 records carry no save id and no chunk
# checksums: their chunks are checked by their own crc32c only. Versions 1 and 2 name
# chunks ``c/1/0`` (a directory per axis but the last), version 3 ``c.1.0`` (files in
# the array's directory: one directory per tensor instead of two or three). Version 4
# adds the record's own digest (``record_digest``); earlier records have none. Versions
# 5 to 8 each introduced one feature, 9 (frozen) names them (``format.features``).
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
FIRST_SEALED_VERSION = 4
RECORD_DIGEST = "record_digest"
# The digest as it stands in the file while the digest is computed (see seal_record).
UNSEALED_DIGEST = "crc32c:00000000"
CHUNK_SEPARATOR = "."
# Each chunk's 128-bit content digest in an array's record (``format.reuse``).
CHUNK_DIGESTS = "chunk_xxh3_128"
# Each non-array file's 128-bit content digest in the commit record (``file_digest``):
# its crc32c (``files``) alone could hold a changed file equal.
FILE_DIGESTS = "files_xxh3_128"
# Each chunk object's ETag as its object store reported it when the object was written
# (null for a chunk it gave none); only in records of saves to object stores.
CHUNK_ETAGS = "chunk_etags"
MAX_ETAG_CHARS = 128
DIGEST_HEX_DIGITS = 32
HEX_DIGITS = frozenset("0123456789abcdef")
LEGACY_CHUNK_SEPARATOR = "/"
ZARR_JSON = "zarr.json"
COMMIT_RECORD = ZARR_JSON
COMMON_FILE = "common.pt"
OBJECTS_DIR = "__objects__"
# A save in progress (shardstore.format.commit): its marker file, naming its save id, and the
# names of its staging directory and of a replaced checkpoint set aside, next to the target.
SAVE_MARKER = ".shardstore-save.json"
# Written into a checkpoint before the manager deletes it (``shardstore.tools.manager``): proves
# that a directory without a commit record is one of ours being deleted.
DELETION_MARKER = ".shardstore-deleting.json"
STAGING_TAG = ".shardstore-save-"
REPLACED_TAG = ".shardstore-replaced-"
# The field of the save marker that a replacement in a shared directory writes into the
# target (``ByRename._replace_beside``), with its phase: ``SETTING_ASIDE`` while the old
# checkpoint's entries move out to its replaced directory, ``MOVING_IN`` once all have
# and the new checkpoint's move in.
REPLACING_PHASE = "replacing_beside"
SETTING_ASIDE, MOVING_IN = "setting_aside", "moving_in"
# The most bytes a marker holds (a few ids); a larger file of that name is not ours.
MAX_MARKER_BYTES = 4096

# Upper bounds that a record read back must respect (hostile-input guard).
MAX_NDIM = 32
MAX_ELEMENTS = 2**62
MAX_CHUNK_BYTES = 2**34  # one chunk is read into memory whole; 16 GiB is far above any we write
# Largest commit record read (a crc32c per chunk: about 11 bytes each in JSON).
MAX_RECORD_BYTES = 2**30
# The checkpoint manager's deletion marker also holds a copy of the commit record (what
# finishing the deletion removes once the record itself is gone).
MAX_DELETION_MARKER_BYTES = MAX_RECORD_BYTES + 4096
# Chunks of all arrays of a format-1 record, which lists no checksums to pay for them.
MAX_UNBOUND_CHUNKS = 2**24


def _library_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardstore")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ArrayRecord:
    """One global array: what its ``zarr.json`` says, in shardstore's terms.

    Attributes:
        key: the ShardedTensor key, also the array's path in the group.
        shape: global shape, in elements.
        dtype: Zarr v3 data type name (``bfloat16``, ``float32``, ...).
        chunk_shape: regular chunk grid, aligned with the sharding grid of the save.
        chunk_crcs: crc32c of every chunk, in C order over the grid, as the chunk's
            writer reported it at the save (None: not bound, format version 1).
        chunk_digests: a 128-bit content digest (XXH3-128, 32 hex digits) of every
            chunk's bytes, in the order of ``chunk_crcs``, as its writer reported it
            (None in records written before digests were kept). A later save reuses a
            chunk only when its new bytes have the same digest (``format.reuse``):
            crc32c alone never decides that two chunks are equal.
        chunk_separator: of the chunk keys (Zarr's default encoding): ``.`` since format
            version 3, ``/`` before.
        flattened_block: for an array saved from flattened ranges (the distributed
            optimizer's ``from_rank_offsets_flat``), the shape of the N-D blocks those
            ranges were cut from (1 on prepended axes); None for an array saved from
            whole blocks or irregular cuts, and in records written before it was kept.
            Only ``strategies.resharding`` and ``load_tensors_metadata`` read it: the
            array itself is the global tensor either way.
        codec: how each chunk is stored (``format.codecs``); the record names its
            ``codecs`` only when they are not ``BYTES_CRC32C``, every array's so far.
        chunk_etags: the tag the store gave each chunk's object (None for a chunk it
            gave none), in the order of ``chunk_crcs``; None where no chunk has one
            (older records): on object stores the ETag it reported when it wrote the
            object, on local disks the file's identity when its bytes were last proven
            (``stores.file_identity``). A later save proves its copy or link of the
            object by it (``ChunkStore.share_from``).
        pack: the pack (``packs/<rank>-<n>.zip``, feature ``packs``) that holds the
            array's ``zarr.json`` and chunks as zip members, or None: the array is a
            directory of its own. Set by binding (``with_pack``), as its writer chose.
        chunk_offsets: with ``pack``, the byte offset inside the pack of each chunk's
            stored bytes (its member's data), in the order of ``chunk_crcs``.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    chunk_crcs: tuple[int, ...] | None = None
    chunk_separator: str = CHUNK_SEPARATOR
    flattened_block: tuple[int, ...] | None = None
    chunk_digests: tuple[str, ...] | None = None
    codec: ChunkCodec = BYTES_CRC32C
    chunk_etags: tuple[str | None, ...] | None = None
    pack: str | None = None
    chunk_offsets: tuple[int, ...] | None = None

    def chunk_key(self, index: tuple[int, ...]) -> str:
        """The key of chunk ``index`` inside the array: ``c.1.0`` (``c`` for a 0-d array)."""
        return chunk_key(index, self.chunk_separator)

    @property
    def chunk_count(self) -> int:
        return math.prod(self.chunk_grid)

    @property
    def itemsize(self) -> int:
        return from_zarr_name(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @functools.cached_property
    def chunk_grid(self) -> tuple[int, ...]:
        """Chunks along each axis (the regular grid tiles the array, edge chunks padded)."""
        return _chunk_grid(self.shape, self.chunk_shape)

    def chunk_nbytes(self, index: tuple[int, ...]) -> int:
        """Bytes of the array inside chunk ``index`` (edge chunks hold less than a
        whole chunk's worth)."""
        extent = (min(c, n - i * c) for n, c, i in zip(self.shape, self.chunk_shape, index))
        return math.prod(extent) * self.itemsize

    def chunk_indices(self) -> Iterator[tuple[int, ...]]:
        """Every chunk of the array: each is stored (none is left out as fill value)."""
        return itertools.product(*map(range, self.chunk_grid))

    def zarr_metadata(self) -> dict[str, Any]:
        """The array's ``zarr.json`` document, as TensorStore would write it."""
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.chunk_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": self.chunk_separator}},
            "fill_value": zero_fill_value(self.dtype),
            "codecs": self.codec.zarr_codecs(self.itemsize),
            "dimension_names": self.dimension_names(),
        }

    def dimension_names(self) -> list[str]:
        """One name per axis, unique to the array (``fc1.0``, ``fc1.1``): xarray needs
        names to open a Zarr v3 array, and arrays of one group must not share a name
        for axes of different sizes."""
        base = self.key.rsplit("/", 1)[-1]
        return [f"{base}.{axis}" for axis in range(len(self.shape))]

    def to_summary(self) -> dict[str, Any]:
        return {**self._summary_head(), **self._summary_checksums()}

    def _summary_head(self) -> dict[str, Any]:
        """The summary's fields that binding the chunks leaves as they are."""
        head: dict[str, Any] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "chunk_grid": list(self.chunk_grid),
        }
        if self.flattened_block is not None:
            head["flattened_block"] = list(self.flattened_block)
        if self.codec != BYTES_CRC32C:
            head["codecs"] = self.codec.zarr_codecs(self.itemsize)
        return head

    def _summary_checksums(self) -> dict[str, Any]:
        """The summary's fields that binding the chunks sets (``with_chunk_crcs``)."""
        checksums: dict[str, Any] = {}
        if self.chunk_crcs is not None:
            checksums["chunk_crc32c"] = list(self.chunk_crcs)
        if self.chunk_digests is not None:
            checksums[CHUNK_DIGESTS] = list(self.chunk_digests)
        if self.chunk_etags is not None:
            checksums[CHUNK_ETAGS] = list(self.chunk_etags)
        if self.pack is not None:
            checksums["pack"] = self.pack
            checksums["chunk_offsets"] = list(self.chunk_offsets or ())
        return checksums

    @functools.cached_property
    def encoded_document(self) -> str:
        """``zarr_metadata()`` as the commit record writes it (compact JSON): encoded once
        per record, and kept by the records ``with_chunk_crcs`` binds from it."""
        return _encode_compact(self.zarr_metadata())

    @functools.cached_property
    def _encoded_summary_head(self) -> str:
        return _encode_compact(self._summary_head())

    def encoded_summary(self) -> str:
        """``to_summary()`` as the commit record writes it (compact JSON), its head
        encoded once per record (as ``encoded_document``)."""
        checksums = self._summary_checksums()
        if not checksums:
            return self._encoded_summary_head
        return f"{self._encoded_summary_head[:-1]},{_encode_compact(checksums)[1:]}"

    def encode_ahead(self) -> None:
        """Encodes now what ``encoded_document`` and ``encoded_summary`` keep."""
        self.encoded_document  # noqa: B018  (a cached property: computed and kept)
        self._encoded_summary_head  # noqa: B018

    def chunk_ordinal(self, index: tuple[int, ...]) -> int:
        """The position of chunk ``index`` in ``chunk_crcs`` and ``chunk_digests`` (C
        order over the grid)."""
        ordinal = 0
        for i, n in zip(index, self.chunk_grid):
            ordinal = ordinal * n + i
        return ordinal

    def with_chunk_crcs(
        self, crcs: dict[tuple[int, ...], int], where: str, digests: dict[tuple[int, ...], str] | None = None,
        etags: dict[tuple[int, ...], str] | None = None,
    ) -> ArrayRecord:
        """This record bound to the crc32c (and content digest, where every chunk has
        one; and ETag, where any has one) its writers reported for each chunk.

        Raises:
            CheckpointingException: a chunk no rank reported (missing).
        """
        indices = self._reported(crcs, where)
        try:
            bound_digests = None if digests is None else tuple([digests[index] for index in indices])
        except KeyError:
            bound_digests = None
        bound_etags = tuple([etags.get(index) for index in indices]) if etags else None
        return self._bound(tuple([crcs[index] for index in indices]), bound_digests, bound_etags)

    def with_reports(self, written: Mapping[tuple[int, ...], Any], where: str) -> ArrayRecord:
        """``with_chunk_crcs`` given each chunk's report by grid index
        (``format.chunks.WrittenChunk``: its ``crc``, ``digest`` and ``etag``), in one pass.

        Raises:
            CheckpointingException: a chunk no rank reported (missing).
        """
        reports = [written[index] for index in self._reported(written, where)]
        crcs = tuple([r.crc for r in reports])
        digests = tuple([r.digest for r in reports])
        etags = tuple([r.etag for r in reports])
        return self._bound(crcs, digests, None if etags.count(None) == len(etags) else etags)

    def _reported(self, reported: Mapping[tuple[int, ...], Any], where: str) -> list[tuple[int, ...]]:
        """Every chunk's index, each of which ``reported`` holds (else raises, naming
        the first ones missing)."""
        indices = list(self.chunk_indices())
        if any(index not in reported for index in indices):
            missing = [index for index in indices if index not in reported]
            raise CheckpointingException(
                f"{where}: no rank wrote chunk(s) {missing[:5]} of array {self.key!r}; not committing"
            )
        return indices

    def _bound(
        self, crcs: tuple[int, ...], digests: tuple[str, ...] | None, etags: tuple[str | None, ...] | None,
    ) -> ArrayRecord:
        """``dataclasses.replace`` of the chunks' checksums, which no other field is
        checked against and no encoded part holds (``encoded_document``): every other
        field and those parts carried over, no ``__init__`` run, a fifth of ``replace``'s
        time."""
        bound = object.__new__(ArrayRecord)
        object.__setattr__(bound, "__dict__", {
            **self.__dict__, "chunk_crcs": crcs, "chunk_digests": digests, "chunk_etags": etags,
        })
        return bound

    def with_pack(self, pack: str, offsets: tuple[int, ...]) -> ArrayRecord:
        """This record with its chunks in ``pack`` at ``offsets`` (C order over the
        grid), as ``_bound`` carries the other fields over."""
        bound = object.__new__(ArrayRecord)
        object.__setattr__(bound, "__dict__", {**self.__dict__, "pack": pack, "chunk_offsets": tuple(offsets)})
        return bound

    @classmethod
    def from_summary(
        cls, key: str, summary: Any, where: str, bound: bool = True, separator: str = CHUNK_SEPARATOR
    ) -> ArrayRecord:
        if not isinstance(summary, dict):
            raise CheckpointingException(f"{where}: record of array {key!r} is not an object")
        shape = _int_tuple(summary.get("shape"), f"{where}: shape of {key!r}", minimum=0)
        chunk_shape = _int_tuple(summary.get("chunk_shape"), f"{where}: chunk shape of {key!r}", minimum=1)
        if len(shape) != len(chunk_shape):
            raise CheckpointingException(
                f"{where}: array {key!r} has shape {shape} but chunk shape {chunk_shape}"
            )
        if math.prod(shape) > MAX_ELEMENTS:
            raise CheckpointingException(f"{where}: array {key!r} has an absurd shape {shape}")
        try:
            itemsize = from_zarr_name(summary.get("dtype")).itemsize
        except TypeError as exc:
            raise CheckpointingException(f"{where}: array {key!r}: {exc}") from exc
        codec = BYTES_CRC32C
        if "codecs" in summary:
            codec = codec_for(summary["codecs"], itemsize, where, key)
            codec.check_chunk_shape(chunk_shape, where, key)
        flattened_block = _flattened_block(summary, key, shape, chunk_shape, codec, bound, where)
        grid = list(_chunk_grid(shape, chunk_shape))
        if grid != summary.get("chunk_grid"):
            raise CheckpointingException(
                f"{where}: array {key!r}: chunk grid {summary.get('chunk_grid')!r} does not tile shape "
                f"{shape} in chunks of {chunk_shape} (expected {grid})"
            )
        if math.prod(chunk_shape) * itemsize > MAX_CHUNK_BYTES:
            raise CheckpointingException(f"{where}: array {key!r} has an absurd chunk shape {chunk_shape}")
        chunk_count = math.prod(grid)
        if not bound:
            if chunk_count > MAX_UNBOUND_CHUNKS:
                raise CheckpointingException(f"{where}: array {key!r} has an absurd chunk grid {tuple(grid)}")
            return cls(key, shape, summary["dtype"], chunk_shape, chunk_separator=separator,
                       flattened_block=flattened_block, codec=codec)
        # The record must list a crc32c for every chunk, so a grid of 2**31 chunks needs
        # a record of gigabytes (refused by its size bound) before anything iterates it.
        crcs = summary.get("chunk_crc32c")
        if not isinstance(crcs, list) or len(crcs) != chunk_count:
            raise CheckpointingException(
                f"{where}: array {key!r} must list a crc32c for each of its {chunk_count} chunks"
            )
        # Checked in bulk (type set, min, max) rather than crc by crc: 2.5 instead of 4.3 us
        # per array of 64 chunks, on every rank of every load (the record lists every chunk).
        if crcs and (set(map(type, crcs)) != {int} or min(crcs) < 0 or max(crcs) >= 2**32):
            raise CheckpointingException(f"{where}: array {key!r} has malformed chunk checksums")
        # One construction (no ``replace``): 10,000 small arrays parse in about half the time.
        pack, offsets = _packed_at(summary, key, chunk_count, codec, where)
        return cls(key, shape, summary["dtype"], chunk_shape, chunk_crcs=tuple(crcs), chunk_separator=separator,
                   flattened_block=flattened_block, chunk_digests=_chunk_digests(summary, key, chunk_count, where),
                   codec=codec, chunk_etags=_chunk_etags(summary, key, chunk_count, where), pack=pack,
                   chunk_offsets=offsets)


def _chunk_grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Chunks along each axis of a regular grid of ``chunk_shape`` over ``shape``."""
    return tuple(-(-n // c) for n, c in zip(shape, chunk_shape))


def _flattened_block(
    summary: dict[str, Any], key: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], codec: ChunkCodec,
    bound: bool, where: str,
) -> tuple[int, ...] | None:
    """The record's ``flattened_block``, checked so that the blocks it cuts the array
    into are no more than what a reader reads whole: a save's chunks (inner chunks, in
    shards) never cross the blocks its flattened ranges were cut from, so each block
    holds whole ones (at least as large along every axis, or empty). A shard may span
    several blocks (feature ``flat_shards``), holding at most ``MAX_FLAT_INNER_CHUNKS`` inner chunks.
    ``strategies.resharding`` makes one request per saved block a load's block overlaps;
    bounded by the chunks, which a bound record lists one by one (times that bound), that
    work costs no more than the record's size.

    Raises:
        CheckpointingException: naming the array: a block that does not fit the shape,
            is smaller than a chunk (an inner chunk), spans more inner chunks per shard
            than the bound, or stands in a version 1 record (unbound: its chunks are not
            listed, and no shardstore wrote a flattened block into one).
    """
    value = summary.get("flattened_block")
    if value is None:
        return None
    block = _int_tuple(value, f"{where}: flattened block of {key!r}", minimum=0)
    if len(block) != len(shape) or any(b > n for b, n in zip(block, shape)):
        raise CheckpointingException(
            f"{where}: array {key!r} of shape {shape} names a flattened block {block} that does not fit it"
        )
    if not bound:
        raise CheckpointingException(
            f"{where}: array {key!r} names a flattened block in a version 1 record, which no shardstore wrote; "
            "the commit record was edited or damaged"
        )
    read_whole = codec.chunk_shape if isinstance(codec, ShardingIndexed) else chunk_shape
    if spans_blocks(block, read_whole):
        raise CheckpointingException(
            f"{where}: array {key!r} names a flattened block {block} smaller than its chunks {read_whole}, which "
            "no save writes; the commit record was edited or damaged: restore it from a copy, or load an earlier "
            "checkpoint"
        )
    if spans_blocks(block, chunk_shape) and math.prod(-(-c // i) for c, i in zip(chunk_shape, read_whole)) > (
            MAX_FLAT_INNER_CHUNKS):
        raise CheckpointingException(
            f"{where}: array {key!r} is stored in shards of {chunk_shape} spanning its flattened blocks {block} with "
            f"more than {MAX_FLAT_INNER_CHUNKS} inner chunks {read_whole}, which no save writes; the commit record "
            "was edited or damaged: restore it from a copy, or load an earlier checkpoint"
        )
    return block


def _chunk_digests(summary: dict[str, Any], key: str, chunk_count: int, where: str) -> tuple[str, ...] | None:
    """The record's chunk digests (optional: records written before they were kept have
    none), checked in bulk: one per chunk, each 32 lower-case hex digits."""
    digests = summary.get(CHUNK_DIGESTS)
    if digests is None:
        return None
    if (
        not isinstance(digests, list) or len(digests) != chunk_count
        or any(not isinstance(d, str) or len(d) != DIGEST_HEX_DIGITS for d in digests)
        or not set("".join(digests)) <= HEX_DIGITS
    ):
        raise CheckpointingException(
            f"{where}: array {key!r} must list a {DIGEST_HEX_DIGITS}-digit hex digest for each of its "
            f"{chunk_count} chunks"
        )
    return tuple(digests)


def _packed_at(
    summary: dict[str, Any], key: str, chunk_count: int, codec: ChunkCodec, where: str,
) -> tuple[str | None, tuple[int, ...] | None]:
    """The record's ``pack`` and ``chunk_offsets`` of an array (feature ``packs``; both or
    neither): a pack name of the format's (``packs/<rank>-<n>.zip``) and one offset per
    chunk. Only ``[bytes, crc32c]`` arrays are packed. Whether the pack is listed, and
    the offsets inside it, ``CommitRecord`` checks against its ``packs``."""
    pack, offsets = summary.get("pack"), summary.get("chunk_offsets")
    if pack is None and offsets is None:
        return None, None
    if not isinstance(pack, str) or not PACK_NAME.fullmatch(pack) or codec != BYTES_CRC32C:
        raise CheckpointingException(
            f"{where}: array {key!r} names a malformed pack {pack!r} (packs/<rank>-<n>.zip, of [bytes, crc32c] "
            "arrays only); the commit record was edited or damaged"
        )
    if not isinstance(offsets, list) or len(offsets) != chunk_count or any(
        type(o) is not int or o < 0 for o in offsets
    ):
        raise CheckpointingException(
            f"{where}: array {key!r} in pack {pack!r} must list a byte offset (an integer >= 0) for each of its "
            f"{chunk_count} chunks in 'chunk_offsets'"
        )
    return pack, tuple(offsets)


def _chunk_etags(summary: dict[str, Any], key: str, chunk_count: int, where: str) -> tuple[str | None, ...] | None:
    """The record's chunk ETags (optional: only saves to object stores keep them)."""
    etags = summary.get(CHUNK_ETAGS)
    if etags is None:
        return None
    if not isinstance(etags, list) or len(etags) != chunk_count or any(
        e is not None and (not isinstance(e, str) or not 0 < len(e) <= MAX_ETAG_CHARS) for e in etags
    ):
        raise CheckpointingException(
            f"{where}: array {key!r} must list an ETag (a string of at most {MAX_ETAG_CHARS} characters, or null) "
            f"for each of its {chunk_count} chunks in {CHUNK_ETAGS!r}"
        )
    return tuple(etags)


def chunk_key(index: tuple[int, ...], separator: str = CHUNK_SEPARATOR) -> str:
    """Zarr v3's default chunk key encoding: ``c.1.0`` (``c/1/0`` with the ``/`` separator
    of formats 1 and 2; ``c`` for a 0-d array)."""
    return separator.join(["c", *map(str, index)])


def zero_fill_value(zarr_name: str) -> bool | int | float | list[float]:
    """Zero as the Zarr v3 spec spells a fill value of the data type: ``false`` for
    bool, ``0`` for integers, ``0.0`` for real floats and ``[0.0, 0.0]`` (real part,
    imaginary part) for complex types. Every chunk is stored, so no reader ever fills
    with it, but every reader parses it. Earlier saves wrote ``0.0`` for complex types
    too, which TensorStore refuses for that array and zarr-python for the whole group;
    such checkpoints keep their format version: ``load`` never reads the fill value,
    and ``verify`` reads that ``0.0`` as the zero it means (``integrity._as_read``)."""
    if zarr_name == "bool":
        return False
    if zarr_name.startswith(("int", "uint")):
        return 0
    if zarr_name.startswith("complex"):
        return [0.0, 0.0]
    return 0.0


def _int_tuple(value: Any, what: str, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise CheckpointingException(f"{what} must be a list of at most {MAX_NDIM} integers, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value):
        raise CheckpointingException(f"{what} must hold integers >= {minimum}, got {value!r}")
    return tuple(value)


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A group's ``zarr.json`` document."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


MAX_KEY_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255
# Names no segment of a key being written may take: the metadata document of every Zarr
# group and array; and, as the first segment, the checkpoint's own files (``__objects__``
# is refused as ``__``-prefixed, the save machinery's names as ``.``-prefixed).
RESERVED_NAMES = frozenset({ZARR_JSON})
RESERVED_ROOT_NAMES = {CONFIG_FNAME: "backend metadata", COMMON_FILE: "common state"}
# One search instead of a generator over the key's characters: a third of ``check_key``'s
# time, which every save and load spends on every key.
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f]")


def check_key(
    key: Any, where: str | None = None, storage: NameLimits | None = None, files: tuple[str, ...] = ()
) -> None:
    """Rejects keys that could escape the checkpoint or clash with the format.

    A key is a ``/``-separated path inside the checkpoint. Refused: non-strings, empty
    segments (so no leading, trailing or double ``/``), ``.`` and ``..``, segments
    starting with ``__`` (reserved for shardstore), backslashes, NUL and other control
    characters, and absurd lengths.

    ``storage``: the key is about to be written there (a save), so it must also name
    files that cannot collide with the format's own or fail to be created. Refused then:
    ``zarr.json`` as any segment, ``metadata.json`` and ``common.pt`` as the first,
    ``packs/<rank>-<n>.zip`` (a pack's name) as the first two,
    segments starting with ``.`` (the save machinery's marker and temporary files, other
    tools' metadata such as DCP's ``.metadata``), segments over 255 bytes of UTF-8; and
    ``files`` (the key's files, relative to the checkpoint) whose name or path is longer
    than ``storage`` takes. Reading checks without ``storage``: what an older version
    committed stays readable (on S3 nothing collides with ``common.pt/zarr.json``), and a
    key read back only has to stay inside the checkpoint.
    """
    context = f" in {where}" if where else ""

    def fail(reason: str) -> None:
        raise CheckpointingException(f"Invalid checkpoint key {key!r}{context}: {reason}")

    if not isinstance(key, str):
        fail("keys must be strings")
    if len(key) > MAX_KEY_LENGTH:
        fail(f"longer than {MAX_KEY_LENGTH} characters")
    if _CONTROL_CHARACTER.search(key):
        fail("contains NUL or another control character")
    if "\\" in key:
        fail("contains a backslash")
    segments = key.split("/")
    for segment in segments:
        if segment == "":
            fail("has an empty path segment (leading, trailing or double '/')")
        if segment in (".", ".."):
            fail(f"has a {segment!r} path segment")
        if segment.startswith("__"):
            fail("has a segment starting with '__' (reserved for shardstore)")
        if len(segment) > MAX_SEGMENT_LENGTH:
            fail(f"has a path segment longer than {MAX_SEGMENT_LENGTH} characters")
    if storage is not None and (reason := _unstorable(key, segments, storage, files)):
        fail(reason)


def check_storable_key(key: str, where: str | None, storage: NameLimits, files: tuple[str, ...] = ()) -> None:
    """``check_key(key, where, storage, files)`` of a key ``check_key`` accepted already
    (a save's keys, checked by each rank as it made their records): only what
    ``storage`` adds, with the same message."""
    if reason := _unstorable(key, key.split("/"), storage, files):
        raise CheckpointingException(f"Invalid checkpoint key {key!r}{f' in {where}' if where else ''}: {reason}")


def _unstorable(key: str, segments: list[str], storage: NameLimits, files: tuple[str, ...]) -> str | None:
    """Why a key (already checked as safe) cannot be written to ``storage``, with what to
    do about it; None if it can. An ASCII name's bytes are its characters (no encoding)."""
    plain = key.isascii()
    if not plain:
        try:
            key.encode()
        except UnicodeEncodeError:
            return "is not valid Unicode text (it holds a lone surrogate); rename the key"
    if segments[0] in RESERVED_ROOT_NAMES:
        return (f"{segments[0]!r} is the name of the checkpoint's own file of the "
                f"{RESERVED_ROOT_NAMES[segments[0]]}, which the key's files would collide with; rename the key")
    if segments[0] == PACKS_DIR and PACK_NAME.fullmatch(pack := "/".join(segments[:2])):
        return (f"{pack!r} is the name of a file of packed small arrays "
                "(SaveOptions.pack_arrays_up_to), which the key's files would collide with; rename the key")
    for segment in segments:
        if segment in RESERVED_NAMES:
            return (f"{segment!r} is the name of the metadata document of every Zarr group and array, which "
                    "the key's files would collide with; rename the key")
        if segment.startswith("."):
            return (f"has a segment starting with '.' ({segment!r}): such names are kept for the save's own "
                    "marker and temporary files and for other tools' metadata; rename the key")
        if not plain and (size := len(segment.encode())) > MAX_SEGMENT_LENGTH:
            return (f"has a path segment of {size} bytes in UTF-8, longer than the {MAX_SEGMENT_LENGTH} bytes "
                    "a name may have; shorten the key")
    for rel in files:
        plain = rel.isascii()
        size = len(rel) if plain else len(rel.encode())
        if storage.max_path_bytes is not None and size > storage.max_path_bytes:
            return (f"its file {rel!r} would have a path of {size} bytes, more than the {storage.max_path_bytes} "
                    f"left by {storage.path_limit}; shorten the key (or save to a shorter path)")
        name = max(map(len, rel.split("/"))) if plain else max(len(n.encode()) for n in rel.split("/"))
        if storage.max_name_bytes is not None and name > storage.max_name_bytes:
            return (f"its file {rel!r} would have a name of {name} bytes, longer than the "
                    f"{storage.max_name_bytes} bytes a file name may have there; shorten the key")
    return None


def array_group_collisions(keys: list[str]) -> list[str]:
    """Keys that cannot all live in one Zarr hierarchy: ``a`` and ``a/b`` would make
    ``a`` both an array and the group holding ``b`` (the second save would write its
    chunks inside the first's array). One message per clash, naming both keys."""
    arrays = set(keys)
    return [
        f"{group!r} is both an array and the group of {key!r}"
        for key in sorted(k for k in arrays if "/" in k)
        for group in parent_groups([key])
        if group in arrays
    ]


def parent_groups(keys: list[str]) -> list[str]:
    """Every intermediate group path implied by ``/`` in the keys, parents first."""
    groups = set()
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    return sorted(groups, key=lambda g: (g.count("/"), g))


@dataclass(frozen=True)
class ObjectRecord:
    """Where a ShardedObject's shards are: its key and the unique keys of its shards."""

    key: str
    shard_keys: tuple[str, ...]


@dataclass(frozen=True)
class ReusedChunks:
    """What a checkpoint shares with the earlier one its save reused from
    (``format.reuse``): informational, for ``inspect`` and the logs. The chunks are
    listed in the record like any other; the checkpoint stands alone.

    Attributes:
        checkpoint: where the earlier checkpoint was, as its save saw it.
        save_id: the earlier checkpoint's save id.
        chunks: how many chunks were shared instead of written.
        nbytes: their stored bytes (each chunk's data and its crc32c).
    """

    checkpoint: str
    save_id: str
    chunks: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "save_id": self.save_id, "chunks": self.chunks, "bytes": self.nbytes}

    @classmethod
    def from_json(cls, value: Any, where: str) -> ReusedChunks | None:
        if value is None:
            return None
        fields = (value.get("checkpoint"), value.get("save_id"), value.get("chunks"), value.get("bytes")) if (
            isinstance(value, dict)) else None
        if (fields is None or not isinstance(fields[0], str) or not isinstance(fields[1], str)
                or not all(isinstance(n, int) and n >= 0 for n in fields[2:])):
            raise CheckpointingException(f"{where}: malformed 'reused_from' in the commit record")
        return cls(*fields)


StatePath = tuple[str | int, ...]


def state_paths(planner_data: Any, entries: int) -> dict[str, StatePath] | None:
    """Where each flattened key of a DCP save was in the state dict DCP was given (the
    dict keys and list indices its default planner records as ``planner_data``, by which
    ``dcp_to_torch_save`` rebuilds the nesting), checked; None where ``planner_data`` is
    not such a mapping. Each list index is below ``entries`` and below the number of
    paths under that list, so rebuilding the nesting allocates at most one slot per path
    and level, whatever a hostile file says."""
    if not isinstance(planner_data, dict):
        return None
    paths: dict[str, StatePath] = {}
    for key, path in planner_data.items():
        well_formed = isinstance(key, str) and isinstance(path, tuple) and len(path) > 0 and all(
            isinstance(part, str) or (type(part) is int and 0 <= part < entries) for part in path
        )
        if not well_formed:
            return None
        paths[key] = path
    return paths if _lists_are_dense(paths.values()) else None


def _lists_are_dense(paths: Iterable[StatePath]) -> bool:
    """Whether every list the paths index into has fewer slots than paths under it."""
    under: Counter[tuple] = Counter()
    largest: dict[tuple, int] = {}
    for path in paths:
        for depth, part in enumerate(path):
            if type(part) is int:
                prefix = path[:depth]
                under[prefix] += 1
                largest[prefix] = max(largest.get(prefix, 0), part)
    return all(index < under[prefix] for prefix, index in largest.items())


@dataclass(frozen=True)
class DcpMetadata:
    """What a save through PyTorch DCP's API (``tools.dcp_storage.ShardstoreWriter``)
    recorded of DCP's own metadata, for ``ShardstoreReader.read_metadata`` to give back:
    sealed in the commit record like the rest of it. Checkpoints saved before it existed,
    and every ``shardstore.save``, have none.

    Attributes:
        paths: DCP's ``Metadata.planner_data`` (each saved name -> its dict keys and list
            indices in the caller's state dict), with the list slots DCP's flattening
            dropped (empty dicts) added; None where the planner recorded no such mapping.
        checkpoint_id, save_id, modules: DCP's ``StorageMeta`` of the save, the
            checkpoint id as text.
    """

    paths: dict[str, StatePath] | None
    checkpoint_id: str | None = None
    save_id: str | None = None
    modules: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        paths = None if self.paths is None else {key: list(path) for key, path in self.paths.items()}
        return {"planner_paths": paths, "checkpoint_id": self.checkpoint_id, "save_id": self.save_id,
                "modules": list(self.modules)}

    @classmethod
    def from_json(cls, value: Any, where: str) -> DcpMetadata | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise CheckpointingException(f"{where}: malformed 'dcp' in the commit record")
        modules = value.get("modules", [])
        paths = _paths_from_json(value.get("planner_paths"), where)
        texts = (value.get("checkpoint_id"), value.get("save_id"))
        if not all(t is None or isinstance(t, str) for t in texts) or not (
                isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            raise CheckpointingException(f"{where}: malformed DCP storage metadata in the commit record")
        return cls(paths, *texts, tuple(modules))


def _paths_from_json(raw: Any, where: str) -> dict[str, StatePath] | None:
    """``DcpMetadata.paths`` as JSON holds them (lists), checked by ``state_paths``."""
    if raw is None:
        return None
    lists = isinstance(raw, dict) and all(isinstance(path, list) for path in raw.values())
    paths = state_paths({key: tuple(path) for key, path in raw.items()}, len(raw)) if lists else None
    if paths is None:
        raise CheckpointingException(f"{where}: malformed DCP planner paths in the commit record")
    return paths


@dataclass(frozen=True)
class ArrayPlaces:
    """Where an import of model files (``tools.convert``: a ``torch.save`` file,
    safetensors) found the arrays whose keys do not spell their places: under an int
    dict key (``optim/state/0/exp_avg`` at ``sd["optim"]["state"][0]["exp_avg"]``), in a
    list, under a key holding a ``/``. The save keeps in the common state no dict or
    list that held only arrays, and a key's text says neither, so without it an export
    would put the array under the str key ``"0"``. Sealed in the commit record; every
    other save, and an import by a shardstore before it, has none.

    Attributes:
        paths: each such array's key -> its dict keys and list indices; an int is a
            list index unless the container it indexes is in ``int_keyed``; a dict key
            of another type than str and int is its text, as the array's key spells it.
        int_keyed: the places of the dicts on those paths that an int part is a key of.
    """

    paths: dict[str, StatePath]
    int_keyed: frozenset[StatePath] = frozenset()

    def to_json(self) -> dict[str, list[Any]]:
        """Each path as a list of parts: a str key, an int list index, ``{"int": n}``
        an int key."""
        return {
            key: [{"int": part} if type(part) is int and path[:depth] in self.int_keyed else part
                  for depth, part in enumerate(path)]
            for key, path in sorted(self.paths.items())
        }

    @classmethod
    def from_json(cls, value: Any, arrays: Collection[str], where: str) -> ArrayPlaces | None:
        """The places ``value`` holds, of some of ``arrays``; anything malformed (a part
        of another type, a container both a dict and a list) is refused naming ``where``.
        Its list indices are bounded where the common state is known (``tools.convert``)."""
        if value is None:
            return None
        try:
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            paths: dict[str, StatePath] = {}
            int_keyed: set[StatePath] = set()
            kinds: dict[StatePath, type] = {}
            for key, parts in value.items():
                if key not in arrays or not isinstance(parts, list) or not parts:
                    raise ValueError(f"{key!r} is not an array with a list of parts")
                path: list[str | int] = []
                for part in parts:
                    keyed = isinstance(part, dict) and list(part) == ["int"] and type(part["int"]) is int
                    if not (keyed or isinstance(part, str) or (type(part) is int and part >= 0)):
                        raise ValueError(f"{key!r} has the part {part!r}")
                    prefix, kind = tuple(path), list if type(part) is int else dict
                    if kinds.setdefault(prefix, kind) is not kind:
                        raise ValueError(f"{list(prefix)} is both a dict and a list")
                    if keyed:
                        int_keyed.add(prefix)
                    path.append(part["int"] if keyed else part)
                paths[key] = tuple(path)
        except ValueError as exc:
            raise CheckpointingException(
                f"{where}: malformed 'places' in the commit record ({exc}); it is damaged or was edited"
            ) from exc
        return cls(paths, frozenset(int_keyed))


@dataclass(frozen=True)
class CommitRecord:
    """What the root ``zarr.json`` vouches for: a complete checkpoint.

    Attributes:
        arrays: every ShardedTensor key's array record.
        objects: every ShardedObject key with its shards' unique keys.
        world_size: ranks that saved it (informational).
        format_version: shardstore format version.
        library_version: shardstore version that wrote it.
        created: UNIX time of the commit, in seconds.
        files: checksum (``checksum()``) of every non-array file: the common state,
            sharded objects and ``metadata.json``, by relative path.
        save_id: the save that committed it (``shardstore.format.commit``); a save that
            replaces a checkpoint checks this id before it publishes.
        external_files: checksum of every file the caller of an in-place save wrote
            into the checkpoint before the commit (Megatron-Core's own ``save`` writes
            its sharded objects there itself), by relative path. shardstore reads only
            the ShardedObject shards among them (``object_shard_files``), checked like
            its own files; ``verify`` checks them all.
        reused_from: the earlier checkpoint whose chunks this save shared (hard links,
            clones or server-side copies) instead of writing them again, or None.
        beside: the top-level names another program had put into the checkpoint's
            directory when a save into a shared directory was published beside them
            (``format.commit``: ModelOpt's ``modelopt_state/`` in a Megatron-LM
            iteration). The save did not write them and the record does not vouch for
            them; ``verify`` names them as another program's instead of as damage, and
            a save replacing the checkpoint in a shared directory leaves them in place
            (``format.commit.ByRename``); any other replacing save refuses.
        dcp: what a save through DCP's API recorded of DCP's metadata, or None.
        places: where an import of model files found the arrays whose keys do not
            spell their places (``ArrayPlaces``), or None.
        file_digests: XXH3-128 (``file_digest``) of every file of ``files`` and
            ``external_files``, by relative path: a file is what the save wrote where
            both its crc32c and this digest match. Records written before it was added
            have none; their files are checked by their crc32c only.
        zarr_metadata: where the nodes' metadata documents are (``ZarrMetadata``):
            their own ``zarr.json`` files, or only the root's consolidated metadata
            (feature ``consolidated_only``, ``with_zarr_metadata``).
        packs: every pack of the checkpoint (``packs/<rank>-<n>.zip``, feature
            ``packs``) with its size in bytes; the arrays in them name theirs (``ArrayRecord.pack``).
        layout: the ``StorageLayout`` the save wrote by, as chosen (``to_json``), or
            None (records before it): informative, what a reader must understand is
            ``requires``.
    """

    arrays: dict[str, ArrayRecord]
    objects: dict[str, ObjectRecord] = field(default_factory=dict)
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    library_version: str = field(default_factory=_library_version)
    created: float = field(default_factory=time.time)
    files: dict[str, str] = field(default_factory=dict)
    save_id: str = ""
    external_files: dict[str, str] = field(default_factory=dict)
    reused_from: ReusedChunks | None = None
    beside: tuple[str, ...] = ()
    dcp: DcpMetadata | None = None
    places: ArrayPlaces | None = None
    zarr_metadata: ZarrMetadata = ZarrMetadata.PER_NODE
    file_digests: dict[str, str] = field(default_factory=dict)
    packs: dict[str, int] = field(default_factory=dict)
    layout: dict[str, Any] | None = None

    def with_packs(self, packs: dict[str, int]) -> CommitRecord:
        """This record listing ``packs`` (name: size) of its packed arrays (feature ``packs``)."""
        return replace(self, packs=dict(packs)) if packs else self

    @functools.cached_property
    def requires(self) -> tuple[str, ...]:
        """The features a reader must understand to read this record (``format.features``)."""
        return required_by(self.arrays, self.zarr_metadata)

    @functools.cached_property
    def packed_arrays(self) -> dict[str, str]:
        """The packed arrays' keys, each with its pack (``ArrayRecord.pack``)."""
        return {k: a.pack for k, a in self.arrays.items() if a.pack is not None}

    def with_zarr_metadata(self, where: ZarrMetadata) -> CommitRecord:
        """This record with its nodes' documents kept ``where`` says (``CONSOLIDATED_ONLY``:
        feature ``consolidated_only``)."""
        where = ZarrMetadata(where)
        if where is ZarrMetadata.PER_NODE:
            if self.zarr_metadata is not ZarrMetadata.PER_NODE:
                raise CheckpointingException(
                    f"Internal error: a record whose documents are {self.zarr_metadata.value} cannot keep a document "
                    "per node; please report it"
                )
            return self
        return replace(self, zarr_metadata=where)

    def with_places(self, places: ArrayPlaces | None, where: str) -> CommitRecord:
        """This record with ``places`` (``SaveOptions.array_places``), which must name
        its arrays only: a record naming others would be refused by every reader."""
        if places is None:
            return self
        if unknown := sorted(places.paths.keys() - self.arrays.keys()):
            raise CheckpointingException(
                f"Internal error: the save {where} was given the place of {unknown[0]!r}, which is not one of its "
                "arrays; please report it"
            )
        return replace(self, places=places)

    @functools.cached_property
    def own_top_names(self) -> frozenset[str]:
        """The top-level names its save wrote or may have written (without listing every
        chunk, as ``vouched_paths`` does), the format's reserved names whether written or
        not. Computed once: ``refuses_beside`` asks for every name another program put
        beside, against every array's."""
        paths = (*self.arrays, *self.files, *self.external_files, *self.packs, COMMIT_RECORD, OBJECTS_DIR,
                 *RESERVED_ROOT_NAMES)
        return frozenset(rel.split("/", 1)[0] for rel in paths)

    def refuses_beside(self, name: str) -> str | None:
        """Why ``name`` cannot be one of the entries another program put beside this
        checkpoint (``beside``), or None: a path, a name of the format's or of this
        save's own (files under it would escape ``verify``), or an invalid key."""
        if "/" in name:
            return f"{name!r} is not a top-level name"
        if name in self.own_top_names or name.startswith(".shardstore"):
            return f"{name!r} is one of the checkpoint's own entries"
        try:
            check_key(name)
        except CheckpointingException as exc:
            return str(exc)
        return None

    def is_beside(self, rel: str) -> bool:
        """Whether ``rel`` lies under one of the names another program put beside the
        checkpoint (``beside``)."""
        return rel.split("/", 1)[0] in self.beside

    @functools.cached_property
    def object_shard_files(self) -> dict[str, str]:
        """Every ShardedObject shard the checkpoint holds, by unique key
        (``<key>/shard_<offset>_<shape>``): the relative path of its file. The save's
        own (``objects``) at ``object_path``; and those Megatron-Core's own ``save``
        wrote itself before an in-place save of ours (``tools.megatron_strategy``), at
        ``<unique key>.pt`` (its common strategy's layout), which the record lists among
        ``external_files`` and whose names are shards' unique keys."""
        files = {
            shard_key[: -len(".pt")]: shard_key
            for shard_key in self.external_files
            if is_megatron_object_file(shard_key)
        }
        files.update({k: object_path(k) for o in self.objects.values() for k in o.shard_keys})
        return files

    @functools.cached_property
    def object_keys(self) -> frozenset[str]:
        """The key of every ShardedObject the checkpoint holds a shard of (its own and
        those of ``object_shard_files``)."""
        return frozenset(shard_key.rsplit("/", 1)[0] for shard_key in self.object_shard_files)

    def expected_files(self) -> set[str]:
        """The non-array files a record may vouch for: nothing else, and nothing outside
        the checkpoint."""
        shard_keys = {k for o in self.objects.values() for k in o.shard_keys}
        return {CONFIG_FNAME, COMMON_FILE} | {object_path(k) for k in shard_keys}

    def node_documents(self) -> dict[str, dict[str, Any]]:
        """Every Zarr node's metadata document the record implies in the checkpoint's
        directory, by the relative path of its ``zarr.json`` (the root's excepted): each
        group's, and each array's but the packed ones' (their documents are in their
        packs, ``format.packs``). The consolidated metadata holds the same documents by
        node path, split in two (``consolidated_metadata``)."""
        return {f"{path}/{ZARR_JSON}": group_metadata() if array is None else array.zarr_metadata()
                for path, array in self._nodes()}

    def stored_documents(self) -> dict[str, dict[str, Any]]:
        """The node documents written as files of their own (``node_documents``), by
        relative path: all of them, or none when the record keeps them in the root's
        consolidated metadata only (``ZarrMetadata.CONSOLIDATED_ONLY``)."""
        return self.node_documents() if self.zarr_metadata is ZarrMetadata.PER_NODE else {}

    def consolidated_metadata(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """Zarr's consolidated metadata, every node's document by its path, in two parts:
        the groups and the arrays of core data types, which every zarr-python parses (its
        ``metadata``), and the arrays of extension data types (``EXTENSION_METADATA``
        beside it), which zarr-python without shardstore cannot parse and so must not
        find where it parses everything at once."""
        core: dict[str, dict[str, Any]] = {}
        extension: dict[str, dict[str, Any]] = {}
        for path, array in self._nodes():
            document = group_metadata() if array is None else array.zarr_metadata()
            (core if array is None or array.dtype in CORE_DATA_TYPES else extension)[path] = document
        return core, extension

    def _nodes(self) -> list[tuple[str, ArrayRecord | None]]:
        """Every node but the root by path, each array with its record (a group with
        None), in the order of the paths of their ``zarr.json`` (``node_documents``)."""
        nodes: dict[str, ArrayRecord | None] = dict.fromkeys(parent_groups(list(self.arrays)))
        nodes.update(self.arrays if not self.packs else {k: a for k, a in self.arrays.items() if a.pack is None})
        return sorted(nodes.items(), key=lambda node: f"{node[0]}/{ZARR_JSON}")

    def vouched_paths(self) -> set[str]:
        """Every file a committed checkpoint holds: the record, the files it lists, the
        node documents, every pack and every chunk outside them. Anything else was not
        written by its save."""
        paths = {COMMIT_RECORD, *self.files, *self.external_files, *self.stored_documents(), *self.packs}
        for key, array in self.arrays.items():
            if array.pack is not None:
                continue
            paths.update(f"{key}/{array.chunk_key(index)}" for index in array.chunk_indices())
        return paths

    def unlisted(self, found: list[str], own: Collection[str] = ()) -> list[str]:
        """The paths among ``found`` (every file under the checkpoint) that its save did
        not write, sorted: another program's, or added after the commit. Megatron-Core's
        own save writes ``metadata.json`` after the commit (it only names the backends),
        so that one is expected; so are ``own``, the markers proven to name this
        checkpoint's save (``own_markers``, which reads them). Before format 4 the record
        did not list what the caller of an in-place save wrote: there, only files a
        loader or plain reader would pick up are counted (``_reads_as_part``)."""
        unlisted = set(found) - self.vouched_paths() - {CONFIG_FNAME, *own}
        if self.format_version < FIRST_SEALED_VERSION:
            unlisted = {rel for rel in unlisted if self._reads_as_part(rel)}
        return sorted(unlisted)

    def _reads_as_part(self, rel: str) -> bool:
        """Whether a load or a plain reader would pick ``rel`` up: the common state, an
        object shard of ours, anything inside one of the record's arrays, a node document."""
        return (
            rel == COMMON_FILE
            or rel.startswith(f"{OBJECTS_DIR}/")
            or rel.rsplit("/", 1)[-1] == COMMIT_RECORD
            or any(rel.startswith(f"{key}/") for key in self.arrays)
        )

    def to_root_metadata(self) -> dict[str, Any]:
        """The root group's ``zarr.json``: our record plus Zarr consolidated metadata
        (from version 4, with the digest still unsealed: see ``to_json``)."""
        core, extension = self.consolidated_metadata()
        summaries = {k: a.to_summary() for k, a in sorted(self.arrays.items())}
        return self._root_metadata(summaries, core, extension, {k: d["data_type"] for k, d in extension.items()})

    def _root_metadata(self, summaries: Any, core: Any, extension: Any, extension_types: dict[str, str]) -> dict[str, Any]:
        """The root document of ``to_root_metadata``, given its arrays' summaries, the
        consolidated metadata's two parts and the extension arrays' data types."""
        sealed = {RECORD_DIGEST: UNSEALED_DIGEST} if self.format_version >= FIRST_SEALED_VERSION else {}
        attributes = {
            "shardstore": {
                **sealed,
                "format_version": self.format_version,
                "save_id": self.save_id,
                "library_version": self.library_version,
                "created": self.created,
                "world_size": self.world_size,
                "arrays": summaries,
                "objects": {k: list(o.shard_keys) for k, o in sorted(self.objects.items())},
                "files": dict(sorted(self.files.items())),
                **({"external_files": dict(sorted(self.external_files.items()))} if self.external_files else {}),
                **({FILE_DIGESTS: dict(sorted(self.file_digests.items()))} if self.file_digests else {}),
                **({"reused_from": self.reused_from.to_json()} if self.reused_from else {}),
                **({"beside": sorted(self.beside)} if self.beside else {}),
                **({"dcp": self.dcp.to_json()} if self.dcp else {}),
                **({"places": self.places.to_json()} if self.places is not None else {}),
                **({"zarr_metadata": self.zarr_metadata.value}
                   if self.zarr_metadata is not ZarrMetadata.PER_NODE else {}),
                **({"packs": dict(sorted(self.packs.items()))} if self.packs else {}),
                **({"layout": self.layout} if self.layout is not None else {}),
                **({"requires": list(self.requires)} if self.format_version >= FORMAT_VERSION else {}),
            }
        }
        if extension_types or self.packs or self.zarr_metadata is not ZarrMetadata.PER_NODE:
            packed = {k: a.dtype for k, a in self.arrays.items() if a.pack is not None} if self.packs else None
            attributes[READERS_ATTRIBUTE] = readers_note(extension_types, self.zarr_metadata, packed)
        if self.packs:
            attributes[PACKED_ARRAYS_ATTRIBUTE] = dict(sorted(self.packed_arrays.items()))
        root = group_metadata(attributes)
        root["consolidated_metadata"] = {
            "kind": "inline",
            "must_understand": False,
            "metadata": core,
            **({EXTENSION_METADATA: extension} if extension_types else {}),
        }
        return root

    def to_json(self) -> bytes:
        """The root ``zarr.json`` as written, sealed from version 4: ``to_root_metadata``
        as compact JSON, byte for byte, its arrays' parts from their records' encoded
        parts (``ArrayRecord.encoded_document``, ``encoded_summary``; ``encode_ahead``)."""
        groups = _COMPACT_JSON.encode(group_metadata())
        parts: tuple[list[str], list[str]] = ([], [])  # the consolidated metadata's core, extension
        extension_types: dict[str, str] = {}
        for path, array in self._nodes():
            core = array is None or array.dtype in CORE_DATA_TYPES
            if not core:
                extension_types[path] = array.dtype  # type: ignore[union-attr]
            parts[not core].append(f"{_json_string(path)}:{groups if array is None else array.encoded_document}")
        summaries = [f"{_json_string(k)}:{a.encoded_summary()}" for k, a in sorted(self.arrays.items())]
        marker = f"\x00{uuid.uuid4().hex}"  # stands for each part in the document until spliced in
        root = self._root_metadata(f"{marker}a", f"{marker}c", f"{marker}e", extension_types)
        text = _COMPACT_JSON.encode(root)
        for name, items in (("a", summaries), ("c", parts[0]), ("e", parts[1] if extension_types else None)):
            if items is not None:
                text = _splice(text, _json_string(f"{marker}{name}"), "{" + ",".join(items) + "}")
        data = text.encode()
        return seal_record(data) if self.format_version >= FIRST_SEALED_VERSION else data

    def encode_ahead(self) -> None:
        """Encodes every array's parts that binding its chunks leaves as they are
        (``ArrayRecord.encode_ahead``), kept by the records bound from these: a save
        runs it on the coordinator while its data is made durable, so that its commit
        encodes little more than the chunks' checksums."""
        for array in self.arrays.values():
            array.encode_ahead()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        """The record ``data`` encodes, checked (``where`` names it in errors).

        The record parsed last is kept with its exact bytes, compared in full: a caller
        that opens the same checkpoint once per tensor (the seed's ``_load_from_array``,
        ``verify`` after the CLI's version check) parses it once, where each parse of a
        10,000-array record takes a tenth of a second or more. Bytes that differ in any
        way are parsed anew, so a record replaced since is never answered from memory;
        the records are treated as immutable by every reader. Only a record of at most
        ``_REMEMBERED_RECORD_BYTES`` is kept: a larger one (an unsharded save at
        thousands of ranks: hundreds of MB) would stay in the process's memory after
        its load for good."""
        last = _LAST_PARSED[0]
        if last is not None and last[0] == data:
            return last[1]
        record = cls._parse(data, where)
        _LAST_PARSED[0] = (bytes(data), record) if len(data) <= _REMEMBERED_RECORD_BYTES else None
        return record

    @classmethod
    def _parse(cls, data: bytes, where: str) -> CommitRecord:
        try:
            root = json.loads(data)
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser's depth
            raise CheckpointingException(f"{where}: the commit record is not valid JSON: {exc}") from exc
        attributes = root.get("attributes") if isinstance(root, dict) else None
        record = attributes.get("shardstore") if isinstance(attributes, dict) else None
        if not isinstance(record, dict):
            raise CheckpointingException(_not_a_record(root, where))
        version = record.get("format_version")
        if type(version) is not int:  # true == 1 and 4.0 == 4 in Python: no version
            raise CheckpointingException(
                f"{where}: checkpoint format version {version!r} is not an integer: the commit record is "
                "damaged or was edited; restore it from a copy, or load an earlier checkpoint"
            )
        if version not in READABLE_FORMAT_VERSIONS:
            raise UnsupportedFormatVersion(
                f"{where}: checkpoint format version {version!r} is not supported "
                f"(this shardstore reads versions {list(READABLE_FORMAT_VERSIONS)}); upgrade shardstore"
            )
        if version >= FIRST_SEALED_VERSION and (why := _seal_mismatch(data, record.get(RECORD_DIGEST))):
            raise CheckpointingException(
                f"{where}: the commit record is damaged or was edited ({why}); restore it from a copy, "
                "or load an earlier checkpoint"
            )
        allowed = allowed_by(record.get("requires"), version, where)
        arrays_json = record.get("arrays")
        objects_json = record.get("objects", {})
        if not isinstance(arrays_json, dict) or not isinstance(objects_json, dict):
            raise CheckpointingException(f"{where}: 'arrays' and 'objects' must be JSON objects")
        arrays = {}
        for key, summary in arrays_json.items():
            check_key(key, where=where)
            separator = CHUNK_SEPARATOR if version >= 3 else LEGACY_CHUNK_SEPARATOR
            arrays[key] = ArrayRecord.from_summary(key, summary, where, bound=version >= 2, separator=separator)
        if clashes := array_group_collisions(list(arrays)):
            raise CheckpointingException(f"{where}: the record names clashing keys: {clashes[0]}")
        if version < 2:
            _check_unbound_chunks(arrays, where)
        objects = {}
        for key, shard_keys in objects_json.items():
            check_key(key, where=where)
            if not isinstance(shard_keys, list) or not all(isinstance(s, str) for s in shard_keys):
                raise CheckpointingException(f"{where}: shards of object {key!r} must be a list of strings")
            for shard_key in shard_keys:
                check_key(shard_key, where=where)
            objects[key] = ObjectRecord(key, tuple(shard_keys))
        world_size = record.get("world_size", 1)
        created = _created_of(record)
        save_id = record.get("save_id")
        if version >= 2 and (not isinstance(save_id, str) or not save_id.isalnum() or len(save_id) > 64):
            raise CheckpointingException(f"{where}: malformed save id {save_id!r}")
        result = cls(
            arrays=arrays,
            objects=objects,
            world_size=world_size if isinstance(world_size, int) else 1,
            format_version=version,
            library_version=str(record.get("library_version", "unknown")),
            created=created,
            save_id=save_id if version >= 2 else f"legacy{int(created)}",
        )
        files = record.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise CheckpointingException(f"{where}: 'files' must map paths to checksums")
        unexpected = sorted(set(files) - result.expected_files())
        if unexpected:
            raise CheckpointingException(f"{where}: the record lists unexpected files {unexpected[:5]}")
        external = record.get("external_files", {})
        if not isinstance(external, dict) or not all(isinstance(v, str) for v in external.values()):
            raise CheckpointingException(f"{where}: 'external_files' must map paths to checksums")
        for path in external:
            check_key(path, where=where)
        reused_from = ReusedChunks.from_json(record.get("reused_from"), where)
        dcp = DcpMetadata.from_json(record.get("dcp"), where)
        places = ArrayPlaces.from_json(record.get("places"), arrays, where)
        digests = _file_digests_from_json(record.get(FILE_DIGESTS, {}), {*files, *external}, where)
        packs = packs_from_json(record.get("packs", {}), arrays, where)
        result = replace(result, files=dict(files), external_files=dict(external), reused_from=reused_from, dcp=dcp,
                         places=places, file_digests=digests, packs=packs)
        beside = record.get("beside", [])
        if not isinstance(beside, list) or not all(isinstance(n, str) for n in beside):
            raise CheckpointingException(f"{where}: 'beside' must be a list of top-level names")
        for name in beside:
            if why := result.refuses_beside(name):
                raise CheckpointingException(f"{where}: the record names {name!r} as another program's entry: {why}")
        zarr_metadata = zarr_metadata_from_json(record.get("zarr_metadata"), version, where)
        check_uses(arrays, zarr_metadata, allowed, version, where)
        layout = record.get("layout")
        if layout is not None and not isinstance(layout, dict):
            raise CheckpointingException(f"{where}: 'layout' must be an object")
        return replace(result, beside=tuple(beside), zarr_metadata=zarr_metadata, layout=layout)


_REMEMBERED_RECORD_BYTES = 16 * 2**20  # about 30,000 arrays of one chunk each
_LAST_PARSED: list[tuple[bytes, CommitRecord] | None] = [None]
"""``CommitRecord.from_json``'s one remembered record and its bytes (a one-slot list:
a single item assignment, which needs no lock between threads)."""


def _check_unbound_chunks(arrays: dict[str, ArrayRecord], where: str) -> None:
    """Refuses a version 1 record whose arrays hold more than ``MAX_UNBOUND_CHUNKS``
    chunks in all: it lists no checksum per chunk, so its size bounds none of the work
    per chunk that ``verify`` and a replacing save's listing of what it vouches for do."""
    total = sum(array.chunk_count for array in arrays.values())
    if total > MAX_UNBOUND_CHUNKS:
        raise CheckpointingException(
            f"{where}: a version 1 record naming an absurd number of chunks ({total} in all, more than the "
            f"{MAX_UNBOUND_CHUNKS} a record without chunk checksums may name); the commit record was edited or damaged"
        )


def _not_a_record(node: Any, where: str) -> str:
    """Why the Zarr metadata document ``node`` at ``where`` is no commit record: an
    array's (a checkpoint's array directory was named), or a group's without
    ``attributes.shardstore``."""
    if isinstance(node, dict) and node.get("node_type") == "array":
        return (
            f"{where} is a Zarr array's metadata, not a shardstore checkpoint's commit record: "
            "name the checkpoint directory that holds the array"
        )
    return f"{where} is a Zarr group but not a shardstore checkpoint (no attributes.shardstore)"


def _created_of(record: dict[str, Any]) -> float:
    """The record's ``created`` (informational): 0.0, unknown, where it is no number
    a finite float holds (an integer past a float's range, ``Infinity``, ``NaN``)."""
    created = record.get("created", 0.0)
    if not isinstance(created, (int, float)):
        return 0.0
    try:
        value = float(created)
    except OverflowError:  # an integer past a float's range
        return 0.0
    return value if math.isfinite(value) else 0.0


def _refuse_to_encode(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The commit record's JSON (compact), as ``json.dumps(..., separators=(",", ":"))`` writes
# it. Its C encoder is made once: ``json.dumps`` makes one per call, which took longer than
# encoding an array's document (6.8 against 3.8 us).
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_C_ENCODER = (
    None if c_make_encoder is None
    else c_make_encoder(None, _refuse_to_encode, encode_basestring_ascii, None, ":", ",", False, False, True)
)


# A string as JSON (``json.dumps`` of a str, without its per-call encoder).
_json_string = encode_basestring_ascii


def _encode_compact(value: Any) -> str:
    """``value`` as compact JSON (acyclic, as every record is)."""
    return _COMPACT_JSON.encode(value) if _C_ENCODER is None else "".join(_C_ENCODER(value, 0))


def _splice(text: str, placeholder: str, raw: str) -> str:
    """``text`` with the one occurrence of ``placeholder`` replaced by ``raw``."""
    at = text.find(placeholder)
    if at < 0 or text.find(placeholder, at + 1) >= 0:
        raise CheckpointingException("Internal error: encoding the commit record lost its place; please report it")
    return text[:at] + raw + text[at + len(placeholder) :]



def _sealed_token(digest: str) -> bytes:
    return _COMPACT_JSON.encode({RECORD_DIGEST: digest})[1:-1].encode()


def seal_record(data: bytes) -> bytes:
    """The record ``data`` (its digest ``UNSEALED_DIGEST``, the first in the file) with
    the digest set to the crc32c of ``data``."""
    unsealed = _sealed_token(UNSEALED_DIGEST)
    if data.count(unsealed) != 1:
        raise AssertionError("a record to seal holds its unsealed digest exactly once")
    return data.replace(unsealed, _sealed_token(checksum(data)), 1)


def _seal_mismatch(data: bytes, digest: Any) -> str | None:
    """Why the record ``data`` does not carry its own digest ``digest``, or None."""
    if not isinstance(digest, str) or not digest.startswith("crc32c:") or len(digest) != len(UNSEALED_DIGEST):
        return f"its {RECORD_DIGEST} {digest!r} is missing or malformed"
    sealed = _sealed_token(digest)
    if data.count(sealed) != 1:
        return f"its {RECORD_DIGEST} does not stand once in the file as written"
    actual = checksum(data.replace(sealed, _sealed_token(UNSEALED_DIGEST), 1))
    return None if actual == digest else f"its bytes' digest is {actual}, the record says {digest}"


def checksum(data: bytes) -> str:
    """The checksum the commit record keeps for a non-array file (``files``), and the
    record's own digest."""
    return f"crc32c:{crc32c.crc32c(data):08x}"


def file_digest(data: bytes | memoryview) -> str:
    """The content digest the commit record keeps for a non-array file
    (``FILE_DIGESTS``), and for each chunk (``format.chunks.chunk_digest``): XXH3-128
    as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def _file_digests_from_json(raw: Any, listed: set[str], where: str) -> dict[str, str]:
    """A record's ``FILE_DIGESTS``: 32 hex digits for files it lists in ``files`` or
    ``external_files`` (``listed``)."""
    if not isinstance(raw, dict) or not all(
        isinstance(v, str) and len(v) == DIGEST_HEX_DIGITS and set(v) <= HEX_DIGITS for v in raw.values()
    ):
        raise CheckpointingException(f"{where}: '{FILE_DIGESTS}' must map paths to {DIGEST_HEX_DIGITS} hex digits")
    if unlisted := sorted(set(raw) - listed):
        raise CheckpointingException(f"{where}: '{FILE_DIGESTS}' names files the record does not list {unlisted[:5]}")
    return dict(raw)


# A ShardedObject shard's file as Megatron-Core's common strategy writes it: ``<unique key>.pt``.
_MEGATRON_OBJECT_FILE = re.compile(rf"(?!{OBJECTS_DIR}/)[^/].*/shard_[0-9.]*_[0-9.]*\.pt")


def is_megatron_object_file(rel: str) -> bool:
    """Whether ``rel`` is named as Megatron-Core's common strategy names a ShardedObject
    shard's file (``<unique key>.pt``) outside ``OBJECTS_DIR``."""
    return _MEGATRON_OBJECT_FILE.fullmatch(rel) is not None


def object_path(shard_key: str) -> str:
    """Relative path of a ShardedObject shard's file."""
    return f"{OBJECTS_DIR}/{shard_key}.pt"


def read_marker(location: Location, name: str) -> dict[str, Any] | None:
    """The marker ``name`` (``SAVE_MARKER`` or ``DELETION_MARKER``) at the top of
    ``location`` as a JSON object; None where there is none, or a file of that name that
    is no JSON object (no marker of ours).

    Raises:
        StorageError: it cannot be read, or holds more than a marker of that name
            holds (``MAX_MARKER_BYTES``; ``MAX_DELETION_MARKER_BYTES``)."""
    bound = MAX_DELETION_MARKER_BYTES if name in (DELETION_MARKER, REMOVAL_MARKER) else MAX_MARKER_BYTES
    data = location.read_bytes_or_none(name, max_bytes=bound)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: not ours
        return None
    return value if isinstance(value, dict) else None


def marker_save_id(location: Location, name: str = SAVE_MARKER, field_name: str = "save_id") -> str | None:
    """The save id the marker ``name`` (``SAVE_MARKER`` or ``DELETION_MARKER``) at the
    top of ``location`` holds in ``field_name``: ``save_id``, the save that wrote it, or
    (a save marker of an in-place save that replaces a checkpoint) ``replaces``, the save
    id of that checkpoint. None where there is none, or a file of that name that is no
    marker of ours (not a JSON object with a string there).

    Raises:
        StorageError: as ``read_marker``."""
    marker = read_marker(location, name)
    save_id = marker.get(field_name) if marker is not None else None
    return save_id if isinstance(save_id, str) else None


def own_markers(location: Location, record: CommitRecord, found: Collection[str]) -> frozenset[str]:
    """The markers among ``found`` (listed at ``location``, a committed checkpoint) that
    name its own save, ``record.save_id``: proven by what each holds, never by its name.
    Its save's marker, left by a crash between the publishing and the marker's removal;
    the marker of an in-place save that replaces it (``replaces``), written before the
    old record goes and left by a crash before it went; the manager's deletion marker,
    left where a deletion stopped before the record went; ``remove_sharded_tensors``'s marker
    (``format.removal``), left where a removal was killed, and the files among ``found``
    that this removal still had to delete (its save wrote them; its marker names them). A marker naming another save
    is not among them (``CommitRecord.unlisted`` counts it). Also the temporary files of
    an atomic write of the record or of a marker (``stores.base.atomic_temp_name``: a
    128-bit random name only ``put_atomic`` makes), left at the top by a process killed
    before their rename (the manager's deletion marker, ``remove_sharded_tensors``'s
    record): their content may be cut short, so their name is what proves them.

    Raises:
        StorageError: a marker cannot be read."""
    if not record.save_id:
        return frozenset()
    own = {entry for entry in found if atomic_temp_of(entry) in (COMMIT_RECORD, SAVE_MARKER, DELETION_MARKER, REMOVAL_MARKER)}
    if SAVE_MARKER in found and record.save_id in (
        marker_save_id(location, SAVE_MARKER), marker_save_id(location, SAVE_MARKER, "replaces")
    ):
        own.add(SAVE_MARKER)
    own.update(m for m in (DELETION_MARKER, REMOVAL_MARKER) if m in found and marker_save_id(location, m) == record.save_id)
    own.update(left[1] if (left := leftover_files(location, record, found)) else ())
    return frozenset(own)


def interrupted_replacement(location: Location) -> tuple[str, str, str] | None:
    """The replacement in a shared directory (``format.commit.ByRename._replace_beside``)
    whose save marker lies at ``location``: that save's id, the id of the checkpoint it
    replaces and its phase (``SETTING_ASIDE`` or ``MOVING_IN``), or None where the marker
    is none of these (or there is none). Where ``location`` holds no commit record, that
    save was interrupted between setting the old checkpoint's record aside and
    publishing its own.

    Raises:
        StorageError: the marker cannot be read."""
    marker = read_marker(location, SAVE_MARKER)
    if marker is None or marker.get(REPLACING_PHASE) not in (SETTING_ASIDE, MOVING_IN):
        return None
    save_id, replaces = marker.get("save_id"), marker.get("replaces")
    if not all(isinstance(i, str) and re.fullmatch(r"[0-9a-f]{32}", i) for i in (save_id, replaces)):
        return None  # the ids name directories next to it: nothing else is ours
    return save_id, replaces, marker[REPLACING_PHASE]


def _replaced_name(location: Location, save_id: str) -> str:
    """The name of the directory next to ``location`` where a replacement sets aside the
    checkpoint ``save_id`` committed (``REPLACED_TAG``)."""
    local = location.local_path()
    name = local.name if local is not None else location.describe().rstrip("/").rsplit("/", 1)[-1]
    return f".{name}{REPLACED_TAG}{save_id}"


def is_committed(location: Location) -> bool:
    return location.exists(COMMIT_RECORD)


def read_commit_record(location: Location) -> CommitRecord:
    """The checkpoint's commit record; without one, an error that says what is there
    instead: nothing, an unfinished save, another tool's checkpoint, or no checkpoint at
    all (a file, a Hugging Face model, any other directory), which no save finishes."""
    local = location.local_path()
    if local is not None and local.exists() and not local.is_dir():
        files = _title_of_model_files(location)
        raise CheckpointingException(
            f"{location.describe()} is a file, not a checkpoint directory (one holding {COMMIT_RECORD})"
            + (f"; to make a checkpoint of {files}: `shardstore convert {location.describe()} <new directory>`"
               if files else "")
        )
    try:
        data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
    except OSError as exc:
        raise CheckpointingException(f"Cannot read the commit record of {location.describe()}: {exc}") from exc
    if data is None:
        if location.is_empty():
            unfinished = unfinished_saves(location)
            if unfinished:
                raise CheckpointingException(
                    f"No committed checkpoint at {location.describe()}: a save into it is incomplete "
                    f"(unfinished: {unfinished[:3]}); load an earlier checkpoint or save again"
                )
            if local is not None and not local.exists():  # Megatron-Core's words, which its users match
                raise CheckpointingException(f"Checkpoint directory {location.describe()} does not exist")
            missing = location.store.missing_container() if local is None else None
            if missing is not None:
                raise CheckpointingException(
                    f"{location.describe()} is not a distributed checkpoint: its {missing} does not exist; check "
                    "the URL, and the endpoint and region it is looked up at"
                )
            raise CheckpointingException(  # "is not a distributed checkpoint": Megatron-Core's words too
                f"{location.describe()} is not a distributed checkpoint: the checkpoint directory is empty"
                + ("" if local is not None else " (no object under this prefix)")
                + "; save into it first, or name the directory of a committed checkpoint"
            )
        other = other_checkpoint_kind(location)
        if other:
            title, readable = other
            how = (
                "`load` and the metadata queries read it as it is; to verify it or keep it in shardstore's "
                f"format, convert it: `shardstore convert {location.describe()} <new directory>`"
                if readable
                else "load it with the tool that wrote it (megatron.core.dist_checkpointing)"
            )
            raise CheckpointingException(
                f"{location.describe()} is not a shardstore checkpoint: it is {title}. {how}"
            )
        replacing = interrupted_replacement(location)
        if replacing is not None:
            raise CheckpointingException(
                f"No committed checkpoint at {location.describe()}: save {replacing[0]}, which replaced the "
                f"checkpoint there (save {replacing[1]}) beside other programs' files, was interrupted while it "
                f"moved the checkpoints' entries (other programs' files there were not touched); the old "
                f"checkpoint's record and the entries it had moved are in the hidden directory "
                f"{_replaced_name(location, replacing[1])} next to it. The next save into this directory puts the "
                f"old checkpoint back first; to put it back without saving: `shardstore restore {location.describe()}`"
            )
        names = location.list_top(None)
        if not _holds_save_files(location, names):
            raise CheckpointingException(_not_a_checkpoint(location.describe(), names, _title_of_model_files(location)))
        if DELETION_MARKER in names:
            raise CheckpointingException(
                f"{location.describe()} is no longer a checkpoint: a deletion of it by shardstore's CheckpointManager "
                f"was interrupted after its commit record went ({DELETION_MARKER} proves it). The manager's next "
                "retention, rollback or save of this step finishes it, or now: CheckpointManager(<root>).delete(step)"
            )
        raise CheckpointingException(
            f"Checkpoint at {location.describe()} is incomplete: it has no commit record "
            f"({COMMIT_RECORD}), so its save did not finish. Load an earlier checkpoint, "
            "or save again into this directory."
        )
    return CommitRecord.from_json(data, where=location.describe(COMMIT_RECORD))


def _holds_save_files(location: Location, names: list[str]) -> bool:
    """Whether a directory without a commit record holds what a shardstore save writes
    into it before that record (an in-place save: S3, Megatron's plug-in) or what the
    manager leaves while deleting one; one holding none of it is no checkpoint at all."""
    ours = {SAVE_MARKER, DELETION_MARKER, COMMON_FILE, OBJECTS_DIR}
    return bool(ours.intersection(names)) or sharded_backend(location) == "shardstore"


def _not_a_checkpoint(where: str, names: list[str], model_files: str | None) -> str:
    """What a directory that is no checkpoint holds, and what to do with it;
    ``model_files``: the title of the registered format of model files it holds, if any."""
    weights = [n for n in names if n.endswith(".safetensors")]
    if weights or "config.json" in names:
        kind = "a Hugging Face model directory" if "config.json" in names else "a directory of safetensors files"
        listed = ", ".join([n for n in ("config.json",) if n in names] + weights[:2])
        how = f"; `shardstore convert {where} <new directory>` imports its weights" if model_files else ""
        return f"{where} is {kind} ({listed}), not a shardstore checkpoint{how}"
    found = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (
        f"{where} is not a shardstore checkpoint: it holds no commit record ({COMMIT_RECORD}) nor any file a "
        f"save writes ({found}); name a checkpoint directory, one holding {COMMIT_RECORD}"
    )


def sharded_backend(location: Location) -> str | None:
    """The backend ``metadata.json`` names, or None (no such file, or not a config): a
    lenient look, for telling what a directory holds, never an error."""
    try:
        config = json.loads(location.read_bytes_or_none(CONFIG_FNAME, max_bytes=2**20) or b"null")
    except (ValueError, RecursionError, OSError):  # RecursionError: nested past the parser's depth
        return None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    return backend if isinstance(backend, str) else None


@dataclass(frozen=True)
class OtherCheckpointFiles:
    """Another tool's checkpoint found in a directory, among whatever else is there.

    Attributes:
        title: what messages call it (``"a PyTorch DCP checkpoint"``).
        names: its top-level entries there, sorted (DCP's ``.metadata`` and ``*.distcp``).
    """

    title: str
    names: tuple[str, ...]

    def listed(self, limit: int = 8) -> str:
        """Its entries for a message: the first ``limit``, then how many more."""
        shown = ", ".join(self.names[:limit])
        return shown + (f" and {len(self.names) - limit} more" if len(self.names) > limit else "")


def _no_registry(location: Location) -> None:
    return None


# How this layer names another tool's checkpoint: the registry of other formats
# (``shardstore.other_formats.registry``) lies a layer above, so it hands its lookups down
# when it is imported, which ``shardstore.strategies`` (every load and save) and the command do.
_title_of_other_format: Callable[[Location], str | None] = _no_registry
_files_of_other_format: Callable[[Location], OtherCheckpointFiles | None] = _no_registry
_title_of_model_files: Callable[[Location], str | None] = _no_registry


def name_other_formats_with(
    title_of: Callable[[Location], str | None], files_of: Callable[[Location], OtherCheckpointFiles | None],
    title_of_files: Callable[[Location], str | None] = _no_registry,
) -> None:
    """Installs the registry's lookups: ``title_of(location)`` is the title of the
    registered format whose checkpoint ``location`` holds, or None; ``files_of(location)``
    the checkpoint of a registered format whose files lie there among others
    (``other_checkpoint_files``), or None; ``title_of_files(location)`` the title of the
    registered format of model files (``torch.save``, safetensors) at ``location``, which
    ``shardstore convert`` imports, or None."""
    global _title_of_other_format, _files_of_other_format, _title_of_model_files
    _title_of_other_format, _files_of_other_format, _title_of_model_files = title_of, files_of, title_of_files


def other_checkpoint_files(location: Location) -> OtherCheckpointFiles | None:
    """Another tool's checkpoint (a registered format's, ``shardstore.other_formats``)
    whose files lie at ``location``, whatever else is there: other programs' files, or a
    shardstore checkpoint the tool saved over (DCP's ``FileSystemWriter`` into the same
    directory). None where there is none. What a save refuses to delete and a load
    refuses to choose between (``other_checkpoint_beside``)."""
    return _files_of_other_format(location)


def other_checkpoint_beside(location: Location, record: CommitRecord) -> OtherCheckpointFiles | None:
    """Another tool's checkpoint whose files lie in the directory of the shardstore
    checkpoint ``record`` commits at ``location``, without the entries that are the
    record's own; None where there is none. Such a directory holds two checkpoints, and
    which one its path means is ambiguous."""
    found = other_checkpoint_files(location)
    if found is None:
        return None
    theirs = tuple(name for name in found.names if name not in record.own_top_names)
    return replace(found, names=theirs) if theirs else None


def other_checkpoint_kind(location: Location) -> tuple[str, bool] | None:
    """What another tool's checkpoint at ``location`` is, and whether shardstore reads
    it; None if it looks like none (also a directory with a commit record).

    A format in the registry is read (``shardstore.other_formats``); besides those,
    Megatron-Core names any other backend it wrote in ``metadata.json`` (``torch``, a
    ``torch_dist`` save without DCP's ``.metadata``), which only Megatron-Core reads.
    """
    title = _title_of_other_format(location)
    if title:
        return title, True
    backend = sharded_backend(location)
    # shardstore's own first checkpoints also named the backend "zarr", but they are a
    # Zarr v3 group (a root zarr.json); Megatron's are detected by the registry
    if backend is not None and backend not in ("zarr", "shardstore"):
        return f"a Megatron-Core {backend!r} checkpoint", False
    return None


def unfinished_saves(location: Location) -> list[str]:
    """Staging directories of saves into ``location`` that have not published (stores
    that publish by rename; running or dead)."""
    directory = location.store.publishing()
    if directory is None:
        return []
    try:
        return directory.siblings(f".{directory.name}{STAGING_TAG}")
    except OSError:  # an unreadable parent: only the error message loses this detail
        return []


def write_commit_record(location: Location, record: CommitRecord) -> None:
    """Writes the root ``zarr.json`` atomically: from now on the checkpoint exists."""
    location.write_atomic(COMMIT_RECORD, record.to_json())
