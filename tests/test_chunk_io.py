"""The direct chunk path writes exactly what TensorStore writes and reads it back right."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorstore as ts

from shardstore.core import CheckpointingException
from shardstore.engine.zarr_strategies import array_spec, tensorstore_context
from shardstore.format import chunks as chunk_io
from shardstore.format.chunks import (
    ArrayChunks,
    read_region,
    run_reads,
    run_writes,
    write_region,
)
from shardstore.format.dtypes import from_zarr_name
from shardstore.format.records import ArrayRecord
from shardstore.planning.layout import region_at
from shardstore.stores.local import FileChunkStore
from shardstore.stores.locations import open_location

# shape (10, 7) in chunks of (4, 7): the last chunk row is an edge chunk, padded on disk
RECORD = ArrayRecord("w", (10, 7), "bfloat16", (4, 7))


def _value() -> np.ndarray:
    dtype = from_zarr_name(RECORD.dtype).numpy_dtype
    return np.arange(70, dtype=np.float32).reshape(10, 7).astype(dtype)


def _chunks(tmp_path, name: str) -> ArrayChunks:
    return ArrayChunks("w", FileChunkStore(tmp_path / name), RECORD.shape, RECORD.chunk_shape,
                       from_zarr_name(RECORD.dtype).numpy_dtype)


def test_direct_chunks_are_byte_identical_to_tensorstore(tmp_path) -> None:
    value = _value()
    run_writes(write_region(_chunks(tmp_path, "ours"), region_at((0, 0), (10, 7)), value))
    theirs = open_location(tmp_path / "theirs")
    spec = array_spec(theirs, RECORD, for_write=True)
    store = ts.open(spec, create=True, context=tensorstore_context(theirs)).result()
    store.write(value).result()
    for index in [(0, 0), (1, 0), (2, 0)]:
        ours = (tmp_path / "ours" / "w" / RECORD.chunk_key(index)).read_bytes()
        assert ours == (tmp_path / "theirs" / "w" / RECORD.chunk_key(index)).read_bytes(), index


@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("region", [((0, 10), (0, 7)), ((3, 9), (2, 5)), ((4, 8), (0, 7)), ((9, 10), (6, 7))])
def test_read_any_region(tmp_path, monkeypatch, region, scatter) -> None:
    if scatter:  # strided whole chunks read by readv into the rows of the destination
        monkeypatch.setattr(chunk_io, "MIN_SCATTER_RUN", 1)
    value = _value()
    chunks = _chunks(tmp_path, "a")
    run_writes(write_region(chunks, region_at((0, 0), (10, 7)), value))
    sl = tuple(slice(a, b) for a, b in region)
    out = np.empty(value[sl].shape, value.dtype)
    run_reads(read_region(chunks, sl, out))
    assert out.view(np.uint16).tolist() == value[sl].view(np.uint16).tolist()


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "delete"])
def test_damaged_chunk_is_named(tmp_path, damage) -> None:
    chunks = _chunks(tmp_path, "a")
    run_writes(write_region(chunks, region_at((0, 0), (10, 7)), _value()))
    path = tmp_path / "a" / "w" / "c.1.0"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[5] ^= 0x01
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[:-3])
    elif damage == "extend":
        path.write_bytes(data + b"\0")
    else:
        path.unlink()
    out = np.empty((10, 7), _value().dtype)
    with pytest.raises(CheckpointingException, match=r"chunk c\.1\.0 of array 'w'"):
        run_reads(read_region(chunks, region_at((0, 0), (10, 7)), out))


def test_scatter_read_of_column_chunks(tmp_path) -> None:
    """Chunks split along the last axis land in strided rows of a full-width result."""
    dtype = from_zarr_name("float32").numpy_dtype
    value = np.random.default_rng(0).standard_normal((8, 4096)).astype(dtype)
    chunks = ArrayChunks("x", FileChunkStore(tmp_path), (8, 4096), (8, 2048), dtype)
    run_writes(write_region(chunks, region_at((0, 0), (8, 4096)), value))
    jobs = read_region(chunks, region_at((0, 0), (8, 4096)), out := np.empty_like(value))
    assert all(not j.direct and chunk_io._contiguous_runs(out[j.piece.in_region], out) for j in jobs)
    run_reads(jobs)
    assert np.array_equal(out, value)


def test_scatter_read_of_many_rows_costs_about_a_plain_read(tmp_path) -> None:
    """16,384 strided rows per chunk (a realistic row count): the scatter read stays
    within a small factor of reading the chunk into a buffer and copying it (it was
    quadratic in rows: 8-10x)."""
    import time

    dtype = from_zarr_name("float32").numpy_dtype
    value = np.random.default_rng(0).standard_normal((16384, 2048)).astype(dtype)  # 4 KiB runs: scatter path
    chunks = ArrayChunks("x", FileChunkStore(tmp_path), (16384, 2048), (16384, 1024), dtype)
    run_writes(write_region(chunks, region_at((0, 0), (16384, 2048)), value))
    scatter, plain = [], []
    for _ in range(5):
        out = np.empty_like(value)
        jobs = read_region(chunks, region_at((0, 0), (16384, 2048)), out)
        assert all(chunk_io._contiguous_runs(out[j.piece.in_region], out) for j in jobs)
        start = time.perf_counter()
        run_reads(jobs, 1)
        scatter.append(time.perf_counter() - start)
        assert np.array_equal(out, value)
        buffer = np.empty((16384, 1024), dtype)
        start = time.perf_counter()
        for j in (0, 1):
            chunks.file((0, j)).read_into(buffer)
            out[:, j * 1024 : (j + 1) * 1024] = buffer
        plain.append(time.perf_counter() - start)
    # the fastest of five runs of each: this machine's noise only ever adds time
    assert min(scatter) < 4 * min(plain) + 0.02, (scatter, plain)


@pytest.mark.parametrize("path", ["direct", "partial chunk", "short strided runs"])
def test_every_read_path_costs_about_a_plain_read_at_16384_rows(tmp_path, path: str) -> None:
    """The other local read paths at a realistic row count: a whole chunk into a
    contiguous destination (read straight into it), part of a chunk (read into a
    one-chunk buffer, then copied), and whole chunks whose rows land as runs too short
    for a scatter read (buffer and copy). Each stays within a small factor of reading
    the chunk files into a buffer and copying what is needed with numpy."""
    import time

    rows, dtype = 16384, from_zarr_name("float32").numpy_dtype
    cols = 2048
    chunk, (r0, r1), (c0, c1) = {
        "direct": ((rows, cols), (0, rows), (0, cols)),
        "partial chunk": ((rows, cols), (100, rows - 100), (7, 1200)),
        "short strided runs": ((rows, 128), (0, rows), (0, cols)),  # 512-byte runs per row and chunk
    }[path]
    value = np.random.default_rng(0).standard_normal((rows, cols)).astype(dtype)
    chunks = ArrayChunks("x", FileChunkStore(tmp_path), (rows, cols), chunk, dtype)
    run_writes(write_region(chunks, region_at((0, 0), (rows, cols)), value))
    region = region_at((r0, c0), (r1 - r0, c1 - c0))
    ours, plain = [], []
    for _ in range(5):
        out = np.empty((r1 - r0, c1 - c0), dtype)
        jobs = read_region(chunks, region, out)
        kinds = {
            "direct" if j.direct else "partial chunk" if not j.piece.whole
            else "short strided runs" if chunk_io._contiguous_runs(out[j.piece.in_region], out) is None
            else "scatter"
            for j in jobs
        }
        assert kinds == {path}, kinds
        start = time.perf_counter()
        run_reads(jobs, 1)
        ours.append(time.perf_counter() - start)
        assert np.array_equal(out, value[r0:r1, c0:c1])
        buffer = np.empty(chunk, dtype)
        start = time.perf_counter()
        for j in range(cols // chunk[1]):
            chunks.file((0, j)).read_into(buffer)
            lo, hi = max(c0, j * chunk[1]), min(c1, (j + 1) * chunk[1])
            out[:, lo - c0 : hi - c0] = buffer[r0:r1, lo - j * chunk[1] : hi - j * chunk[1]]
        plain.append(time.perf_counter() - start)
    # the fastest of five runs of each: this machine's noise only ever adds time
    assert min(ours) < 4 * min(plain) + 0.02, (ours, plain)


def test_more_pieces_than_one_writev_takes_are_written_and_read_in_order(tmp_path) -> None:
    """3,000 views (a shard of many inner chunks, each with its trailer) are more than
    IOV_MAX (1,024): the write and both reads split them over several calls."""
    from shardstore.stores.local import IOV_MAX

    pieces = [bytes([i % 256]) * (1 + i % 7) for i in range(3000)]
    assert len(pieces) > IOV_MAX
    store = FileChunkStore(tmp_path)
    store.put("w/c.0", [memoryview(p) for p in pieces])
    assert (tmp_path / "w" / "c.0").read_bytes() == b"".join(pieces)
    into = [memoryview(bytearray(len(p))) for p in pieces]
    assert store.get_into("w/c.0", into, 4) == (sum(map(len, pieces)), b"")
    assert [bytes(v) for v in into] == pieces
    ranged = [memoryview(bytearray(len(p))) for p in pieces[1:]]
    store.get_range_into("w/c.0", len(pieces[0]), ranged)
    assert [bytes(v) for v in ranged] == pieces[1:]


def test_a_short_writev_is_resumed_where_it_stopped(tmp_path, monkeypatch) -> None:
    """writev may write fewer bytes than asked (a signal, a full pipe of a network file
    system): the rest follows, in order."""
    real = os.writev
    calls = []

    def short(fd, buffers):
        calls.append(len(buffers))
        return real(fd, [memoryview(buffers[0])[: max(1, len(buffers[0]) // 2)]])

    monkeypatch.setattr(os, "writev", short)
    pieces = [bytes([i]) * 10 for i in range(5)]
    FileChunkStore(tmp_path).put("c", [memoryview(p) for p in pieces])
    monkeypatch.undo()
    assert (tmp_path / "c").read_bytes() == b"".join(pieces) and len(calls) > len(pieces)


def test_a_region_of_one_whole_chunk_is_written_from_the_callers_memory(tmp_path) -> None:
    """A whole chunk goes out as the caller's array itself; a chunk at the array's edge
    is padded to the chunk shape, as Zarr stores it."""
    record = ArrayRecord("w", (5, 3), "float32", (2, 3))
    array = chunk_io.ArrayChunks.of(FileChunkStore(tmp_path), record)
    whole = np.arange(6, dtype=np.float32).reshape(2, 3)
    ((file, data),) = chunk_io.write_region(array, region_at((2, 0), (2, 3)), whole)
    assert file.index == (1, 0) and data is whole
    edge = np.ones((1, 3), dtype=np.float32)
    ((file, data),) = chunk_io.write_region(array, region_at((4, 0), (1, 3)), edge)
    assert file.index == (2, 0) and data.shape == (2, 3) and data[1].tolist() == [0, 0, 0]


def test_one_whole_chunk_shortcut_reads_as_the_general_walk(tmp_path) -> None:
    """``read_region``'s job for a region that is one whole chunk is the job the general
    walk (``chunk_pieces``) makes, its checksum looked up at the same place in the
    record's C order as ``np.ravel_multi_index`` gives; edge chunks and strided targets
    take the walk."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        ndim = int(rng.integers(0, 4))
        chunk = tuple(int(c) for c in rng.integers(1, 4, ndim))
        shape = tuple(int(c * g - rng.integers(0, c)) for c, g in zip(chunk, rng.integers(1, 4, ndim)))
        grid = tuple(-(-n // c) for n, c in zip(shape, chunk))
        crcs = tuple(range(int(np.prod(grid, dtype=np.int64))))
        array = ArrayChunks("k", None, shape, chunk, np.dtype("float32"), crcs)  # type: ignore[arg-type]
        index = tuple(int(rng.integers(0, g)) for g in grid)
        region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunk, shape))
        extent = tuple(s.stop - s.start for s in region)
        out = np.empty(extent, np.float32)
        if ndim and rng.random() < 0.3:  # a strided target: every other row of a larger one
            out = np.empty((2 * extent[0], *extent[1:]), np.float32)[::2]
        (job,) = read_region(array, region, out)
        (piece,) = chunk_io.chunk_pieces(region, shape, chunk)
        direct = piece.whole and out[piece.in_region].flags.c_contiguous
        assert (job.piece, job.direct) == (piece, direct), (shape, chunk, region, out.strides)
        assert job.file.expected_crc == (int(np.ravel_multi_index(index, grid)) if grid else 0)
