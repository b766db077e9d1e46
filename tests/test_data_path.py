"""The local data path at the disk's floor: a chunk is hashed and written block by block
while in cache, large chunks start their write-back as they are written, reads go in
bounded blocks checksummed as they land, and none of it changes what is durable or
checked."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest

from shardstore.core import CheckpointingException
from shardstore.format.chunks import (
    ArrayChunks,
    chunk_digest,
    read_region,
    run_reads,
    run_writes,
    write_region,
)
from shardstore.format.codecs import BYTES_CRC32C
from shardstore.stores import local
from shardstore.stores.base import STREAM_BLOCK_BYTES, fold_landed
from shardstore.stores.local import FileChunkStore, start_writeback

# float32 chunks of 1 MiB (256 x 1024), of 256 KiB (64 x 1024), of 252 KiB (63 x 1024)
# and of 4 KiB (1 x 1024)
BIG, BOUND, UNDER, SMALL = (256, 1024), (64, 1024), (63, 1024), (1, 1024)


def _array(tmp_path, chunk_shape: tuple[int, int], rows: int = 512) -> tuple[ArrayChunks, np.ndarray]:
    value = np.random.default_rng(0).standard_normal((rows, 1024)).astype(np.float32)
    array = ArrayChunks("w", FileChunkStore(tmp_path), value.shape, chunk_shape, value.dtype)
    return array, value


def _write(array: ArrayChunks, value: np.ndarray) -> tuple[int, ...]:
    region = tuple(slice(0, n) for n in value.shape)
    written = run_writes(write_region(array, region, value))
    return tuple(c.crc for c in sorted(written, key=lambda c: c.index))


def test_chunk_files_of_256_kib_or_more_start_their_write_back(tmp_path, monkeypatch) -> None:
    assert local.EARLY_WRITEBACK_BYTES == 256 << 10
    started: list[int] = []
    monkeypatch.setattr(local, "start_writeback", lambda fd: started.append(os.fstat(fd).st_size))
    big, value = _array(tmp_path / "big", BIG)
    _write(big, value)
    at_bound, value = _array(tmp_path / "bound", BOUND, rows=64)
    _write(at_bound, value)
    under, value = _array(tmp_path / "under", UNDER, rows=63)
    _write(under, value)
    small, value = _array(tmp_path / "small", SMALL, rows=4)
    _write(small, value)
    # the two big chunks and the one at the bound (data + crc32c), none smaller
    assert sorted(started) == [2**18 + 4, 2**20 + 4, 2**20 + 4]


def test_start_writeback_returns_at_once_and_changes_no_byte(tmp_path) -> None:
    path = tmp_path / "f"
    data = os.urandom(3 * 2**20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, data)
        start_writeback(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_start_writeback_of_a_pipe_does_nothing(tmp_path) -> None:
    """A descriptor sync_file_range refuses as unsupported (ESPIPE) is left to syncfs."""
    read_end, write_end = os.pipe()
    try:
        start_writeback(write_end)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_failed_write_back_is_raised(monkeypatch) -> None:
    """An I/O error from the kernel is not taken for "unsupported"."""
    monkeypatch.setattr(local, "_sync_file_range", lambda *args: -1)
    monkeypatch.setattr(local.ctypes, "get_errno", lambda: local.errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        start_writeback(0)


def test_chunks_are_read_in_blocks_of_at_most_read_block_bytes(tmp_path, monkeypatch) -> None:
    array, value = _array(tmp_path, BIG)
    array.crcs = _write(array, value)
    sizes: list[int] = []
    real_preadv = os.preadv

    def counting_preadv(fd: int, views: list, offset: int) -> int:
        sizes.append(sum(len(v) for v in views))
        return real_preadv(fd, views, offset)

    monkeypatch.setattr(local, "READ_BLOCK_BYTES", 300_000)
    monkeypatch.setattr(local.os, "preadv", counting_preadv)
    out = np.empty_like(value)
    run_reads(read_region(array, tuple(slice(0, n) for n in value.shape), out), threads=1)
    assert np.array_equal(out.view(np.uint32), value.view(np.uint32))
    assert max(sizes) == 300_000 and sum(sizes) == value.nbytes  # the trailers come by pread


def test_a_byte_flipped_in_the_middle_of_a_block_read_chunk_is_refused(tmp_path, monkeypatch) -> None:
    array, value = _array(tmp_path, BIG)
    array.crcs = _write(array, value)
    path = tmp_path / "w" / "c.1.0"
    raw = bytearray(path.read_bytes())
    raw[700_001] ^= 1
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(local, "READ_BLOCK_BYTES", 300_000)
    with pytest.raises(CheckpointingException, match="crc32c mismatch"):
        run_reads(read_region(array, tuple(slice(0, n) for n in value.shape), np.empty_like(value)))


@pytest.mark.parametrize("limit", [1, 5, 6, 7, 100])
def test_head_cuts_the_views_after_the_limit(limit: int) -> None:
    views = [memoryview(bytearray(n)) for n in (3, 3, 4)]
    head = local._head(views, limit)
    assert sum(len(v) for v in head) == min(limit, 10)
    assert [len(v) for v in head[:-1]] == [len(v) for v in views[: len(head) - 1]]  # whole views before the cut
    assert len(views[0]) == 3  # the caller's list is not cut


def test_head_takes_at_most_iov_max_views() -> None:
    views = [memoryview(bytearray(1)) for _ in range(local.IOV_MAX + 5)]
    assert len(local._head(views, 2**30)) == local.IOV_MAX


def test_a_folded_read_hands_over_every_byte_in_order_block_by_block(tmp_path, monkeypatch) -> None:
    data = os.urandom(2**20 + 4)
    (tmp_path / "c").write_bytes(data)
    monkeypatch.setattr(local, "READ_BLOCK_BYTES", 300_000)
    views = [memoryview(bytearray(700_000)), memoryview(bytearray(2**20 - 700_000))]
    blocks: list[bytes] = []
    got = FileChunkStore(tmp_path).get_into_folded("c", views, 5, lambda b: blocks.append(bytes(b)))
    assert got == (2**20, data[2**20:])
    assert b"".join(blocks) == data[: 2**20] == b"".join(bytes(v) for v in views)
    assert max(map(len, blocks)) <= 300_000


def test_fold_landed_stops_where_the_bytes_stop() -> None:
    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"hi")]
    blocks: list[bytes] = []
    fold_landed(views, 5, lambda b: blocks.append(bytes(b)))
    assert blocks == [b"abc", b"de"]


@pytest.mark.parametrize("nbytes", [0, 5, STREAM_BLOCK_BYTES, 2 * STREAM_BLOCK_BYTES + 3])
def test_a_streamed_chunk_is_its_encoded_chunk(nbytes: int) -> None:
    data = memoryview(os.urandom(nbytes))
    folded: list[bytes] = []
    streamed = BYTES_CRC32C.encode_stream(data, lambda b: folded.append(bytes(b)), STREAM_BLOCK_BYTES)
    assert streamed.crc is None  # nothing taken yet
    pieces = [bytes(p) for p in streamed.pieces]
    encoded = BYTES_CRC32C.encode(data)
    assert b"".join(pieces) == b"".join(bytes(p) for p in encoded.pieces)
    assert streamed.crc == encoded.crc == crc32c.crc32c(data)
    assert b"".join(folded) == bytes(data) and all(len(b) <= STREAM_BLOCK_BYTES for b in folded)


def test_a_written_chunk_reports_the_digest_and_crc32c_of_its_bytes(tmp_path) -> None:
    array, value = _array(tmp_path, BIG)
    written = run_writes(write_region(array, (slice(0, 512), slice(0, 1024)), value))
    for chunk in written:
        data = memoryview(value[chunk.index[0] * 256 : (chunk.index[0] + 1) * 256].reshape(-1).view(np.uint8))
        assert (chunk.crc, chunk.digest) == (crc32c.crc32c(data), chunk_digest(data))


def test_a_chunk_file_is_written_block_by_block_as_the_blocks_are_made(tmp_path) -> None:
    path, block = tmp_path / "c", memoryview(bytes(STREAM_BLOCK_BYTES))
    sizes: list[int] = []

    def pieces():
        for _ in range(3):
            sizes.append(path.stat().st_size)
            yield block

    FileChunkStore(tmp_path).put("c", pieces())
    assert sizes == [0, STREAM_BLOCK_BYTES, 2 * STREAM_BLOCK_BYTES]
    assert path.stat().st_size == 3 * STREAM_BLOCK_BYTES


def test_the_directory_guard_resolves_links_at_any_depth(tmp_path: Path) -> None:
    """The guard lstat()s one component per directory; a link anywhere on the way is
    still resolved in full and refused where it leads outside (one inside is allowed)."""
    from shardstore.stores.base import StorageError
    from shardstore.stores.local import DirectoryGuard

    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    (root / "model" / "layer" / "w").mkdir(parents=True)
    (outside / "layer" / "w").mkdir(parents=True)
    (root / "elsewhere").symlink_to(outside)
    (root / "alias").symlink_to(root / "model")
    guard = DirectoryGuard(root)
    guard.check("model/layer/w")
    guard.check("alias/layer/w")  # a link that stays inside
    with pytest.raises(StorageError, match="symbolic link"):
        guard.check("elsewhere/layer/w")
    with pytest.raises(StorageError, match="symbolic link"):
        guard.check("model/../elsewhere/layer")
