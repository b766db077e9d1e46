"""The chunk shape of an unsharded array (``planning.layout.chunk_shape_for``,
``bound_chunk``): aligned with every block, at most ``max_chunk_bytes``, and not
degenerate where a block's length has no divisor near the bound.

FSDP2 over 31 ranks splits Llama's embedding into blocks of 4,138 = 2 x 2,069 rows of
32 KiB; the bound (64 MiB) allows 2,048 rows, and the largest divisor under it is 2:
each rank wrote 2,069 files of 64 KiB per array, 388,209 data files for 117 arrays
(``scripts/sharded_plan_counts.py``), against 4,185 now that the columns are split.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zarr

from shardstore import ShardedTensor, load, save
from shardstore.format.records import read_commit_record
from shardstore.planning.layout import GatheredShards, ShardRecord, bound_chunk
from shardstore.planning.plans import plan_save
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed

MiB = 1 << 20
PRIME = 1009  # a rank's block: 2 x PRIME rows of COLS float32
COLS = 64
MAX_CHUNK_BYTES = 128 << 10  # 512 rows of 256 bytes: the largest divisor of 2 x PRIME under it is 2


@pytest.mark.parametrize(("chunk", "expected"), [
    ((4138, 8192), (2069, 4096)),  # FSDP2's Llama embedding at 31 ranks: 34 MB, not 64 KiB
    ((4139, 8192), (4139, 2048)),  # a prime number of rows
    ((3, 4138, 8192), (1, 2069, 4096)),
    ((4008, 8192), (2004, 8192)),  # a divisor near the bound: whole rows, as ever
    ((4096,), (4096,)),
])
def test_a_length_without_a_divisor_near_the_bound_splits_a_later_axis(chunk, expected) -> None:
    found = bound_chunk(chunk, 4, 64 * MiB, contiguous=False)
    assert found == expected
    assert all(n % c == 0 for n, c in zip(chunk, found))
    assert found[0] * 4 * int(torch.tensor(found[1:]).prod()) <= 64 * MiB


def test_chunks_contiguous_in_their_block_keep_whole_later_axes() -> None:
    """Flattened ranges and shards' inner chunks need chunks contiguous in the block."""
    assert bound_chunk((4138, 8192), 4, 64 * MiB) == (2, 8192)


def _fsdp_layout(world: int, rows: int, cols: int, arrays: int = 2) -> GatheredShards:
    per_rank = -(-rows // world)
    return GatheredShards.from_gathered([
        ([ShardRecord(f"a{i}", rank, i, "float32", (rows, cols), (rank * per_rank, 0),
                      (min(per_rank, rows - rank * per_rank), cols), None, True) for i in range(arrays)], [])
        for rank in range(world) if rank * per_rank < rows
    ])


def test_an_unsharded_save_of_31_fsdp_ranks_writes_one_chunk_per_block_half() -> None:
    layout = _fsdp_layout(31, 128256, 8192)  # 4,138 rows per rank
    arrays = plan_save(layout, 64 * MiB, True, None)[0].commit.arrays
    assert {a.chunk_shape for a in arrays.values()} == {(2069, 4096)}
    assert sum(a.chunk_count for a in arrays.values()) == 2 * 31 * 2 * 2


def test_sharded_saves_still_gather_whole_rows() -> None:
    """Where shards gather a block's chunks, they stay contiguous (split later axes would
    make a shard per block half: more files, not fewer)."""
    layout = _fsdp_layout(62, 128256, 8192)  # 2,069 rows per rank: 1-row chunks
    arrays = plan_save(layout, 64 * MiB, True, 64 * MiB)[0].commit.arrays
    assert {a.codec.chunk_shape for a in arrays.values()} == {(1, 8192)}


def save_fsdp_rows(rank: int, world: int, ckpt: str) -> None:
    rows = 2 * PRIME
    full = torch.arange(world * rows * COLS, dtype=torch.float32).reshape(world * rows, COLS)
    mine = full[rank * rows:(rank + 1) * rows].clone()
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=MAX_CHUNK_BYTES, shard_bytes=None)
    save({"w": ShardedTensor.from_rank_offsets("w", mine, (0, rank, world))}, ckpt, strategy)


def load_columns(rank: int, world: int, ckpt: str, saved_world: int) -> bool:
    """A load split along the columns: each rank reads part of every chunk's columns."""
    rows = saved_world * 2 * PRIME
    full = torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS)
    mine = full.chunk(world, 1)[rank]
    wanted = ShardedTensor.from_rank_offsets("w", torch.empty_like(mine), (1, rank, world))
    return torch.equal(load({"w": wanted}, ckpt)["w"], mine)


def test_split_columns_round_trip_at_another_layout_and_in_plain_zarr(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(save_fsdp_rows, 2, str(ckpt))
    record = read_commit_record(open_location(ckpt)).arrays["w"]
    assert record.chunk_shape == (PRIME, COLS // 2)  # was (2, COLS): 1,009 chunks per rank
    assert record.chunk_count == 8
    assert len([p for p in (ckpt / "w").rglob("*") if p.is_file() and p.name != "zarr.json"]) == 8
    assert run_distributed(load_columns, 4, str(ckpt), 2) == [True] * 4
    expected = torch.arange(2 * 2 * PRIME * COLS, dtype=torch.float32).reshape(-1, COLS)
    assert torch.equal(torch.from_numpy(zarr.open_array(str(ckpt / "w"), mode="r")[:]), expected)
