"""Zarr v3 ``sharding_indexed``: one stored object (a shard) holds many inner chunks.

Layout (the spec's, as zarr-python and TensorStore read it): the stored inner chunks
one after another, each its raw little-endian bytes then their crc32c (``[bytes,
crc32c]``); then a crc table, every inner chunk's crc32c as little-endian uint32 (0 for
an empty one), which the index does not point at and Zarr readers skip; then the index:
one ``(offset, nbytes)`` pair of uint64 little-endian per inner chunk in C order over
the inner grid (``2**64-1`` twice: empty, never written, refused by reads), then the
index's crc32c (``index_codecs`` ``[bytes, crc32c]``, ``index_location`` ``end``).

- ``encode_shard``: the pieces of a shard (views of the inner chunks' memory, their
  trailers, the table, the index: one ``writev``, no copy of tensor bytes) and its
  ``crc``: the crc32c of the non-empty inner chunks' crc32c then the index's, which the
  commit record keeps per shard (``chunk_crcs``; the digest it keeps is the XXH3-128 of
  the shard's decoded bytes, as for any chunk).
- ``read_inner``: reads the table and the index (one suffix request), then only the
  inner chunks asked for (one range per run of adjacent ones) from a ``ByteRanges``
  (``ChunkRanges``: a ``ChunkStore``'s ranged reads; ``WholeObject``: one read of it
  all); checks the index's crc32c, its entries and every inner chunk read against its
  trailer and the table; returns the shard's ``crc`` from the table and the index,
  which the caller compares with the record's, so the inner chunks it did not read are
  bound too. Errors name the shard and the inner chunk. A reader of every inner chunk
  reads the shard in one pass, as a chunk is read (``_read_whole``).
- ``ShardingIndexed``: the same as a ``format.codecs.ChunkCodec`` (registered here), for
  any inner grid that tiles the shard (``check_chunk_shape``). A shard's decoded bytes
  (what ``encode`` takes, ``read_into`` gives, and the record's digest is taken of) are
  *inner-chunk-major*: every inner chunk's C-order bytes, in C order over the inner
  grid, those past the array's edge zero-padded; when the inner chunks split one axis
  and the shard is one element along every axis before it (``c_ordered``: FSDP2's
  first-axis shards) that is the shard's C order. ``decoded`` pads the packed inner
  chunks a gathered writer holds (``InnerGrid``: each inner chunk's part inside the
  array, back to back); ``pack`` orders a whole shard's values so (one copy, for a
  shard inside a block); ``read_boxes_into`` fills boxes of the shard into arrays,
  reading only the inner chunks they cover (or the shard whole if that costs little).

The planner (``planning.plans.sharded_record``) shards arrays of small chunk-aligned
blocks split along any axes when asked (``ZarrSaveShardedStrategy(shard_bytes=...)``),
each shard gathered to one writer, or, for large blocks split along a later axis
(Megatron's row-parallel weights), in shards inside each block that its holder writes,
with inner chunks that split the columns too (``in_block_sharded_record``); such a
record requires feature ``sharding_indexed`` (since version 5). Flattened arrays (the
distributed optimizer's fragments) are sharded too; a shard larger than their flattened
block requires feature ``flat_shards`` (since version 7) and holds at most
``MAX_FLAT_INNER_CHUNKS`` inner chunks (``format.records``). Both features' names and
tests live here (``format.features`` lists them).
"""

from __future__ import annotations

__all__ = [
    "EMPTY",
    "FLAT_SHARDS_FEATURE",
    "FLAT_SHARDS_SINCE",
    "INDEX_ENTRY_BYTES",
    "MAX_FLAT_INNER_CHUNKS",
    "ByteRanges",
    "ChunkRanges",
    "EncodedShard",
    "HeldShard",
    "InnerGrid",
    "InnerRecord",
    "ShardIndex",
    "SHARDING_FEATURE",
    "SHARDING_SINCE",
    "ShardingIndexed",
    "WholeObject",
    "encode_shard",
    "read_inner",
    "shards_span_blocks",
    "spans_blocks",
    "stored_in_shards",
]

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import crc32c
import numpy as np
import xxhash

from shardstore.errors import CheckpointingException
from shardstore.format.codecs import (
    BYTES_CRC32C,
    CRC_BYTES,
    BoxRead,
    BytesCrc32c,
    ChunkCodec,
    ChunkSource,
    EncodedChunk,
    StreamedChunk,
    register,
)
from shardstore.stores.base import ChunkMismatch, Fold, StorageError

EMPTY = 2**64 - 1
INDEX_ENTRY_BYTES = 16
# The most inner chunks of a shard of a flattened array that spans several of its
# flattened blocks: an index and crc table of at most 80 KiB (0.12% of a 64 MiB shard),
# read whole by every partial read; and a record read back may make
# ``strategies.resharding`` ask for at most this many blocks per shard it lists.
MAX_FLAT_INNER_CHUNKS = 4096
_INDEX_DTYPE = np.dtype("<u8")


@dataclass(frozen=True)
class InnerRecord:
    """What shardstore keeps of one stored inner chunk: ``crc`` (crc32c of its raw bytes,
    its stored trailer) and ``digest`` (XXH3-128 of its raw bytes, 32 hex digits)."""

    crc: int
    digest: str


@dataclass(frozen=True)
class ShardIndex:
    """A shard's index: ``(offset, nbytes)`` of each inner chunk's stored bytes (raw
    bytes and trailer), None for an empty one, in C order over the inner grid."""

    entries: tuple[tuple[int, int] | None, ...]

    @staticmethod
    def nbytes(count: int) -> int:
        """Stored bytes of the index of ``count`` inner chunks, its crc32c included."""
        return count * INDEX_ENTRY_BYTES + CRC_BYTES

    @staticmethod
    def suffix_nbytes(count: int) -> int:
        """Stored bytes after the inner chunks: the crc table (``encode_shard``) and
        the index."""
        return count * CRC_BYTES + ShardIndex.nbytes(count)

    def encode(self) -> bytes:
        """The index as stored: the uint64 pairs then their crc32c."""
        pairs = np.array([e if e is not None else (EMPTY, EMPTY) for e in self.entries], dtype=_INDEX_DTYPE)
        raw = pairs.tobytes()
        return raw + crc32c.crc32c(raw).to_bytes(CRC_BYTES, "little")

    @classmethod
    def decode(cls, stored: bytes, count: int, data_end: int | None, where: str) -> ShardIndex:
        """Parses and checks a stored index of ``count`` entries, whose inner chunks lie
        before ``data_end`` (None: unknown).

        Raises:
            CheckpointingException: naming ``where``: wrong length, crc32c mismatch, an
                entry half empty or reaching past the inner chunks' bytes."""
        if len(stored) != cls.nbytes(count):
            raise CheckpointingException(
                f"Corrupt {where}: shard index of {len(stored)} bytes, expected {cls.nbytes(count)} (truncated shard)"
            )
        raw, trailer = stored[:-CRC_BYTES], stored[-CRC_BYTES:]
        if crc32c.crc32c(raw) != int.from_bytes(trailer, "little"):
            raise CheckpointingException(f"Corrupt {where}: shard index crc32c mismatch")
        entries: list[tuple[int, int] | None] = []
        for i, (offset, size) in enumerate(np.frombuffer(raw, dtype=_INDEX_DTYPE).reshape(count, 2).tolist()):
            if offset == EMPTY and size == EMPTY:
                entries.append(None)
            elif EMPTY in (offset, size) or (data_end is not None and offset + size > data_end):
                raise CheckpointingException(
                    f"Corrupt {where}: shard index entry of inner chunk {i} is ({offset}, {size}), "
                    f"outside the shard's {data_end} bytes of inner chunks"
                )
            else:
                entries.append((offset, size))
        return cls(tuple(entries))


@dataclass(frozen=True)
class EncodedShard:
    """A shard as stored, and what the commit record keeps of it.

    Attributes:
        pieces: the object's bytes in order (inner chunks' views, trailers, the index).
        inner: per inner chunk its ``InnerRecord``, None where empty.
        index_crc: crc32c of the index (its stored trailer).
        crc: crc32c of every stored trailer, the inner chunks' in order then the index's.
    """

    pieces: tuple[memoryview, ...]
    inner: tuple[InnerRecord | None, ...]
    index_crc: int
    crc: int

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces)


def encode_shard(inner: Sequence[memoryview | None]) -> EncodedShard:
    """The shard holding ``inner`` (raw little-endian bytes of each inner chunk in C
    order over the inner grid, None for an empty one), without copying them: the inner
    chunks (each its bytes and their crc32c), then a crc table (every inner chunk's
    crc32c, little-endian uint32, 0 for an empty one; bytes the index does not point
    at, which Zarr readers skip), then the index. A reader of part of the shard reads
    the table and the index in one request and checks them against the record's
    ``crc`` before it reads the inner chunks it needs."""
    pieces: list[memoryview] = []
    records: list[InnerRecord | None] = []
    for data in inner:
        if data is None:
            records.append(None)
            continue
        crc = crc32c.crc32c(data)
        records.append(InnerRecord(crc, xxhash.xxh3_128_hexdigest(data)))
        pieces += [data, _trailer(crc)]
    crcs = [None if r is None else r.crc for r in records]
    suffix, index_crc, crc = _suffix([None if d is None else len(d) for d in inner], crcs)
    return EncodedShard((*pieces, *suffix), tuple(records), index_crc, crc)


def _suffix(sizes: Sequence[int | None], crcs: Sequence[int | None]) -> tuple[list[memoryview], int, int]:
    """What follows the inner chunks of ``sizes`` bytes with ``crcs`` (None: empty, not
    stored): the crc table and the index (``encode_shard``); with the index's crc32c
    and the shard's ``crc``."""
    index = ShardIndex(_entries(sizes)).encode()
    index_crc = int.from_bytes(index[-CRC_BYTES:], "little")
    table = np.array([0 if crc is None else crc for crc in crcs], dtype="<u4").tobytes()
    return [memoryview(table), memoryview(index)], index_crc, _shard_crc(crcs, index_crc)


def _entries(sizes: Sequence[int | None]) -> tuple[tuple[int, int] | None, ...]:
    """The index entries ``encode_shard`` writes for inner chunks of ``sizes`` raw bytes
    (None: empty, not stored): each stored one after another with its crc32c."""
    entries: list[tuple[int, int] | None] = []
    offset = 0
    for size in sizes:
        entries.append(None if size is None else (offset, size + CRC_BYTES))
        offset += 0 if size is None else size + CRC_BYTES
    return tuple(entries)


def _trailer(crc: int) -> memoryview:
    return memoryview(crc.to_bytes(CRC_BYTES, "little"))


def _shard_crc(inner: Iterable[int | None], index_crc: int) -> int:
    """``EncodedShard.crc`` from the inner chunks' crc32c (None: empty) and the index's."""
    trailers = b"".join(crc.to_bytes(CRC_BYTES, "little") for crc in inner if crc is not None)
    return crc32c.crc32c(trailers + index_crc.to_bytes(CRC_BYTES, "little"))


class ByteRanges(Protocol):
    """A stored shard read by byte ranges (a file's ``preadv``, an HTTP ``Range``)."""

    def describe(self) -> str:
        """The shard, its array and its path, for error messages."""

    def read_suffix(self, n: int) -> tuple[bytes, int] | None:
        """The object's last ``n`` bytes (fewer if it is shorter) and its length, or
        None when it does not exist."""

    def read_range_into(self, offset: int, views: list[memoryview], fold: Fold) -> int:
        """Fills ``views`` in order from ``offset``, handing ``fold`` the bytes that
        landed, in order (``ChunkStore.get_range_into_folded``); returns their count."""


def read_inner(
    source: ByteRanges, count: int, wanted: Mapping[int, memoryview], empty: frozenset[int] = frozenset(),
) -> int:
    """Fills ``wanted[i]`` (raw bytes of inner chunk ``i`` of ``count``) from the shard,
    reading its crc table and index (one request) and only those inner chunks. An inner
    chunk the index marks empty is refused unless ``empty`` names it (then zeros).
    Every inner chunk read must match its trailer and the table. Returns the shard's
    crc32c (``EncodedShard.crc``), which binds every inner chunk: the caller compares it
    with the record's.

    Raises:
        CheckpointingException: naming ``source.describe()`` and the inner chunk: the
            shard is missing, or its table, index or an inner chunk is truncated,
            corrupt or marked empty."""
    where = source.describe()
    suffix = ShardIndex.suffix_nbytes(count)
    found = source.read_suffix(suffix)
    if found is None:
        raise CheckpointingException(f"Missing {where}: the checkpoint is damaged")
    stored, size = found
    if len(stored) != suffix:
        raise CheckpointingException(f"Corrupt {where}: {size} bytes, too short for {count} inner chunks' index")
    table, index, index_crc = _parsed_suffix(stored, size, count, where, empty)
    crcs: dict[int, int | None] = {}
    for run in _runs(index, sorted(wanted)):
        trailers = [bytearray(CRC_BYTES) for _ in run]
        views = [v for i, t in zip(run, trailers) for v in (wanted[i], memoryview(t))]
        for i in run:
            _check_size(index, i, len(wanted[i]), where)
        start = index.entries[run[0]][0]  # type: ignore[index]
        folded = _RunCrcs([len(wanted[i]) for i in run])
        if source.read_range_into(start, views, folded) != sum(len(v) for v in views):
            raise CheckpointingException(f"Corrupt {where}: inner chunk {run[0]} truncated")
        crcs |= _checked_run(run, trailers, folded.crcs, table, where)
    for i in wanted.keys() - crcs.keys():
        wanted[i][:] = bytes(len(wanted[i]))
    return _shard_crc((None if entry is None else table[i] for i, entry in enumerate(index.entries)), index_crc)


def _read_whole(chunk: ChunkSource, inner: list[memoryview]) -> int | None:
    """Fills ``inner`` (every inner chunk's raw bytes, in order) from a shard laid out
    as ``encode_shard`` lays it out, in one pass as a chunk is read (one request, each
    inner chunk's crc32c taken as its bytes land), the index read last and checked as
    ``read_inner`` checks it; returns the shard's crc32c. None where the object is
    another size or its index another layout (another writer's shard): the caller then
    reads it with ``read_inner``. A store that cannot tell a longer object
    (``ChunkStore.tells_longer``: S3) reads one as its first bytes, refused by the index check.

    Raises:
        CheckpointingException: as ``read_inner``, naming ``chunk.describe()``."""
    where, count = chunk.describe(), len(inner)
    trailers = [bytearray(CRC_BYTES) for _ in inner]
    suffix = bytearray(ShardIndex.suffix_nbytes(count))
    views = [v for data, t in zip(inner, trailers) for v in (data, memoryview(t))] + [memoryview(suffix)]
    folded = _RunCrcs([len(data) for data in inner])
    got = chunk.store.get_into_folded(chunk.rel, views, 1, folded)
    if got is None:
        raise CheckpointingException(f"Missing {where}: the checkpoint is damaged")
    size = sum(len(v) for v in views)
    if got[0] + len(got[1]) != size:
        return None
    table, index, index_crc = _parsed_suffix(bytes(suffix), size, count, where, frozenset())
    if index.entries != _entries([len(data) for data in inner]):
        return None
    _checked_run(range(count), trailers, folded.crcs, table, where)
    return _shard_crc(table, index_crc)


def _parsed_suffix(stored: bytes, size: int, count: int, where: str, empty: frozenset[int]
                   ) -> tuple[list[int], ShardIndex, int]:
    """A shard's crc table, index and the index's crc32c from its last bytes
    (``stored``, of a shard of ``size`` bytes), checked; inner chunks marked empty are
    refused unless ``empty`` names them."""
    table = np.frombuffer(stored[: count * CRC_BYTES], dtype="<u4").tolist()
    index = ShardIndex.decode(stored[count * CRC_BYTES :], count, size - len(stored), where)
    for i, entry in enumerate(index.entries):
        if entry is None and i not in empty:
            raise CheckpointingException(
                f"Corrupt {where}: inner chunk {i} is marked empty in the shard's index (offset and length "
                "2**64-1), which shardstore never writes and its commit record does not name: its values are "
                "lost, the shard was changed after the save. Load an earlier checkpoint or restore this one"
            )
    return table, index, int.from_bytes(stored[-CRC_BYTES:], "little")


def _checked_run(run: Iterable[int], trailers: list[bytearray], crcs: list[int], table: list[int], where: str
                 ) -> dict[int, int | None]:
    """The crc32c of each inner chunk of ``run`` as read (``crcs``), checked against its
    ``trailers`` and the crc ``table``."""
    checked: dict[int, int | None] = {}
    for i, trailer, crc in zip(run, trailers, crcs):
        if crc != int.from_bytes(trailer, "little"):
            raise CheckpointingException(f"Corrupt {where}: inner chunk {i} crc32c mismatch")
        if crc != table[i]:
            raise CheckpointingException(f"Corrupt {where}: inner chunk {i} is not the one its crc table names")
        checked[i] = crc
    return checked


def _runs(index: ShardIndex, wanted: list[int]) -> list[list[int]]:
    """The stored wanted inner chunks grouped into runs of adjacent byte ranges."""
    runs: list[list[int]] = []
    end = -1
    for i in wanted:
        entry = index.entries[i]
        if entry is None:
            continue
        if runs and entry[0] == end:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = entry[0] + entry[1]
    return runs


class _RunCrcs:
    """The crc32c of each inner chunk of a run read at once (``read_inner``), taken as
    its bytes land (the read's ``fold``), while they are in the CPU's cache: the run's
    views alternate an inner chunk's ``sizes[k]`` bytes and its trailer; the trailers
    and any bytes after the run (a shard's index, ``_read_whole``) are skipped."""

    def __init__(self, sizes: list[int]) -> None:
        self.segments = [n for size in sizes for n in (size, CRC_BYTES)] + [0, 2**63]
        self.crcs = [0] * len(sizes)
        self.segment, self.left = 0, self.segments[0]

    def __call__(self, piece: memoryview) -> None:
        at = 0
        while at < len(piece):
            while not self.left:
                self.segment += 1
                self.left = self.segments[self.segment]
            n = min(self.left, len(piece) - at)
            if self.segment % 2 == 0:
                k = self.segment // 2
                self.crcs[k] = crc32c.crc32c(piece[at : at + n], self.crcs[k])
            at, self.left = at + n, self.left - n


def _check_size(index: ShardIndex, i: int, raw: int, where: str) -> None:
    entry = index.entries[i]
    if entry is not None and entry[1] != raw + CRC_BYTES:
        raise CheckpointingException(
            f"Corrupt {where}: inner chunk {i} is stored in {entry[1]} bytes, expected {raw + CRC_BYTES}"
        )


@dataclass(frozen=True, eq=False)
class InnerGrid:
    """The inner chunks of one shard, in C order over its inner grid.

    Attributes:
        starts: their origins in the shard, an ``(inner chunks, ndim)`` int64 array.
        extents: their parts inside the array (``valid``: the part of the shard inside
            it, from the shard's origin), 0 along some axis for one wholly outside.
    """

    starts: np.ndarray
    extents: np.ndarray

    @classmethod
    def of(cls, shard_shape: Sequence[int], inner: Sequence[int], valid: Sequence[int]) -> InnerGrid:
        axes = [np.arange(0, s, i, dtype=np.int64) for s, i in zip(shard_shape, inner)]
        starts = np.stack([m.reshape(-1) for m in np.meshgrid(*axes, indexing="ij")], axis=1)
        return cls(starts, np.clip(np.asarray(valid, dtype=np.int64) - starts, 0, np.asarray(inner, dtype=np.int64)))


def _box(values: np.ndarray, origin: Sequence[int], lo: Sequence[int], hi: Sequence[int], out: np.ndarray) -> None:
    """Copies the part of ``values`` (a box of the shard at ``origin``) inside the box
    ``[lo, hi)`` of the shard into ``out`` (that box)."""
    a = [max(o, x) for o, x in zip(origin, lo)]
    b = [min(o + n, y) for o, n, y in zip(origin, values.shape, hi)]
    out[tuple(slice(x - y, z - y) for x, z, y in zip(a, b, lo))] = values[
        tuple(slice(x - o, z - o) for x, z, o in zip(a, b, origin))]


@dataclass(frozen=True)
class WholeObject:
    """``ByteRanges`` over a shard read whole, once, through a ``ChunkSource`` (what
    every ``ChunkStore`` can do): at most ``max_bytes``, the largest the shard can be,
    and the one byte more that tells a longer object (``ChunkStore.get_into``)."""

    chunk: ChunkSource
    data: memoryview

    @classmethod
    def read(cls, chunk: ChunkSource, max_bytes: int) -> WholeObject | None:
        buffer = bytearray(max_bytes + 1)
        got = chunk.store.get_into(chunk.rel, [memoryview(buffer)], 0)
        return None if got is None else cls(chunk, memoryview(buffer)[: got[0]])

    def describe(self) -> str:
        return self.chunk.describe()

    def read_suffix(self, n: int) -> tuple[bytes, int]:
        return bytes(self.data[max(0, len(self.data) - n):]), len(self.data)

    def read_range_into(self, offset: int, views: list[memoryview], fold: Fold) -> int:
        at = offset
        for v in views:
            n = max(0, min(len(v), len(self.data) - at))
            v[:n] = self.data[at : at + n]
            fold(v[:n])
            at += n
        return at - offset


@dataclass(frozen=True)
class ChunkRanges:
    """``ByteRanges`` over a stored shard through its ``ChunkStore``'s ranged reads
    (``get_suffix``, ``get_range_into``): only the index and the inner chunks asked for
    are read. A storage error (a range past the object's end: a truncated shard) is
    raised naming the shard."""

    chunk: ChunkSource

    def describe(self) -> str:
        return self.chunk.describe()

    def read_suffix(self, n: int) -> tuple[bytes, int] | None:
        try:
            return self.chunk.store.get_suffix(self.chunk.rel, n)
        except StorageError as exc:
            raise CheckpointingException(f"Cannot read the index of {self.describe()}: {exc}") from exc

    def read_range_into(self, offset: int, views: list[memoryview], fold: Fold) -> int:
        try:
            self.chunk.store.get_range_into_folded(self.chunk.rel, offset, views, fold)
        except StorageError as exc:
            raise CheckpointingException(f"Cannot read {self.describe()}: {exc}") from exc
        return sum(len(v) for v in views)


@dataclass(frozen=True)
class HeldShard:
    """What an object shared for a shard must hold: exactly its encoded ``pieces``
    (compared byte by byte), with the shard's ``crc``; ``source_etag`` as
    ``stores.base.ExpectedBytes`` says."""

    pieces: tuple[memoryview, ...]
    crc: int
    source_etag: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces)

    def md5_hex(self) -> str:
        md5 = hashlib.md5(usedforsecurity=False)
        for piece in self.pieces:
            md5.update(piece)
        return md5.hexdigest()

    def holds(self, blocks: Iterable[memoryview]) -> bool:
        """Whether the object read as ``blocks`` (cut anywhere) is exactly ``pieces``;
        compares in place, without joining either side."""
        pieces, piece = (memoryview(p).cast("B") for p in self.pieces), memoryview(b"")
        for block in (memoryview(b).cast("B") for b in blocks):
            while len(block):
                if not len(piece) and not len(piece := next(pieces, memoryview(b""))):
                    return False  # the object is longer
                n = min(len(block), len(piece))
                if block[:n] != piece[:n]:
                    return False
                block, piece = block[n:], piece[n:]
        return not len(piece) and all(not len(p) for p in pieces)

    def check(self, blocks: Iterable[memoryview], source: str) -> None:
        if not self.holds(blocks):
            raise ChunkMismatch(f"{source} does not hold the shard being saved (changed, replaced or damaged)")


@dataclass(frozen=True)
class ShardingIndexed(ChunkCodec):
    """``sharding_indexed`` with inner chunks of ``chunk_shape`` elements of ``itemsize``
    bytes, inner and index codecs ``[bytes, crc32c]``, index at the end. The crc32c it
    reports is ``EncodedShard.crc``."""

    name: ClassVar[str] = "sharding_indexed"
    reads_spans: ClassVar[bool] = True
    chunk_shape: tuple[int, ...]
    itemsize: int

    @property
    def inner_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        configuration = {
            "chunk_shape": list(self.chunk_shape),
            "codecs": BYTES_CRC32C.zarr_codecs(itemsize),
            "index_codecs": BYTES_CRC32C.zarr_codecs(_INDEX_DTYPE.itemsize),
            "index_location": "end",
        }
        return [{"name": self.name, "configuration": configuration}]

    @classmethod
    def recognize(cls, codecs: Sequence[Any], itemsize: int) -> ShardingIndexed | None:
        """Accepts one ``sharding_indexed`` whose inner codecs and index codecs are
        ``[bytes, crc32c]`` and whose index is at the end (the default)."""
        if not isinstance(codecs, Sequence) or len(codecs) != 1 or not isinstance(codecs[0], dict):
            return None
        if codecs[0].get("name") != cls.name or not isinstance(config := codecs[0].get("configuration"), dict):
            return None
        shape = config.get("chunk_shape")
        if (
            set(config) - {"chunk_shape", "codecs", "index_codecs", "index_location"}
            or config.get("index_location", "end") != "end"
            or BytesCrc32c.recognize(config.get("codecs"), itemsize) is None
            or BytesCrc32c.recognize(config.get("index_codecs"), _INDEX_DTYPE.itemsize) is None
            or not isinstance(shape, list)
            or not all(isinstance(n, int) and n > 0 for n in shape)
        ):
            return None
        return cls(tuple(shape), itemsize)

    def check_chunk_shape(self, chunk_shape: tuple[int, ...], where: str, key: str) -> None:
        """A shard of ``chunk_shape`` must be whole inner chunks along every axis (what
        the spec requires); another shape is refused, never misread."""
        inner = self.chunk_shape
        if len(inner) != len(chunk_shape) or any(c % i for c, i in zip(chunk_shape, inner)):
            raise CheckpointingException(
                f"{where}: array {key!r} is stored in shards of {tuple(chunk_shape)} with inner chunks {inner}, "
                "which do not tile them; the record is damaged. Restore the checkpoint from a copy"
            )

    def _split_axes(self, shard_shape: Sequence[int]) -> list[int]:
        """The axes along which the inner chunks split a shard."""
        return [a for a, (s, i) in enumerate(zip(shard_shape, self.chunk_shape)) if s != i]

    def _split_axis(self, shard_shape: Sequence[int]) -> int | None:
        """The one axis along which the inner chunks split a shard whose decoded bytes
        are its C order (``c_ordered``); None for one inner chunk."""
        return next(iter(self._split_axes(shard_shape)), None)

    def c_ordered(self, shard_shape: Sequence[int]) -> bool:
        """Whether a shard's decoded bytes (inner-chunk-major) are its C order: the inner
        chunks split one axis, and the shard is one element along every axis before it."""
        split = self._split_axes(shard_shape)
        return len(split) <= 1 and all(n == 1 for n in shard_shape[: split[0] if split else 0])

    def decoded(self, packed: np.ndarray, shard_shape: Sequence[int], valid: Sequence[int]) -> np.ndarray:
        """A shard's decoded bytes (flat uint8) from ``packed`` (flat uint8: each inner
        chunk's part inside the array, ``valid`` from the shard's origin, C-contiguous,
        in C order over the inner grid): ``packed`` itself when the shard lies inside
        the array, else a copy with every inner chunk padded with zeros."""
        if tuple(valid) == tuple(shard_shape):
            return packed
        grid, size = InnerGrid.of(shard_shape, self.chunk_shape, valid), self.itemsize
        out = np.zeros(len(grid.starts) * self.inner_nbytes, np.uint8)
        in_bytes = lambda shape: (*shape[:-1], shape[-1] * size)  # noqa: E731
        at = 0
        for i, extent in enumerate(grid.extents.tolist()):
            n = math.prod(extent) * size
            if n:
                slot = out[i * self.inner_nbytes : (i + 1) * self.inner_nbytes].reshape(in_bytes(self.chunk_shape))
                slot[tuple(slice(0, e) for e in in_bytes(extent))] = packed[at : at + n].reshape(in_bytes(extent))
                at += n
        return out

    def pack(self, values: np.ndarray) -> np.ndarray:
        """A whole shard's decoded bytes (flat uint8, inner-chunk-major) from its
        ``values`` (the shard's shape, any strides: a shard inside a block, written by
        the block's holder, ``planning.plans.in_block_sharded_record``): one copy, each
        axis split into (inner chunks, inner extent) and the inner-chunk axes moved first
        (a view), then made contiguous; no copy where the decoded bytes are the shard's C
        order (``c_ordered``) and ``values`` is C-contiguous."""
        shape = values.shape
        if self.c_ordered(shape) and values.flags.c_contiguous:
            return values.reshape(-1).view(np.uint8)
        split = [n for s, i in zip(shape, self.chunk_shape) for n in (s // i, i)]
        ndim = len(shape)
        order = [*range(0, 2 * ndim, 2), *range(1, 2 * ndim, 2)]
        return np.ascontiguousarray(values.reshape(split).transpose(order)).reshape(-1).view(np.uint8)

    def _count(self, nbytes: int, where: str) -> int:
        if nbytes % self.inner_nbytes:
            raise CheckpointingException(
                f"{where}: {nbytes} bytes are not whole inner chunks of {self.inner_nbytes} bytes ({self.chunk_shape})"
            )
        return nbytes // self.inner_nbytes

    def _split(self, data: memoryview) -> list[memoryview | None]:
        step = self.inner_nbytes
        return [data[at : at + step] for at in range(0, self._count(len(data), "a shard") * step, step)]

    def encode(self, data: memoryview) -> EncodedChunk:
        shard = encode_shard(self._split(data))
        return EncodedChunk(shard.pieces, shard.crc)

    def encode_stream(self, data: memoryview, fold: Fold, block_bytes: int) -> StreamedChunk:
        """``encode_shard``'s object, each inner chunk streamed as ``BYTES_CRC32C``
        streams a chunk (its crc32c and ``fold`` taken of each block just before it is
        written, in cache), then the crc table and the index: one pass over the bytes,
        where ``encode`` and a digest first took three."""
        streamed = StreamedChunk(iter(()))

        def pieces() -> Iterator[memoryview]:
            inner, crcs = self._split(data), []
            for chunk in inner:
                stream = BYTES_CRC32C.encode_stream(chunk, fold, block_bytes)  # type: ignore[arg-type]
                yield from stream.pieces
                crcs.append(stream.crc)
            suffix, _, streamed.crc = _suffix([len(c) for c in inner], crcs)  # type: ignore[arg-type]
            yield from suffix

        streamed.pieces = pieces()
        return streamed

    def stored_nbytes(self, nbytes: int) -> int:
        """What ``encode_shard`` writes for ``nbytes`` of inner chunks: each with its
        crc32c, then the crc table and the index; the most a shard can be."""
        count = self._count(nbytes, "a shard")
        return count * (self.inner_nbytes + CRC_BYTES) + ShardIndex.suffix_nbytes(count)

    def read_into(self, chunk: ChunkSource, views: list[memoryview]) -> int:
        """Reads the shard and checks it: its inner chunks straight into ``views`` in one
        pass as a chunk is read (``_read_whole``: one request, no copy); a shard another
        writer laid out by its index (``read_inner``): by ranged reads, or read whole
        once (``WholeObject``) where it is at most what one more request costs
        (``ChunkStore.request_bytes``). An inner chunk split over several ``views`` is
        read into a buffer first. The bytes held besides ``views``: the shard's index,
        or the shard where it is read whole."""
        count = self._count(sum(len(v) for v in views), chunk.describe())
        inner = _inner_views(views, self.inner_nbytes)
        if inner is not None and (crc := _read_whole(chunk, inner)) is not None:
            return crc
        source: ByteRanges | None = ChunkRanges(chunk)
        if (stored := self.stored_nbytes(count * self.inner_nbytes)) <= chunk.store.request_bytes:
            source = WholeObject.read(chunk, stored)
            if source is None:
                raise CheckpointingException(f"Missing {chunk.describe()}: the checkpoint is damaged")
        if inner is not None:
            return read_inner(source, count, dict(enumerate(inner)))
        buffer = bytearray(count * self.inner_nbytes)
        crc = read_inner(source, count, dict(enumerate(self._split(memoryview(buffer)))))  # type: ignore[arg-type]
        _scatter(memoryview(buffer), views)
        return crc

    def read_boxes_into(self, chunk: ChunkSource, shard_shape: tuple[int, ...], parts: Sequence[BoxRead]) -> int:
        """Fills each ``(box, out)`` of ``parts`` with that box of the shard (of
        ``shard_shape``), reading once what they all need: the crc table and index in
        one request, then the inner chunks they cover (``ChunkRanges``), checked against
        the shard's crc the caller compares with the record's. The shard is read whole
        (one request, where ranged reads take two) when that adds at most a quarter of
        the bytes needed (issue 44.4's bound) or at most what one more request costs on
        its storage (``ChunkStore.request_bytes``: nothing locally, 8 MiB on S3), except
        where it is all needed and requests cost nothing (locally: the ranged read lands
        in place, the whole one would be copied);
        straight into ``out`` when the one box is the shard or a run of its inner chunks
        (a load at another layout of first-axis blocks), ``out`` is C-contiguous and the
        shard's decoded bytes are its C order."""
        c_ordered = self.c_ordered(shard_shape)
        if c_ordered and len(parts) == 1 and parts[0][1].flags.c_contiguous and all(
                (s.start, s.stop) == (0, n) for s, n in zip(parts[0][0], shard_shape)):
            return self.read_into(chunk, [memoryview(parts[0][1].reshape(-1).view(np.uint8))])
        grid = InnerGrid.of(shard_shape, self.chunk_shape, shard_shape)
        count, step = len(grid.starts), self.inner_nbytes
        ends = grid.starts + np.asarray(self.chunk_shape, dtype=np.int64)
        hits = [np.all((grid.starts < [s.stop for s in box]) & (ends > [s.start for s in box]), axis=1)
                for box, _ in parts]
        needed = np.flatnonzero(np.logical_or.reduce(hits)).tolist()
        source: ByteRanges | None = ChunkRanges(chunk)
        waste = (count - len(needed)) * step
        if (waste or chunk.store.request_bytes) and waste <= max(len(needed) * step // 4, chunk.store.request_bytes):
            source = WholeObject.read(chunk, self.stored_nbytes(count * step))
            if source is None:
                raise CheckpointingException(f"Missing {chunk.describe()}: the checkpoint is damaged")
        one_run = c_ordered and needed[-1] - needed[0] + 1 == len(needed)  # along the split axis
        box, out = parts[0]
        if one_run and len(parts) == 1 and out.flags.c_contiguous and [(s.start, s.stop) for s in box] == list(
                zip(grid.starts[needed[0]].tolist(), ends[needed[-1]].tolist())):  # the box is these inner chunks
            flat = memoryview(out.reshape(-1).view(np.uint8))
            return read_inner(source, count, {i: flat[k * step : (k + 1) * step] for k, i in enumerate(needed)})
        buffer = np.empty(len(needed) * step, np.uint8)
        crc = read_inner(source, count, {i: memoryview(buffer[k * step : (k + 1) * step]) for k, i in enumerate(needed)})
        values = buffer.view(parts[0][1].dtype)
        if one_run:
            axis = self._split_axis(shard_shape) or 0
            run = values.reshape([len(needed) * n if a == axis else n for a, n in enumerate(self.chunk_shape)])
            for box, out in parts:
                _box(run, grid.starts[needed[0]].tolist(), [s.start for s in box], [s.stop for s in box], out)
            return crc
        at, per_inner = {i: k for k, i in enumerate(needed)}, math.prod(self.chunk_shape)
        for (box, out), hit in zip(parts, hits):
            for i in np.flatnonzero(hit).tolist():
                inner = values[at[i] * per_inner : (at[i] + 1) * per_inner].reshape(self.chunk_shape)
                _box(inner, grid.starts[i].tolist(), [s.start for s in box], [s.stop for s in box], out)
        return crc

    def held(self, data: memoryview, digest: str) -> HeldShard:
        encoded = self.encode(data)
        return HeldShard(encoded.pieces, encoded.crc)


def _inner_views(views: list[memoryview], step: int) -> list[memoryview] | None:
    """``views`` cut into inner chunks of ``step`` bytes, or None where one spans two."""
    out: list[memoryview] = []
    for v in views:
        if len(v) % step:
            return None
        out.extend(v[at : at + step] for at in range(0, len(v), step))
    return out


def _scatter(data: memoryview, views: list[memoryview]) -> None:
    at = 0
    for v in views:
        v[:] = data[at : at + len(v)]
        at += len(v)


register(ShardingIndexed)


# The features of sharded arrays a record lists in ``requires`` (``format.features``),
# each with the format version that introduced it.
SHARDING_FEATURE = "sharding_indexed"
SHARDING_SINCE = 5
FLAT_SHARDS_FEATURE = "flat_shards"
FLAT_SHARDS_SINCE = 7


def stored_in_shards(array: Any) -> bool:
    """Whether the ``ArrayRecord`` ``array`` is stored in shards (feature ``sharding_indexed``)."""
    return isinstance(array.codec, ShardingIndexed)


def spans_blocks(block: tuple[int, ...], chunk_shape: tuple[int, ...]) -> bool:
    """Whether chunks (shards) of ``chunk_shape`` are larger than the flattened
    ``block`` along some axis."""
    return any(0 < b < c for b, c in zip(block, chunk_shape))


def shards_span_blocks(array: Any) -> bool:
    """Whether the ``ArrayRecord`` ``array`` is a flattened array stored in shards larger
    than its flattened block (feature ``flat_shards``)."""
    return array.flattened_block is not None and spans_blocks(array.flattened_block, array.chunk_shape)
