"""Chunk I/O: which chunks a region touches, and moving them between storage and memory.

A chunk is stored as one object at ``<key>/c.<i>.<j>...``, laid out by the array's codec
(``format.codecs``: ``encode`` gives the pieces written, ``read_into`` fills the reader's
views and checks the object's own checksums; today every array is ``[bytes, crc32c]``,
raw little-endian bytes then their crc32c). This module knows arrays, regions and the
commit record's checksums; the codec knows the layout of one object; the stores know
bytes and paths: a location's ``ChunkStore`` (``Store.chunk_store``; ``stores.base``
says what each backend provides: ``writev``/``readv`` straight between the tensor's
memory and local files, TensorStore's kvstore on object stores, the store's own get/put
elsewhere).

The writer of a chunk reports the crc32c its codec gives and a 128-bit content digest of
its decoded bytes (XXH3-128, as fast as crc32c here: 12.9 GB/s each on one core); the
commit record keeps both for every chunk (``format.ArrayRecord.chunk_crcs``,
``chunk_digests``), both taken block by block as the chunk is written, each block
hashed twice and copied out while in cache (``ChunkFile.write``); a read takes its
crc32c of each block as it lands. The digest lets a later save share a chunk whose
bytes did not change instead of writing it again (``format.reuse``). Every read checks the chunk
against its own checksums (the codec) and the crc32c the record keeps for it (here): a
chunk swapped with another of the same array, of another array, or copied from another
checkpoint fails the read, naming the chunk.

Reads on local files never follow a symbolic link out of the checkpoint and never open
anything but a regular file (a FIFO would block, a device would never end):
``stores.local.FileChunkStore``.

Measured on this machine (512 MiB of float32, page cache dropped before loads): a
TensorStore read of the same arrays took 0.67 s, the file path 0.30 s, because
TensorStore decodes each chunk into a new buffer and then copies it into the result.
Threads do the I/O; ``os.readv``/``os.writev``, crc32c and XXH3 release the GIL. Chunks
are bit-identical to TensorStore's (a test checks it), so readers cannot tell the
difference.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_IO_CONCURRENCY",
    "DEFAULT_IO_THREADS",
    "MIN_SCATTER_RUN",
    "PackRunJob",
    "ArrayChunks",
    "ChunkFile",
    "ChunkMismatch",
    "ChunkPiece",
    "ChunkStore",
    "ChunkSums",
    "HeldChunk",
    "ReadJob",
    "Region",
    "ShareChunk",
    "WrittenChunk",
    "chunk_digest",
    "data_digest",
    "chunk_pieces",
    "chunk_store_for",
    "is_chunk_aligned",
    "read_region",
    "run_reads",
    "run_writes",
    "write_region",
]

import contextlib
import dataclasses
import functools
import itertools
import math
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash

from shardstore.errors import CheckpointingException
from shardstore.format.codecs import BYTES_CRC32C, BoxRead, ChunkCodec, HeldChunk
from shardstore.format.dtypes import from_zarr_name
from shardstore.format.packs import PackedChunks, pack_runs
from shardstore.format.records import ArrayRecord, file_digest
from shardstore.format.records.names import CHUNK_SEPARATOR, chunk_key
from shardstore.progress import tracked
from shardstore.stores.base import (
    DEFAULT_IO_THREADS,
    STREAM_BLOCK_BYTES,
    ChunkMismatch,
    ChunkStore,
    Location,
    RangeReader,
    run_parallel,
)

# A box of a global array, one slice per axis (``planning.layout`` builds them).
Region = tuple[slice, ...]
# A strided destination is filled by a scatter read when its contiguous runs are at
# least this long; shorter runs go through a one-chunk buffer and a copy.
MIN_SCATTER_RUN = 4096
# TensorStore (object store) I/O operations in flight at once.
DEFAULT_IO_CONCURRENCY = 64

# The fast path writes native byte order as the ``little`` the metadata promises.
NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True)
class ChunkPiece:
    """The part of one chunk that falls inside a region.

    Attributes:
        index: the chunk's grid index.
        in_chunk: the part, relative to the chunk's origin.
        in_region: the same part, relative to the region's origin.
        Both end with ``...``: indexing with them always gives a view, also of a 0-d
        array (``a[()]`` would give a detached scalar, and a read into it is lost).
        whole: the part is the entire stored chunk (no edge padding, nothing outside).
    """

    index: tuple[int, ...]
    in_chunk: tuple[Any, ...]
    in_region: tuple[Any, ...]
    whole: bool


def chunk_pieces(region: Region, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Iterator[ChunkPiece]:
    """The chunks a region of an array touches, and which part of each."""
    ranges = [
        range(s.start // c, -(-s.stop // c)) if s.stop > s.start else range(0)
        for s, c in zip(region, chunk_shape)
    ]
    for index in itertools.product(*ranges):
        in_chunk, in_region, whole = [], [], True
        for i, s, c, n in zip(index, region, chunk_shape, shape):
            lo, hi = max(s.start, i * c), min(s.stop, (i + 1) * c)
            in_chunk.append(slice(lo - i * c, hi - i * c))
            in_region.append(slice(lo - s.start, hi - s.start))
            whole = whole and lo == i * c and hi == (i + 1) * c and hi <= n
        yield ChunkPiece(tuple(index), (*in_chunk, ...), (*in_region, ...), whole)


def is_chunk_aligned(region: Region, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> bool:
    """Every chunk the region touches is covered entirely (up to the array's edge)."""
    return all(
        s.start % c == 0 and (s.stop % c == 0 or s.stop == n)
        for s, c, n in zip(region, chunk_shape, shape)
    )


def _bytes_view(a: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (any dtype, bfloat16 included)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def chunk_store_for(location: Location, io_concurrency: int, local_threads: int = DEFAULT_IO_THREADS) -> ChunkStore:
    """The chunk store of a checkpoint location, as its store makes it
    (``Store.chunk_store``: files under a local directory with ``local_threads``
    threads, at most ``io_concurrency``; an object store with ``io_concurrency``
    requests in flight; else the store's own get/put)."""
    if not NATIVE_LITTLE_ENDIAN:
        raise CheckpointingException("shardstore's chunk I/O needs a little-endian host")
    return location.store.chunk_store(io_concurrency, local_threads)


class ChunkFile:
    """One stored chunk of one array, laid out by the array's codec.

    Attributes:
        expected_crc: the crc32c the commit record keeps for this chunk (None for
            checkpoints of format version 1, which keep none).
        codec: how the chunk is stored (``format.codecs``).
    """

    def __init__(
        self, store: ChunkStore, array_key: str, index: tuple[int, ...], chunk_key: str,
        expected_crc: int | None = None, codec: ChunkCodec = BYTES_CRC32C,
    ) -> None:
        self.store, self.array_key, self.index, self.expected_crc = store, array_key, index, expected_crc
        self.chunk_key, self.codec = chunk_key, codec
        self.rel = f"{array_key}/{chunk_key}"

    @property
    def path(self) -> str:
        return self.store.describe(self.rel)

    def describe(self) -> str:
        return f"chunk {self.chunk_key} of array {self.array_key!r} ({self.path})"

    def write(self, data: np.ndarray, digest: str | None = None) -> ChunkSums:
        """Writes a C-contiguous chunk as its codec lays it out; returns the crc32c the
        codec reports for the commit record and the chunk's digest (``chunk_digest``),
        both taken block by block as the chunk is written, where the codec streams
        (``ChunkCodec.encode_stream``): each block is hashed twice and copied out while
        it is in cache. ``digest``: the chunk's digest where the caller took it already
        (a reusing save's check, ``run_writes``), which is then not taken again.

        No fsync here: the location's ``make_durable`` (one ``syncfs`` per rank) flushes
        every chunk before the commit; a local store starts a large chunk's write-back
        as it is written (``stores.local.start_writeback``). An fsync per large chunk
        from the writer threads was measured slower: with the ranks holding 4 GiB each
        besides the state (as trainers do), 2 GiB at 2 ranks took 2.1-2.4 s against
        1.4-1.7 s with the one ``syncfs``, and 1.3-1.4 s for the plain-file bound."""
        hasher = xxhash.xxh3_128() if digest is None else None
        fold = hasher.update if hasher is not None else _taken_already
        streamed = self.codec.encode_stream(_bytes_view(data), fold, STREAM_BLOCK_BYTES)
        etag = self.store.put(self.rel, streamed.pieces)
        if streamed.crc is None:  # known once the store took every piece
            raise CheckpointingException(
                f"Internal error: the store wrote {self.describe()} without taking all of its pieces; please report it"
            )
        return ChunkSums(streamed.crc, hasher.hexdigest() if hasher is not None else digest, etag)

    def read_into(self, out: np.ndarray) -> None:
        """Fills a C-contiguous ``out`` with the chunk (``read_into_views``)."""
        self.read_into_views([_bytes_view(out)])

    def read_into_views(self, views: list[memoryview]) -> None:
        """Fills ``views`` in order with the chunk (a scatter read: the rows of a
        strided destination need no bounce buffer); its codec checks the object, and
        the crc32c it reports must be the one the commit record keeps for the chunk."""
        self._check_recorded(self.codec.read_into(self, views))

    def read_boxes_into(self, chunk_shape: tuple[int, ...], parts: list[BoxRead]) -> None:
        """Fills each ``(box, out)`` of ``parts`` with that box of the chunk (of
        ``chunk_shape``), reading once what the codec must read for them
        (``ChunkCodec.read_boxes_into``: a shard's inner chunks that cover them), checked
        as ``read_into_views`` checks."""
        self._check_recorded(self.codec.read_boxes_into(self, chunk_shape, parts))

    def _check_recorded(self, crc: int) -> None:
        if self.expected_crc is not None and crc != self.expected_crc:
            raise CheckpointingException(
                f"Wrong {self.describe()}: its crc32c {crc:08x} is not the {self.expected_crc:08x} the commit "
                "record keeps for it (a chunk moved, swapped or copied from another checkpoint)"
            )


@dataclass
class ArrayChunks:
    """Where one array's chunks live, how they are shaped and stored (``codec``), and
    their recorded crc32c (C order over the chunk grid; None when the record keeps none)."""

    key: str
    store: ChunkStore
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    crcs: tuple[int, ...] | None = None
    separator: str = CHUNK_SEPARATOR
    codec: ChunkCodec = BYTES_CRC32C

    @classmethod
    def of(cls, store: ChunkStore, record: ArrayRecord) -> ArrayChunks:
        """The chunks of the array ``record`` describes, with the checksums it binds;
        a packed array's are its members in its pack (``format.packs.PackedChunks``)."""
        dtype = from_zarr_name(record.dtype).numpy_dtype
        if record.pack is not None:
            store = PackedChunks(store, record)
        return cls(record.key, store, record.shape, record.chunk_shape, dtype, record.chunk_crcs,
                   record.chunk_separator, record.codec)

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each axis."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    def file(self, index: tuple[int, ...]) -> ChunkFile:
        expected = None
        if self.crcs is not None:
            expected = self.crcs[_c_order_position(index, self.grid)]
        return ChunkFile(self.store, self.key, index, chunk_key(index, self.separator), expected, self.codec)


def _c_order_position(index: tuple[int, ...], grid: tuple[int, ...]) -> int:
    """The position of grid cell ``index`` in C order (``np.ravel_multi_index`` without
    its bounds checks: a few microseconds per chunk that a load of 10,000 small arrays
    paid once each); 0 for a 0-d array's one chunk."""
    position = 0
    for i, n in zip(index, grid):
        position = position * n + i
    return position


def _one_whole_chunk(array: ArrayChunks, region: Region, data: np.ndarray) -> tuple[int, ...] | None:
    """The grid index of the chunk when ``region`` is exactly one whole stored chunk (no
    edge padding) and ``data`` (shaped like it) is C-contiguous, else None: the case
    that needs no ``chunk_pieces`` walk."""
    if data.shape != array.chunk_shape or not data.flags.c_contiguous:
        return None
    index = tuple(s.start // c for s, c in zip(region, array.chunk_shape))
    whole = all(s.start == i * c and s.stop <= n for s, i, c, n in zip(region, index, array.chunk_shape, array.shape))
    return index if whole else None


def write_region(array: ArrayChunks, region: Region, value: np.ndarray) -> list[tuple[ChunkFile, np.ndarray]]:
    """The chunk files and the data that store ``value`` at ``region``.

    ``region`` must be chunk-aligned (one writer per chunk); edge chunks are padded with
    zeros (the fill value) to the full chunk shape, as Zarr stores them. A whole chunk
    is a view of ``value``, strided where the chunk splits a later axis of it
    (``planning.layout.bound_chunk``): its writer copies it when it runs
    (``run_writes``), so a rank holds one such copy per writer thread, not one of every
    chunk at once.
    """
    if (index := _one_whole_chunk(array, region, value)) is not None:  # as it is
        return [(array.file(index), value)]
    jobs = []
    for piece in chunk_pieces(region, array.shape, array.chunk_shape):
        slab = value[piece.in_region]
        if not piece.whole:
            full = np.zeros(array.chunk_shape, dtype=value.dtype)
            full[piece.in_chunk] = slab
            slab = full
        jobs.append((array.file(piece.index), slab))
    return jobs


@dataclass
class ReadJob:
    """One chunk to read into the part of ``out`` that it covers.

    ``direct``: the piece is the whole chunk and its slab of ``out`` is contiguous, so
    the file is read straight into ``out``; otherwise into a one-chunk buffer (allocated
    when the job runs, so at most one per thread is alive) and copied from there.
    """

    file: ChunkFile
    out: np.ndarray
    piece: ChunkPiece
    chunk_shape: tuple[int, ...]
    direct: bool

    @property
    def nbytes(self) -> int:
        """Bytes this job fills in ``out``."""
        return self.out[self.piece.in_region].nbytes

    def run(self) -> None:
        target = self.out[self.piece.in_region]
        if self.file.codec.reads_spans:
            BoxesJob(self.file, self.chunk_shape, [(self.piece.in_chunk[:-1], target)]).run()
            return
        runs = None if self.direct or not self.piece.whole else _contiguous_runs(target, self.out)
        buffer = target if self.direct or runs else np.empty(self.chunk_shape, self.out.dtype)
        with _read_errors(self.file):
            if runs:
                self.file.read_into_views(runs)
            else:
                self.file.read_into(buffer)
        if buffer is not target:
            target[...] = buffer[self.piece.in_chunk]


@dataclass
class BoxesJob:
    """Every box one load reads of one chunk whose codec reads parts of its object (a
    shard, ``ChunkCodec.reads_spans``): one read of what they need (a shard's index
    once, the inner chunks they cover), then each copied out (``run_reads`` makes
    them of the ``ReadJob`` s that share a chunk)."""

    file: ChunkFile
    chunk_shape: tuple[int, ...]
    parts: list[BoxRead]

    @property
    def nbytes(self) -> int:
        return sum(out.nbytes for _, out in self.parts)

    def run(self) -> None:
        with _read_errors(self.file):
            self.file.read_boxes_into(self.chunk_shape, self.parts)


@contextlib.contextmanager
def _read_errors(file: ChunkFile) -> Iterator[None]:
    """A failed read of ``file`` as a CheckpointingException naming it."""
    try:
        yield
    except CheckpointingException:
        raise
    except Exception as exc:  # OSError locally; TensorStore's ValueError for S3
        raise CheckpointingException(f"Reading {file.describe()} failed: {exc}") from exc


@dataclass
class CopiesJob:
    """Several ``ReadJob`` s of one chunk whose codec reads it whole (a rank that reads
    blocks of one chunk for other ranks, ``planning.plans.plan_reads``): the chunk read
    once, into the first job's part where that is the whole chunk (``ReadJob.direct``),
    else into a one-chunk buffer allocated when it runs, then each other part copied
    out of it."""

    jobs: list[ReadJob]

    @property
    def file(self) -> ChunkFile:
        return self.jobs[0].file

    @property
    def nbytes(self) -> int:
        return sum(job.nbytes for job in self.jobs)

    def run(self) -> None:
        first = self.jobs[0]
        landing = next((job for job in self.jobs if job.direct), None)
        buffer = landing.out[landing.piece.in_region] if landing else np.empty(first.chunk_shape, first.out.dtype)
        with _read_errors(self.file):
            self.file.read_into(buffer)
        for job in self.jobs:
            if job is not landing:
                job.out[job.piece.in_region] = buffer[job.piece.in_chunk]


def _coalesced(jobs: list[ReadJob]) -> list[ReadJob | BoxesJob | CopiesJob]:
    """``jobs``, those of one chunk made one job that reads it once: a ``BoxesJob``
    where its codec reads parts of it (a load that asks for many blocks of one shard
    reads its index once), else a ``CopiesJob``."""
    by_chunk: dict[tuple[int, str, str], list[ReadJob]] = {}
    for job in jobs:
        by_chunk.setdefault((id(job.file.store), job.file.rel, job.out.dtype.str), []).append(job)
    out: list[ReadJob | BoxesJob | CopiesJob] = []
    for same in by_chunk.values():
        first = same[0]
        if first.file.codec.reads_spans:
            out.append(BoxesJob(first.file, first.chunk_shape,
                                [(job.piece.in_chunk[:-1], job.out[job.piece.in_region]) for job in same]))
        else:
            out.append(first if len(same) == 1 else CopiesJob(same))
    return out


def _contiguous_runs(target: np.ndarray, whole: np.ndarray) -> list[memoryview] | None:
    """``target`` (a strided view into the C-contiguous array ``whole``) as its
    contiguous runs in order, or None when they are too short to be worth it.

    The runs are slices of one byte view of ``whole`` at offsets computed in bulk:
    indexing ``target`` row by row cost about 10 us a row."""
    partial = [a for a, (t, w) in enumerate(zip(target.shape, whole.shape)) if t != w]
    if not partial:
        return [_bytes_view(target)]
    lead = target.shape[: partial[-1]]  # every axis after the last partial one is whole
    count = math.prod(lead)
    run = target.nbytes // max(1, count)
    if run < MIN_SCATTER_RUN:
        return None
    offsets = np.array(target.ctypes.data - whole.ctypes.data, dtype=np.int64)
    for size, stride in zip(lead, target.strides):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
    flat = _bytes_view(whole)
    return [flat[o : o + run] for o in offsets.reshape(-1).tolist()]


def read_region(array: ArrayChunks, region: Region, out: np.ndarray) -> list[ReadJob]:
    """Jobs that fill ``out`` (shaped like ``region``) from the array's chunks."""
    if (index := _one_whole_chunk(array, region, out)) is not None:  # the common small case
        everything = (*(slice(0, c) for c in array.chunk_shape), ...)
        return [ReadJob(array.file(index), out, ChunkPiece(index, everything, everything, True),
                        array.chunk_shape, direct=True)]
    return [
        ReadJob(
            array.file(piece.index), out, piece, array.chunk_shape,
            direct=piece.whole and out[piece.in_region].flags.c_contiguous,
        )
        for piece in chunk_pieces(region, array.shape, array.chunk_shape)
    ]


class ChunkSums(NamedTuple):
    """The checksums of one chunk written (``ChunkFile.write``).

    Attributes:
        crc: the crc32c its codec reports for the commit record.
        digest: XXH3-128 of its bytes, 32 hex digits (``chunk_digest``).
        etag: the tag its store gave the object (``ChunkStore.put``), or None.
    """

    crc: int
    digest: str
    etag: str | None = None


class WrittenChunk(NamedTuple):
    """What the writer of one chunk reports for the commit record.

    Attributes:
        key: the array's key.
        index: the chunk's grid index.
        crc: crc32c of its bytes.
        digest: XXH3-128 of its bytes, 32 hex digits (``chunk_digest``).
        shared: stored bytes shared with an earlier checkpoint instead of written
            (``format.reuse``), 0 for a chunk written.
        etag: the tag the store gave the object (an ETag on object stores, a local
            file's identity), or None: the commit record keeps it, so a later save can
            prove a copy or link of the object without reading or hashing the bytes
            (``ChunkStore.share_from``).
        packed: for a chunk written into a pack (``format.packs``), the pack's name,
            the offset of the chunk's stored bytes in it and the pack's size; else None.
    """

    key: str
    index: tuple[int, ...]
    crc: int
    digest: str
    shared: int = 0
    etag: str | None = None
    packed: tuple[str, int, int] | None = None


def chunk_digest(view: memoryview) -> str:
    """The content digest of a chunk's bytes: XXH3-128 as 32 hex digits (releases the
    GIL, like crc32c). 128 bits, unlike crc32c, are not forged by changing four bytes.
    The same digest the commit record keeps for other files (``records.file_digest``)."""
    return file_digest(view)


# Shares a chunk with an earlier checkpoint instead of writing it (``format.reuse``):
# given the chunk's file, its bytes and their digest, the report, or None to write it.
ShareChunk = Callable[["ChunkFile", memoryview, str], "WrittenChunk | None"]


def data_digest(data: np.ndarray) -> str:
    """``chunk_digest`` of a chunk's data as its writer is handed it (any strides: a
    strided chunk is copied first, as its writer does)."""
    return chunk_digest(_bytes_view(np.ascontiguousarray(data)))


def run_writes(
    jobs: list[tuple[ChunkFile, np.ndarray]], threads: int | None = None, share: ShareChunk | None = None,
) -> list[WrittenChunk]:
    """Writes the chunks (or shares those ``share`` finds unchanged in an earlier
    checkpoint); returns what each writer reports for the commit record."""
    written: list[WrittenChunk] = []
    with tracked("write", (data.nbytes for _, data in jobs)) as tick:

        def write(job: tuple[ChunkFile, np.ndarray]) -> None:
            file, data = job
            try:
                report = _write_or_share(file, data, share)
            except CheckpointingException:
                raise
            except Exception as exc:  # OSError locally; TensorStore's ValueError for S3
                raise CheckpointingException(f"Writing {file.describe()} failed: {exc}") from exc
            written.append(report)  # list.append is atomic
            if tick:
                tick(data.nbytes)

        run_parallel(write, jobs, threads or _threads_of(jobs))
    return written


def _write_or_share(file: ChunkFile, data: np.ndarray, share: ShareChunk | None) -> WrittenChunk:
    """Writes a chunk, or shares it where ``share`` finds it unchanged (its digest,
    taken first, decides; a chunk written then is not hashed a second time). A strided
    chunk (``write_region``) is copied here, on the writer's thread."""
    data = np.ascontiguousarray(data)
    if share is None:
        return _written(file, file.write(data))
    view = _bytes_view(data)
    digest = chunk_digest(view)
    report = share(file, view, digest)
    if report is not None:
        return report
    return _written(file, file.write(data, digest))


def _written(file: ChunkFile, sums: ChunkSums) -> WrittenChunk:
    return WrittenChunk(file.array_key, file.index, sums.crc, sums.digest, etag=sums.etag)


def _taken_already(block: memoryview) -> None:
    """The fold of a chunk whose digest its writer was handed (``ChunkFile.write``)."""


def run_reads(jobs: list[ReadJob], threads: int | None = None) -> None:
    """Runs the reads (each fills its part of its output array; those of one chunk
    together, ``BoxesJob``, ``CopiesJob``; the packed chunks of one pack in runs of
    one ranged read each through one opening of the pack, ``PackRunJob``)."""
    runs = _coalesced(jobs)
    threads = threads or _threads_of([(j.file, None) for j in runs])
    opened: list[_OpenPack] = []
    try:
        tasks = _pack_runs(runs, opened)
        with tracked("read", (job.nbytes for job in tasks)) as tick:

            def read(job: ReadJob | BoxesJob | CopiesJob | PackRunJob) -> None:
                job.run()
                if tick:
                    tick(job.nbytes)

            run_parallel(read, tasks, threads)  # every task has ended when it returns or raises
    finally:
        for pack in opened:
            pack.close()


class _OpenPack:
    """One pack that one load reads (``run_reads``): opened by the first of its runs to
    read (``ChunkStore.ranges_of``: one descriptor of a local file), shared by the
    others, and closed by the last one to end, or by ``run_reads`` at the end (errors)."""

    def __init__(self, chunks: PackedChunks, runs: int) -> None:
        self.base, self.pack, self.left = chunks.base, chunks.pack, runs
        self.lock = threading.Lock()
        self.context: contextlib.AbstractContextManager[RangeReader] | None = None
        self.reader: RangeReader | None = None

    def read(self, start: int, buffer: bytearray, first: ChunkFile) -> None:
        try:
            with self.lock:
                if self.reader is None:
                    context = self.base.ranges_of(self.pack)
                    self.reader = context.__enter__()
                    self.context = context
            self.reader(start, [memoryview(buffer)])
        except Exception as exc:  # OSError locally; TensorStore's ValueError for S3
            raise CheckpointingException(
                f"Reading bytes [{start}, {start + len(buffer)}) of {self.base.describe(self.pack)} (from "
                f"{first.describe()} on) failed: {exc}"
            ) from exc

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self._close()

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        context, self.context, self.reader = self.context, None, None
        if context is not None:
            context.__exit__(None, None, None)


@dataclass
class PackRunJob:
    """Packed chunks side by side in one pack (``format.packs.pack_runs``): one ranged
    read of ``[start, end)`` of the pack, then each job's chunk read from those bytes
    and checked as every chunk is (``PackedChunks.landed``)."""

    pack: _OpenPack
    start: int
    end: int
    jobs: list[ReadJob | CopiesJob]

    @property
    def nbytes(self) -> int:
        return sum(job.nbytes for job in self.jobs)

    def run(self) -> None:
        try:
            buffer = bytearray(self.end - self.start)
            self.pack.read(self.start, buffer, self.jobs[0].file)
            data = memoryview(buffer)
            for job in self.jobs:
                _landed_job(job, self.start, data).run()
        finally:
            self.pack.done()


def _landed_job(job: ReadJob | CopiesJob, start: int, data: memoryview) -> ReadJob | CopiesJob:
    """``job`` reading its packed chunk from ``data``, bytes of its pack from ``start``."""
    if isinstance(job, CopiesJob):
        return CopiesJob([_landed_job(one, start, data) for one in job.jobs])  # type: ignore[misc]
    file = job.file
    assert isinstance(file.store, PackedChunks)
    landed = ChunkFile(file.store.landed(start, data), file.array_key, file.index, file.chunk_key,
                       file.expected_crc, file.codec)
    return dataclasses.replace(job, file=landed)


def _pack_runs(
    jobs: list[ReadJob | BoxesJob | CopiesJob], opened: list[_OpenPack],
) -> list[ReadJob | BoxesJob | CopiesJob | PackRunJob]:
    """``jobs``, those of packed chunks made ``PackRunJob`` s, each pack's in its order
    (a pack is open while its runs are read, not for the whole load); each pack a load
    reads is added to ``opened``."""
    out: list[ReadJob | BoxesJob | CopiesJob | PackRunJob] = []
    by_pack: dict[tuple[int, str], list[ReadJob | CopiesJob]] = {}
    for job in jobs:
        store = job.file.store
        if isinstance(store, PackedChunks) and not isinstance(job, BoxesJob):
            by_pack.setdefault((id(store.base), store.pack), []).append(job)
        else:
            out.append(job)
    for same in by_pack.values():
        stores = [job.file.store for job in same]
        spans = [store.span(job.file.rel) for store, job in zip(stores, same)]  # type: ignore[attr-defined]
        runs = pack_runs(spans)
        pack = _OpenPack(stores[0], len(runs))  # type: ignore[arg-type]
        opened.append(pack)
        out += [PackRunJob(pack, start, end, [same[i] for i in positions]) for start, end, positions in runs]
    return out


def _threads_of(jobs: list[tuple[ChunkFile, Any]]) -> int:
    return max((job[0].store.threads for job in jobs), default=DEFAULT_IO_THREADS)
