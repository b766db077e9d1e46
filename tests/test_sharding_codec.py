"""Zarr v3 ``sharding_indexed`` as a chunk codec (issue 44.1): shards encoded from the
inner chunks' views open as they are in zarr-python and TensorStore; every inner chunk's
crc32c and the index's are checked; a partial read reads only the index and the inner
chunks it needs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np
import pytest
import tensorstore as ts
import torch
import xxhash
import zarr

from shardstore import CheckpointingException
from shardstore.format.codecs import BYTES_CRC32C, CODECS, CRC_BYTES, codec_for
from shardstore.format.records import ArrayRecord
from shardstore.format.sharding import (
    EMPTY,
    ChunkRanges,
    ShardIndex,
    ShardingIndexed,
    encode_shard,
    read_inner,
)
from shardstore.stores.base import ChunkMismatch, Fold, fold_landed
from shardstore.stores.local import FileChunkStore

LITTLE = {"name": "bytes", "configuration": {"endian": "little"}}
CRC = {"name": "crc32c"}
SHARDING = {"name": "sharding_indexed", "configuration": {
    "chunk_shape": [2, 6], "codecs": [LITTLE, CRC], "index_codecs": [LITTLE, CRC], "index_location": "end"}}
INNER = (2, 6)  # an inner chunk: a rank's slice of two rows
SHARD = (8, 6)  # a shard: four inner chunks
SHAPE = (16, 6)  # two shards


@dataclass
class FileRanges:
    """A ``ByteRanges`` over a local file that counts what it reads."""

    path: Path
    key: str = "c.0.0"
    requests: list[tuple[int, int]] = field(default_factory=list)

    def describe(self) -> str:
        return f"shard {self.key} of array 'w' ({self.path})"

    def read_suffix(self, n: int) -> tuple[bytes, int] | None:
        if not self.path.exists():
            return None
        size = self.path.stat().st_size
        data = self.path.read_bytes()[max(0, size - n):]
        self.requests.append((size - len(data), len(data)))
        return data, size

    def read_range_into(self, offset: int, views: list[memoryview], fold: Fold) -> int:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, views, offset)
        finally:
            os.close(fd)
        fold_landed(views, got, fold)
        self.requests.append((offset, got))
        return got

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.requests)


def _inner_views(shard: np.ndarray) -> list[memoryview]:
    """The inner chunks of a shard split along its first axis (each contiguous)."""
    return [memoryview(shard[at : at + INNER[0]].reshape(-1).view(np.uint8)) for at in range(0, SHARD[0], INNER[0])]


def _write_array(root: Path, values: np.ndarray, dtype: str, empty: set[tuple[int, int]] = frozenset()) -> list:
    """``values`` as a sharded Zarr v3 array at ``root`` (inner chunks ``empty``, as
    (shard, inner) pairs, left out); returns each shard's ``EncodedShard``."""
    codec = ShardingIndexed(INNER, values.dtype.itemsize)
    record = ArrayRecord("w", SHAPE, dtype, SHARD, codec=codec)
    root.mkdir(parents=True)
    (root / "zarr.json").write_text(json.dumps(record.zarr_metadata()))
    encoded = []
    for s in range(SHAPE[0] // SHARD[0]):
        views = _inner_views(values[s * SHARD[0] : (s + 1) * SHARD[0]])
        shard = encode_shard([None if (s, i) in empty else v for i, v in enumerate(views)])
        FileChunkStore(root).put(f"c.{s}.0", list(shard.pieces))
        encoded.append(shard)
    return encoded


def _read_plain(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """The array as zarr-python and TensorStore read it."""
    by_zarr = zarr.open_array(str(root), mode="r")[...]
    by_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root)}}).result().read().result()
    return np.asarray(by_zarr), np.asarray(by_ts)


def test_the_zarr_metadata_round_trips_through_the_registry() -> None:
    codec = ShardingIndexed(INNER, 4)
    assert codec.zarr_codecs(4) == [SHARDING]
    assert CODECS["sharding_indexed"] is ShardingIndexed
    assert codec_for([SHARDING], 4, "ckpt", "w") == codec
    assert codec_for([LITTLE, CRC], 4, "ckpt", "w") == BYTES_CRC32C
    default_end = {"name": "sharding_indexed", "configuration": {
        k: v for k, v in SHARDING["configuration"].items() if k != "index_location"}}
    assert ShardingIndexed.recognize([default_end], 4) == codec


@pytest.mark.parametrize("change", [
    {"index_location": "start"},
    {"codecs": [LITTLE, {"name": "zstd"}, CRC]},
    {"index_codecs": [LITTLE]},
    {"chunk_shape": [0, 6]},
    {"chunk_shape": "2,6"},
    {"other": 1},
])
def test_other_sharding_configurations_are_not_recognized(change: dict) -> None:
    config = {**SHARDING["configuration"], **change}
    assert ShardingIndexed.recognize([{"name": "sharding_indexed", "configuration": config}], 4) is None
    assert ShardingIndexed.recognize([LITTLE, CRC], 4) is None


def test_the_shard_is_the_inner_chunks_views_their_crc32c_and_the_index() -> None:
    values = np.arange(48, dtype=np.float32).reshape(SHARD)
    views = _inner_views(values)
    shard = encode_shard([views[0], None, views[2], views[3]])
    assert all(shard.pieces[2 * k] is v for k, v in enumerate([views[0], views[2], views[3]]))  # no copy
    stored = b"".join(shard.pieces)
    index = np.frombuffer(stored[-ShardIndex.nbytes(4) : -CRC_BYTES], "<u8").reshape(4, 2).tolist()
    size = 48 + CRC_BYTES
    assert index == [[0, size], [EMPTY, EMPTY], [size, size], [2 * size, size]]
    assert shard.inner[1] is None
    assert shard.inner[2].crc == crc32c.crc32c(views[2]) and shard.inner[2].digest == xxhash.xxh3_128_hexdigest(views[2])
    trailers = b"".join(r.crc.to_bytes(4, "little") for r in shard.inner if r) + shard.index_crc.to_bytes(4, "little")
    assert shard.crc == crc32c.crc32c(trailers)


def test_zarr_python_and_tensorstore_read_a_float32_sharded_array_bit_for_bit(tmp_path: Path) -> None:
    values = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    _write_array(tmp_path / "w", values, "float32")
    by_zarr, by_ts = _read_plain(tmp_path / "w")
    assert by_zarr.tobytes() == values.tobytes() and by_ts.tobytes() == values.tobytes()


def test_zarr_python_and_tensorstore_read_a_bfloat16_sharded_array_bit_for_bit(tmp_path: Path) -> None:
    tensor = torch.randn(SHAPE, dtype=torch.bfloat16)
    bits = tensor.view(torch.int16).numpy()
    _write_array(tmp_path / "w", bits, "bfloat16")
    by_zarr, by_ts = _read_plain(tmp_path / "w")
    assert str(by_zarr.dtype) == "bfloat16" and str(by_ts.dtype) == "bfloat16"
    assert by_zarr.tobytes() == bits.tobytes() and by_ts.tobytes() == bits.tobytes()


def test_empty_inner_chunks_read_as_zeros_by_zarr_readers_and_where_shardstore_is_told_so(tmp_path: Path) -> None:
    """Zarr readers read an empty inner chunk as the fill value; shardstore, which never
    writes one, reads it so only where the caller names it empty (its loads never do:
    ``tests/test_empty_inner_chunks.py``)."""
    values = np.arange(96, dtype=np.float32).reshape(SHAPE) + 1
    _write_array(tmp_path / "w", values, "float32", empty={(0, 1), (1, 3)})
    expected = values.copy()
    expected[2:4] = 0
    expected[14:16] = 0
    by_zarr, by_ts = _read_plain(tmp_path / "w")
    assert np.array_equal(by_zarr, expected) and np.array_equal(by_ts, expected)
    out = np.full(SHARD, 7, np.float32)
    shard = read_inner(FileRanges(tmp_path / "w" / "c.0.0"), 4, dict(enumerate(_inner_views(out))), frozenset({1}))
    stored = [expected[:8][2 * i : 2 * i + 2].tobytes() for i in (0, 2, 3)]  # inner chunk 1 is empty
    index = (tmp_path / "w" / "c.0.0").read_bytes()[-4:]
    assert shard == crc32c.crc32c(b"".join(crc32c.crc32c(b).to_bytes(4, "little") for b in stored) + index)
    assert np.array_equal(out, expected[:8])


def test_a_partial_read_reads_only_the_index_and_the_inner_chunks_it_needs(tmp_path: Path) -> None:
    values = np.arange(96, dtype=np.float32).reshape(SHAPE)
    _write_array(tmp_path / "w", values, "float32")
    source = FileRanges(tmp_path / "w" / "c.1.0")
    out = np.zeros((3, *INNER), np.float32)
    wanted = {1: memoryview(out[0].reshape(-1).view(np.uint8)), 2: memoryview(out[1].reshape(-1).view(np.uint8))}
    shard = read_inner(source, 4, wanted)
    assert np.array_equal(out[0], values[10:12]) and np.array_equal(out[1], values[12:14])
    inner = 48 + CRC_BYTES
    # the crc table and the index (one suffix), then inner chunks 1 and 2 as one range: nothing else
    assert source.requests == [(4 * inner, ShardIndex.suffix_nbytes(4)), (inner, 2 * inner)]
    assert source.bytes_read == 2 * inner + ShardIndex.suffix_nbytes(4) < (tmp_path / "w" / "c.1.0").stat().st_size
    assert shard == encode_shard(_inner_views(values[8:16])).crc  # binds the inner chunks not read too
    source.requests.clear()
    read_inner(source, 4, {0: wanted[1], 3: wanted[2]})  # not adjacent: two ranges
    assert [n for _, n in source.requests] == [ShardIndex.suffix_nbytes(4), inner, inner]


@pytest.mark.parametrize(("where", "message"), [
    (5, r"shard c\.0\.0 of array 'w' .*inner chunk 0 crc32c mismatch"),
    (2 * 52 + 7, r"shard c\.0\.0 of array 'w' .*inner chunk 2 crc32c mismatch"),
    (-10, r"shard c\.0\.0 of array 'w' .*shard index crc32c mismatch"),
    (-2, r"shard c\.0\.0 of array 'w' .*shard index crc32c mismatch"),
])
def test_a_flipped_byte_is_detected_naming_the_shard_and_the_inner_chunk(
        tmp_path: Path, where: int, message: str) -> None:
    values = np.arange(96, dtype=np.float32).reshape(SHAPE)
    _write_array(tmp_path / "w", values, "float32")
    path = tmp_path / "w" / "c.0.0"
    stored = bytearray(path.read_bytes())
    stored[where] ^= 0x10
    path.write_bytes(bytes(stored))
    out = np.zeros(SHARD, np.float32)
    with pytest.raises(CheckpointingException, match=message):
        read_inner(FileRanges(path), 4, dict(enumerate(_inner_views(out))))


def test_an_index_entry_past_the_inner_chunks_is_refused(tmp_path: Path) -> None:
    values = np.arange(96, dtype=np.float32).reshape(SHAPE)
    _write_array(tmp_path / "w", values, "float32")
    path = tmp_path / "w" / "c.0.0"
    entries = [(0, 52), (52, 52), (104, 52), (156, 60)]
    table = path.read_bytes()[4 * 52 : 4 * 52 + 16]
    path.write_bytes(path.read_bytes()[: 4 * 52] + table + ShardIndex(tuple(entries)).encode())
    with pytest.raises(CheckpointingException, match=r"inner chunk 3 is \(156, 60\), outside"):
        read_inner(FileRanges(path), 4, {0: memoryview(bytearray(48))})
    path.write_bytes(path.read_bytes()[: 4 * 52] + table + ShardIndex(tuple(entries[:3]) + ((156, 48),)).encode())
    with pytest.raises(CheckpointingException, match="inner chunk 3 is stored in 48 bytes, expected 52"):
        read_inner(FileRanges(path), 4, {3: memoryview(bytearray(48))})


@dataclass
class _Chunk:
    store: FileChunkStore
    rel: str = "c.0.0"

    def describe(self) -> str:
        return f"chunk c.0.0 of array 'w' ({self.store.describe(self.rel)})"


def test_the_chunk_codec_interface_writes_reads_and_holds_a_shard(tmp_path: Path) -> None:
    codec = ShardingIndexed(INNER, 4)
    values = np.arange(48, dtype=np.float32).reshape(SHARD)
    data = memoryview(values.reshape(-1).view(np.uint8))
    encoded = codec.encode(data)
    chunk = _Chunk(FileChunkStore(tmp_path))
    chunk.store.put(chunk.rel, list(encoded.pieces))
    out = np.zeros(SHARD, np.float32)
    halves = [memoryview(out.reshape(-1).view(np.uint8))[:70], memoryview(out.reshape(-1).view(np.uint8))[70:]]
    assert codec.read_into(chunk, halves) == encoded.crc == encode_shard(_inner_views(values)).crc
    assert np.array_equal(out, values)
    held = codec.held(data, xxhash.xxh3_128_hexdigest(data))
    assert held.crc == encoded.crc and held.nbytes == (tmp_path / chunk.rel).stat().st_size
    stored = memoryview((tmp_path / chunk.rel).read_bytes())
    assert held.holds([stored]) and held.holds([stored[:1], stored[1:50], stored[50:51], stored[51:]])
    assert not held.holds([stored, memoryview(b"\0")]) and not held.holds([stored[:-1]])
    with pytest.raises(ChunkMismatch):
        held.check([memoryview((tmp_path / chunk.rel).read_bytes()[:-1] + b"\0")], "the old shard")
    (tmp_path / chunk.rel).unlink()
    with pytest.raises(CheckpointingException, match=r"Missing chunk c\.0\.0 of array 'w'"):
        codec.read_into(chunk, [memoryview(out.reshape(-1).view(np.uint8))])


class CountingFiles(FileChunkStore):
    """A ``FileChunkStore`` that counts the bytes its ranged reads return."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int]] = []

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        found = super().get_suffix(rel, nbytes)
        self.reads.append(("suffix", 0 if found is None else len(found[0])))
        return found

    def get_range_into_folded(self, rel: str, offset: int, views: list[memoryview], fold: Fold | None) -> None:
        super().get_range_into_folded(rel, offset, views, fold)
        self.reads.append(("range", sum(len(v) for v in views)))


def test_a_chunk_store_reads_two_inner_chunks_of_a_shard_by_range(tmp_path: Path) -> None:
    values = np.arange(96, dtype=np.float32).reshape(SHAPE)
    _write_array(tmp_path / "w", values, "float32")
    store = CountingFiles(tmp_path / "w")
    out = np.zeros((2, *INNER), np.float32)
    wanted = {1: memoryview(out[0].reshape(-1).view(np.uint8)), 3: memoryview(out[1].reshape(-1).view(np.uint8))}
    shard = read_inner(ChunkRanges(_Chunk(store, "c.1.0")), 4, wanted)
    assert np.array_equal(out[0], values[10:12]) and np.array_equal(out[1], values[14:16])
    assert shard == encode_shard(_inner_views(values[8:16])).crc
    inner = 48 + CRC_BYTES
    suffix = ShardIndex.suffix_nbytes(4)
    assert store.reads == [("suffix", suffix), ("range", inner), ("range", inner)]
    assert sum(n for _, n in store.reads) == 2 * inner + suffix < (tmp_path / "w" / "c.1.0").stat().st_size


def test_a_range_past_a_shards_end_names_the_shard(tmp_path: Path) -> None:
    """The index's entries are checked against the shard's size first
    (``test_an_index_entry_past_the_inner_chunks_is_refused``); a shard cut between
    its index read and its range read fails like this."""
    values = np.arange(96, dtype=np.float32).reshape(SHAPE)
    _write_array(tmp_path / "w", values, "float32")
    source = ChunkRanges(_Chunk(FileChunkStore(tmp_path / "w")))
    with pytest.raises(CheckpointingException, match=r"chunk c\.0\.0 of array 'w'.*292 bytes.*past its end"):
        source.read_range_into(200, [memoryview(bytearray(52)), memoryview(bytearray(52))], lambda _: None)
    (tmp_path / "w" / "c.0.0").unlink()
    with pytest.raises(CheckpointingException, match=r"Missing chunk c\.0\.0 of array 'w'"):
        read_inner(source, 4, {0: memoryview(bytearray(48))})


def test_a_shard_whose_inner_chunks_split_another_axis_reads_right_everywhere(tmp_path: Path) -> None:
    """A review found that a spec-valid shard with inner chunks (4, 3) in a (4, 6) shard
    read back with its rows interleaved (every crc32c matched). Its decoded bytes are
    inner-chunk-major now: zarr-python and TensorStore read what ``encode`` wrote, and
    every box of it reads back right, the edge inner chunks padded."""
    shape, shard, inner = (7, 11), (4, 6), (2, 3)  # 2 x 2 shards of 2 x 2 inner chunks, the last ones cut
    values = np.arange(77, dtype=np.float32).reshape(shape)
    codec = ShardingIndexed(inner, 4)
    codec.check_chunk_shape(shard, "ckpt", "w")
    assert not codec.c_ordered(shard) and ShardingIndexed((2, 6), 4).c_ordered(shard)
    root = tmp_path / "w"
    root.mkdir()
    (root / "zarr.json").write_text(json.dumps(ArrayRecord("w", shape, "float32", shard, codec=codec).zarr_metadata()))
    store = FileChunkStore(root)
    for i in range(2):
        for j in range(2):
            part = values[i * 4 : (i + 1) * 4, j * 6 : (j + 1) * 6]
            packed = np.concatenate([part[a : a + 2, b : b + 3].reshape(-1) for a in (0, 2) for b in (0, 3)])
            data = codec.decoded(packed.view(np.uint8), shard, part.shape)
            store.put(f"c.{i}.{j}", list(codec.encode(memoryview(data)).pieces))
    by_zarr, by_ts = _read_plain(root)
    assert np.array_equal(by_zarr, values) and np.array_equal(by_ts, values)
    for box in [(slice(0, 4), slice(0, 6)), (slice(1, 3), slice(2, 5)), (slice(0, 3), slice(0, 5))]:
        for index in [(0, 0), (1, 1)]:
            box_in = tuple(slice(s.start, min(s.stop, n - k * c)) for s, n, k, c in zip(box, shape, index, shard))
            out = np.zeros([s.stop - s.start for s in box_in], np.float32)
            codec.read_boxes_into(_Chunk(store, f"c.{index[0]}.{index[1]}"), shard, [(box_in, out)])
            origin = [k * c for k, c in zip(index, shard)]
            assert np.array_equal(out, values[tuple(slice(o + s.start, o + s.stop) for o, s in zip(origin, box_in))])
    with pytest.raises(CheckpointingException, match=r"array 'w' is stored in shards of \(4, 6\) with inner chunks"):
        ShardingIndexed((3, 6), 4).check_chunk_shape((4, 6), "ckpt", "w")  # not whole inner chunks


def test_many_boxes_of_one_shard_read_its_index_once(tmp_path: Path) -> None:
    """A load that asks for several blocks of one shard (a rank's layers of a
    layer-stacked array) reads the crc table and index once, then the inner chunks
    they need, adjacent ones in one range (``format.chunks.BoxesJob``)."""
    values = np.arange(96, dtype=np.float32).reshape(SHAPE)
    _write_array(tmp_path / "w", values, "float32")
    store = CountingFiles(tmp_path / "w")
    outs = [np.zeros(INNER, np.float32) for _ in range(3)]
    boxes = [(slice(0, 2), slice(0, 6)), (slice(2, 4), slice(0, 6)), (slice(6, 8), slice(0, 6))]
    ShardingIndexed(INNER, 4).read_boxes_into(_Chunk(store, "c.1.0"), SHARD, list(zip(boxes, outs)))
    for (rows, _), out in zip(boxes, outs):
        assert np.array_equal(out, values[8 + rows.start : 8 + rows.stop])
    inner = 48 + CRC_BYTES
    assert store.reads == [("suffix", ShardIndex.suffix_nbytes(4)), ("range", 2 * inner), ("range", inner)]
