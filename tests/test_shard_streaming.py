"""A shard written and read whole costs what a chunk does: one pass over its bytes.

A chunk's save takes its crc32c and digest block by block as each block is written, and
its load takes the crc32c of each block as it lands, while the block is in the CPU's
cache. A shard (``format.sharding``: the read grain's cut chunks) does the same per
inner chunk: its save streams (``ShardingIndexed.encode_stream``), and ``read_inner``
folds each inner chunk's crc32c into the ranged read (``get_range_into_folded``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardstore.format.sharding as sharding
import shardstore.stores.local as local
from shardstore import CheckpointingException
from shardstore.format.sharding import ChunkRanges, ShardingIndexed, read_inner
from shardstore.stores.local import FileChunkStore

ROWS, COLS = 64, 256  # a shard of 64 KiB of float32, 8 inner chunks of 8 KiB
BLOCK = 2048


class _Chunk:
    def __init__(self, store: FileChunkStore) -> None:
        self.store, self.rel = store, "w/c.0"

    def describe(self) -> str:
        return f"chunk c.0 of array 'w' ({self.store.describe(self.rel)})"


def _codec_and_data() -> tuple[ShardingIndexed, np.ndarray]:
    values = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
    return ShardingIndexed((ROWS // 8, COLS), 4), values


def test_a_streamed_shard_is_the_encoded_one_folded_block_by_block() -> None:
    codec, values = _codec_and_data()
    data = memoryview(values.reshape(-1).view(np.uint8))
    folded: list[bytes] = []
    streamed = codec.encode_stream(data, lambda block: folded.append(bytes(block)), BLOCK)
    written = b"".join(bytes(p) for p in streamed.pieces)
    encoded = codec.encode(data)
    assert written == b"".join(bytes(p) for p in encoded.pieces)
    assert streamed.crc == encoded.crc
    assert b"".join(folded) == bytes(data)  # the digest sees the decoded bytes, in order
    assert max(len(block) for block in folded) <= BLOCK


def _crc_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the length of every buffer ``format.sharding`` takes a crc32c of."""
    sizes: list[int] = []
    real = sharding.crc32c.crc32c

    class Recording:
        @staticmethod
        def crc32c(data: memoryview | bytes, value: int = 0) -> int:
            sizes.append(len(data))
            return real(data, value)

    monkeypatch.setattr(sharding, "crc32c", Recording)
    return sizes


def _saved(tmp_path: Path) -> tuple[ShardingIndexed, np.ndarray, _Chunk, int]:
    codec, values = _codec_and_data()
    chunk = _Chunk(FileChunkStore(tmp_path))
    (tmp_path / "w").mkdir()
    encoded = codec.encode(memoryview(values.reshape(-1).view(np.uint8)))
    chunk.store.put(chunk.rel, list(encoded.pieces))
    return codec, values, chunk, encoded.crc


def test_a_shard_read_takes_each_inner_chunks_crc32c_block_by_block_as_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec, values, chunk, crc = _saved(tmp_path)
    monkeypatch.setattr(local, "READ_BLOCK_BYTES", BLOCK)
    sizes = _crc_sizes(monkeypatch)
    out = np.zeros_like(values)
    assert codec.read_into(chunk, [memoryview(out.reshape(-1).view(np.uint8))]) == crc
    assert np.array_equal(out, values)
    inner = values.nbytes // 8
    assert max(sizes) <= BLOCK < inner  # never a second pass over a whole inner chunk


def test_a_flipped_byte_in_a_block_read_names_its_inner_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    codec, values, chunk, _ = _saved(tmp_path)
    monkeypatch.setattr(local, "READ_BLOCK_BYTES", BLOCK)
    path = tmp_path / chunk.rel
    stored = bytearray(path.read_bytes())
    inner = values.nbytes // 8 + 4  # an inner chunk as stored: its bytes and their crc32c
    stored[3 * inner + BLOCK + 5] ^= 1  # in the second block of inner chunk 3
    path.write_bytes(bytes(stored))
    wanted = {i: memoryview(bytearray(inner - 4)) for i in range(2, 6)}
    with pytest.raises(CheckpointingException, match=r"chunk c\.0 of array 'w'.*inner chunk 3 crc32c mismatch"):
        read_inner(ChunkRanges(chunk), 8, wanted)


class _CountingFiles(FileChunkStore):
    """A ``FileChunkStore`` that records each read: whole objects, ranges, suffixes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    def get_into_folded(self, rel, views, tail, fold):  # type: ignore[no-untyped-def]
        self.reads.append("whole")
        return super().get_into_folded(rel, views, tail, fold)

    def get_range_into_folded(self, rel, offset, views, fold):  # type: ignore[no-untyped-def]
        self.reads.append("range")
        return super().get_range_into_folded(rel, offset, views, fold)

    def get_suffix(self, rel, nbytes):  # type: ignore[no-untyped-def]
        self.reads.append("suffix")
        return super().get_suffix(rel, nbytes)


def test_a_shard_read_whole_is_one_read_as_a_chunk_is(tmp_path: Path) -> None:
    codec, values, chunk, crc = _saved(tmp_path)
    chunk.store = _CountingFiles(tmp_path)
    out = np.zeros_like(values)
    assert codec.read_into(chunk, [memoryview(out.reshape(-1).view(np.uint8))]) == crc
    assert np.array_equal(out, values)
    assert chunk.store.reads == ["whole"]  # no index read first, no second request


@pytest.mark.parametrize("layout", ["a gap first", "inner chunks reversed"])
def test_a_shard_of_another_layout_read_whole_falls_back_to_its_index(tmp_path: Path, layout: str) -> None:
    """Zarr allows gaps between inner chunks and any order: the index says where each is."""
    codec, values = _codec_and_data()
    inner = [memoryview(part.reshape(-1).view(np.uint8)) for part in np.split(values, 8)]
    encoded = sharding.encode_shard(inner)
    stored = [(encoded.pieces[2 * k], encoded.pieces[2 * k + 1]) for k in range(8)]  # (bytes, trailer)
    gap = 16 if layout == "a gap first" else 0
    order = list(range(8)) if gap else list(reversed(range(8)))
    step = len(inner[0]) + 4
    entries = tuple((gap + order.index(k) * step, step) for k in range(8))
    pieces = [memoryview(bytes(gap)), *(p for k in order for p in stored[k]), encoded.pieces[-2],
              memoryview(sharding.ShardIndex(entries).encode())]
    index_crc = int.from_bytes(bytes(pieces[-1][-4:]), "little")
    store = _CountingFiles(tmp_path)
    (tmp_path / "w").mkdir()
    store.put("w/c.0", pieces)
    chunk = _Chunk(store)
    out = np.zeros_like(values)
    crc = codec.read_into(chunk, [memoryview(out.reshape(-1).view(np.uint8))])
    assert np.array_equal(out, values)
    assert crc == sharding._shard_crc((r.crc for r in encoded.inner), index_crc)
    assert store.reads[:2] == ["whole", "suffix"] and set(store.reads[2:]) == {"range"}


def test_a_run_of_whole_inner_chunks_lands_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2 -> 4 load of first-axis blocks asks for half a shard: its inner chunks are
    read straight into the target, not into a buffer copied out."""
    codec, values, chunk, crc = _saved(tmp_path)

    def copied(*_: object) -> None:
        raise AssertionError("copied out of a buffer")

    monkeypatch.setattr(sharding, "_box", copied)
    out = np.zeros((ROWS // 2, COLS), np.float32)
    assert codec.read_boxes_into(chunk, (ROWS, COLS), [((slice(ROWS // 2, ROWS), slice(0, COLS)), out)]) == crc
    assert np.array_equal(out, values[ROWS // 2 :])


class _ObjectStoreLike(_CountingFiles):
    """Counts reads as ``_CountingFiles``, priced as an object store: a request costs
    what 1 KiB does, and a read cannot tell a longer object."""

    request_bytes = 1024
    tells_longer = False


def test_a_shard_read_whole_is_one_request_on_an_object_store(tmp_path: Path) -> None:
    codec, values, chunk, crc = _saved(tmp_path)
    chunk.store = _ObjectStoreLike(tmp_path)
    out = np.zeros_like(values)
    assert codec.read_into(chunk, [memoryview(out.reshape(-1).view(np.uint8))]) == crc
    assert np.array_equal(out, values) and chunk.store.reads == ["whole"]
