"""An empty inner-chunk marker in a shard's index (offset and length both 2**64-1, as
Zarr writers mark a chunk of fill values): shardstore never writes one, so a load
refuses it, naming checkpoint, array, shard and inner chunk, instead of returning zeros
for it. Before, a shard whose index marked an inner chunk empty (the record's checksum
of the shard agreeing) loaded with that chunk's rows zero, and ``verify`` passed."""

from __future__ import annotations

import re
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, save, verify
from shardstore.format.sharding import ShardIndex, encode_shard, read_inner
from shardstore.stores.base import Fold
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.scenarios import rewrite_record

ROWS, COLS = 48, 5
INNER_ROWS, PER_SHARD = 4, 3  # 12 inner chunks of 4 rows, 3 to a shard: 4 shards
INNER_BYTES = INNER_ROWS * COLS * 4


def _values() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1


def _saved(ckpt: Path) -> None:
    strategy = ZarrSaveShardedStrategy(shard_bytes=PER_SHARD * INNER_BYTES, max_chunk_bytes=INNER_BYTES)
    save({"w": ShardedTensor.from_rank_offsets("w", _values())}, ckpt, strategy)


def _emptied(ckpt: Path, shard: int, inner: int) -> None:
    """Marks ``inner`` of shard ``shard`` empty in its index and binds the shard's new
    crc32c into the commit record, as a writer that emits empty markers would have."""
    path = ckpt / "w" / f"c.{shard}.0"
    stored = path.read_bytes()
    index_bytes = ShardIndex.nbytes(PER_SHARD)
    entries = list(ShardIndex.decode(stored[-index_bytes:], PER_SHARD, None, "shard").entries)
    entries[inner] = None
    index = ShardIndex(tuple(entries)).encode()
    path.write_bytes(stored[:-index_bytes] + index)
    # the shard's crc32c as the record keeps it: the stored inner chunks' trailers, then the index's
    table = stored[-ShardIndex.suffix_nbytes(PER_SHARD) :][: 4 * PER_SHARD]
    kept = b"".join(table[4 * i : 4 * i + 4] for i, e in enumerate(entries) if e is not None)
    crc = crc32c.crc32c(kept + index[-4:])

    def bind(root: dict) -> None:
        root["attributes"]["shardstore"]["arrays"]["w"]["chunk_crc32c"][shard] = crc

    rewrite_record(ckpt, bind)


def test_a_load_refuses_an_inner_chunk_marked_empty_naming_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _saved(ckpt)
    _emptied(ckpt, 1, 2)
    pattern = rf"chunk c\.1\.0 of array 'w' \({re.escape(str(ckpt))}/w/c\.1\.0\): inner chunk 2 is marked empty"
    with pytest.raises(CheckpointingException, match=pattern):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS))}, ckpt)
    # a load of only the rows of another inner chunk of that shard (its first) refuses it too
    part = ShardedTensor.from_rank_offsets("w", torch.zeros(INNER_ROWS, COLS), (0, PER_SHARD, ROWS // INNER_ROWS))
    with pytest.raises(CheckpointingException, match=pattern):
        load({"w": part}, ckpt, validate_access_integrity=False)
    report = verify(ckpt)
    assert not report.ok and "inner chunk 2 is marked empty" in str(report.problems), report.problems


def test_read_inner_reads_an_empty_marker_as_zeros_only_where_it_is_told_the_chunk_is_empty() -> None:
    values = np.arange(3 * 12, dtype=np.float32).reshape(3, 12) + 1
    shard = encode_shard([memoryview(values[0].view(np.uint8)), None, memoryview(values[2].view(np.uint8))])
    data = b"".join(bytes(p) for p in shard.pieces)

    class Source:
        def describe(self) -> str:
            return "shard c.0.0 of array 'w' (ckpt/w/c.0.0)"

        def read_suffix(self, n: int) -> tuple[bytes, int]:
            return data[-n:], len(data)

        def read_range_into(self, offset: int, out: list[memoryview], fold: Fold) -> int:
            at = offset
            for v in out:
                v[:] = data[at : at + len(v)]
                fold(v)
                at += len(v)
            return at - offset

    out = np.full((3, 12), 7, np.float32)
    wanted = {i: memoryview(out[i].view(np.uint8)) for i in range(3)}
    with pytest.raises(CheckpointingException, match=r"shard c\.0\.0 of array 'w'.*inner chunk 1 is marked empty"):
        read_inner(Source(), 3, wanted)
    with pytest.raises(CheckpointingException, match="inner chunk 1 is marked empty"):
        read_inner(Source(), 3, {0: wanted[0]})  # not read, still refused
    assert read_inner(Source(), 3, wanted, empty=frozenset({1})) == shard.crc
    assert np.array_equal(out[1], np.zeros(12)) and np.array_equal(out[2], values[2])
