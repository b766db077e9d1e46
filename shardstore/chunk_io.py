"""Whole-chunk I/O on local files: the fast path for shardstore's own chunk encoding.

Every shardstore array stores each chunk as its raw little-endian bytes followed by a
crc32c of them (Zarr v3 codecs ``bytes`` + ``crc32c``), one file per chunk at
``<key>/c/<i>/<j>...``. For that encoding a chunk can move between a file and a
tensor's memory without a decode step:

- write: ``writev(fd, [tensor slab, crc])``, straight from the caller's memory when the
  chunk's slab is contiguous (a copy of one chunk otherwise);
- read: ``readinto`` the destination's slab when the chunk lies inside the requested
  region and its slab is contiguous, else into a one-chunk buffer that is then copied;
  the crc32c is checked either way.

Measured on this machine (512 MiB of float32, page cache dropped before loads): a
TensorStore read of the same arrays took 0.67 s, this path 0.30 s, because TensorStore
decodes each chunk into a new buffer and then copies it into the result. Writes
through TensorStore were within noise of this path but cost a TensorStore open per
array (about 0.3 ms), which dominates for thousands of small tensors. Threads do the
I/O; ``os.readv``/``os.writev`` and ``crc32c`` release the GIL.

TensorStore stays the engine for everything else: object storage, reads of stores
written by other tools, and the seed's single-array API. Chunks here are bit-identical
to TensorStore's (a test checks it), so readers cannot tell the difference.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

from shardstore.core import CheckpointingException
from shardstore.layout import Region
from shardstore.storage import run_parallel

CRC_BYTES = 4
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# A strided destination is filled by a scatter read when its contiguous runs are at
# least this long; shorter runs go through a one-chunk buffer and a copy.
MIN_SCATTER_RUN = 4096
# Threads doing chunk I/O per rank; more did not help on local disks.
DEFAULT_IO_THREADS = 8

# The fast path writes native byte order as the ``little`` the metadata promises.
NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"


def chunk_key(index: tuple[int, ...]) -> str:
    """Zarr v3 default chunk key encoding: ``c/1/0`` (``c`` for a 0-d array)."""
    return "/".join(["c", *map(str, index)])


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


class ChunkFile:
    """Reads and writes one encoded chunk file."""

    def __init__(self, path: Path, array_key: str, index: tuple[int, ...]) -> None:
        self.path, self.array_key, self.index = path, array_key, index

    def describe(self) -> str:
        return f"chunk {chunk_key(self.index)} of array {self.array_key!r} ({self.path})"

    def write(self, data: np.ndarray) -> None:
        """Writes a C-contiguous chunk with its crc32c.

        No fsync here: the location's ``make_durable`` (one ``syncfs`` per rank) flushes
        every chunk before the commit. An fsync per large chunk from the writer threads
        was measured slower: with the ranks holding 4 GiB each besides the state (as
        trainers do), 2 GiB at 2 ranks took 2.1-2.4 s against 1.4-1.7 s with the one
        ``syncfs``, and 1.3-1.4 s for the plain-file bound."""
        view = _bytes_view(data)
        crc = crc32c.crc32c(view).to_bytes(CRC_BYTES, "little")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:  # first chunk of its directory
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, flags, 0o644)
        try:
            buffers: list = [view, crc]
            while buffers:
                written = os.writev(fd, buffers)
                buffers = _advance(buffers, written)
        finally:
            os.close(fd)

    def read_into(self, out: np.ndarray) -> None:
        """Fills a C-contiguous ``out`` with the chunk; checks length and crc32c."""
        self.read_into_views([_bytes_view(out)])

    def read_into_views(self, views: list[memoryview]) -> None:
        """Fills ``views`` in order with the chunk (a scatter read: the rows of a
        strided destination need no bounce buffer); checks length and crc32c."""
        try:
            f = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointingException(f"Missing {self.describe()}: the checkpoint is damaged") from None
        expected = sum(len(v) for v in views)
        got = 0
        with f:
            pending = views
            while pending and (n := os.readv(f.fileno(), pending[:IOV_MAX])):
                got += n
                pending = _advance(pending, n)
            crc = f.read(CRC_BYTES + 1)  # one byte more than expected detects a too-long file
        if got != expected or len(crc) != CRC_BYTES:
            raise CheckpointingException(
                f"Corrupt {self.describe()}: {got + len(crc)} bytes, expected {expected + CRC_BYTES} "
                "(truncated or overwritten)"
            )
        value = 0
        for v in views:
            value = crc32c.crc32c(v, value)
        if value != int.from_bytes(crc, "little"):
            raise CheckpointingException(f"Corrupt {self.describe()}: crc32c mismatch")


def _advance(buffers: list, n: int) -> list:
    """The part of ``buffers`` left after ``n`` bytes were written."""
    while buffers and n >= len(buffers[0]):
        n -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and n:
        buffers = [memoryview(buffers[0])[n:], *buffers[1:]]
    return buffers


@dataclass
class ArrayChunks:
    """Where one array's chunks live and how they are shaped."""

    key: str
    root: Path
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype

    def file(self, index: tuple[int, ...]) -> ChunkFile:
        return ChunkFile(self.root / chunk_key(index), self.key, index)


def write_region(array: ArrayChunks, region: Region, value: np.ndarray) -> list[tuple[ChunkFile, np.ndarray]]:
    """The chunk files and contiguous data that store ``value`` at ``region``.

    ``region`` must be chunk-aligned (one writer per chunk); edge chunks are padded with
    zeros (the fill value) to the full chunk shape, as Zarr stores them.
    """
    jobs = []
    for piece in chunk_pieces(region, array.shape, array.chunk_shape):
        slab = value[piece.in_region]
        if not piece.whole:
            full = np.zeros(array.chunk_shape, dtype=value.dtype)
            full[piece.in_chunk] = slab
            slab = full
        elif not slab.flags.c_contiguous:
            slab = np.ascontiguousarray(slab)
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

    def run(self) -> None:
        target = self.out[self.piece.in_region]
        runs = None if self.direct or not self.piece.whole else _contiguous_runs(target, self.out.shape)
        buffer = target if self.direct or runs else np.empty(self.chunk_shape, self.out.dtype)
        try:
            if runs:
                self.file.read_into_views(runs)
            else:
                self.file.read_into(buffer)
        except OSError as exc:
            raise CheckpointingException(f"Reading {self.file.describe()} failed: {exc}") from exc
        if buffer is not target:
            target[...] = buffer[self.piece.in_chunk]


def _contiguous_runs(target: np.ndarray, whole_shape: tuple[int, ...]) -> list[memoryview] | None:
    """``target`` (a strided view into a C-contiguous array of ``whole_shape``) as its
    contiguous runs in order, or None when they are too short to be worth it."""
    partial = [a for a, (t, w) in enumerate(zip(target.shape, whole_shape)) if t != w]
    if not partial:
        return [_bytes_view(target)]
    lead = target.shape[: partial[-1]]  # every axis after the last partial one is whole
    if target.nbytes // max(1, int(np.prod(lead))) < MIN_SCATTER_RUN:
        return None
    return [_bytes_view(target[index]) for index in np.ndindex(*lead)]


def read_region(array: ArrayChunks, region: Region, out: np.ndarray) -> list[ReadJob]:
    """Jobs that fill ``out`` (shaped like ``region``) from the array's chunks."""
    return [
        ReadJob(
            array.file(piece.index), out, piece, array.chunk_shape,
            direct=piece.whole and out[piece.in_region].flags.c_contiguous,
        )
        for piece in chunk_pieces(region, array.shape, array.chunk_shape)
    ]


def run_writes(jobs: list[tuple[ChunkFile, np.ndarray]], threads: int = DEFAULT_IO_THREADS) -> None:
    run_parallel(lambda job: _write_job(*job), jobs, threads)


def _write_job(file: ChunkFile, data: np.ndarray) -> None:
    try:
        file.write(data)
    except OSError as exc:
        raise CheckpointingException(f"Writing {file.describe()} failed: {exc}") from exc


def run_reads(jobs: list[ReadJob], threads: int = DEFAULT_IO_THREADS) -> None:
    run_parallel(ReadJob.run, jobs, threads)
