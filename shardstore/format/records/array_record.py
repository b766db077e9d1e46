"""One global array's record (``ArrayRecord``): what its ``zarr.json`` says, in
shardstore's terms, its summary in the commit record with its chunks' checksums, and
that summary parsed back and checked (``ArrayRecord.from_summary``).

A summary read back is checked against the bounds below (a hostile-input guard: its
shapes are refused before anything is allocated for them, a chunk by its size before
it is read whole): a malformed one gives a ``CheckpointingException`` that names the
checkpoint and the array.
"""

from __future__ import annotations

__all__ = [
    "ArrayRecord",
    "CHUNK_ETAGS",
    "MAX_CHUNK_BYTES",
    "MAX_ELEMENTS",
    "MAX_NDIM",
    "MAX_UNBOUND_CHUNKS",
    "zero_fill_value",
]

import functools
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.codecs import BYTES_CRC32C, ChunkCodec, codec_for
from shardstore.format.dtypes import from_zarr_name
from shardstore.format.features import PACK_NAME
from shardstore.format.records.encoding import (
    CHUNK_DIGESTS,
    DIGEST_HEX_DIGITS,
    HEX_DIGITS,
    encode_compact,
)
from shardstore.format.records.names import CHUNK_SEPARATOR, chunk_key
from shardstore.format.sharding import MAX_FLAT_INNER_CHUNKS, ShardingIndexed, spans_blocks

# Upper bounds that a record read back must respect (hostile-input guard).
MAX_NDIM = 32
MAX_ELEMENTS = 2**62
MAX_CHUNK_BYTES = 2**34  # one chunk is read into memory whole; 16 GiB is far above any we write
# Chunks of all arrays of a format-1 record, which lists no checksums to pay for them.
MAX_UNBOUND_CHUNKS = 2**24

# Each chunk object's ETag as its object store reported it when the object was written
# (null for a chunk it gave none); only in records of saves to object stores.
CHUNK_ETAGS = "chunk_etags"
MAX_ETAG_CHARS = 128


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
        return encode_compact(self.zarr_metadata())

    @functools.cached_property
    def _encoded_summary_head(self) -> str:
        return encode_compact(self._summary_head())

    def encoded_summary(self) -> str:
        """``to_summary()`` as the commit record writes it (compact JSON), its head
        encoded once per record (as ``encoded_document``)."""
        checksums = self._summary_checksums()
        if not checksums:
            return self._encoded_summary_head
        return f"{self._encoded_summary_head[:-1]},{encode_compact(checksums)[1:]}"

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
