"""Who writes what in a save plan (``planning.plans.plan_save``): the arrays'
``zarr.json`` files spread over the ranks that hold each array's blocks."""

from __future__ import annotations

import math
import random
from collections import Counter

from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.sharding import ShardingIndexed, encode_shard
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import (
    MIN_INNER_BYTES,
    SHARD_SLACK,
    SHARDED_FILES_SHARE,
    largest_shard_bytes,
    plan_save,
)


def _block(key: str, rank: int, index: int, world: int, main: bool = True) -> ShardRecord:
    rows = 16 // world
    return ShardRecord(key, rank, index, "float32", (16, 8), (rank * rows, 0), (rows, 8), None, main)


def test_fsdp_arrays_spread_their_metadata_files_over_every_rank() -> None:
    """FSDP2 splits every array over all ranks: rank 0 used to write every zarr.json
    (1,000 files and directories at 1,000 arrays) while the others waited."""
    world, arrays = 4, 8
    per_rank = [([_block(f"w{i}", rank, i, world) for i in range(arrays)], []) for rank in range(world)]
    plans = plan_save(GatheredShards.from_gathered(per_rank), 1 << 20, fully_parallel=False)
    writers = Counter(plan.rank for plan in plans for _ in plan.array_metadata)
    assert writers == {rank: arrays // world for rank in range(world)}, writers
    assert sorted(key for plan in plans for key in plan.array_metadata) == sorted(f"w{i}" for i in range(arrays))
    for plan in plans:  # each writes only arrays it holds, whose record it has
        assert set(plan.array_metadata) <= set(plan.records)


def test_an_array_held_by_one_rank_has_its_metadata_written_there() -> None:
    replicated = [ShardRecord("norm", rank, 0, "float32", (8,), (0,), (8,), None, rank == 2) for rank in range(4)]
    plans = plan_save(GatheredShards.from_gathered([([r], []) for r in replicated]), 1 << 20, fully_parallel=False)
    assert [plan.array_metadata for plan in plans] == [(), (), ("norm",), ()]


def _row_blocks(key: str, rows: list[int], columns: int, dtype: str = "float32") -> GatheredShards:
    """FSDP2-like blocks of ``rows[r]`` rows on rank ``r`` of a ``(sum(rows), columns)`` array."""
    starts = [sum(rows[:r]) for r in range(len(rows))]
    shape = (sum(rows), columns)
    return GatheredShards.from_gathered([([ShardRecord(key, r, 0, dtype, shape, (starts[r], 0),
                                                     (rows[r], columns), None, True)], [])
                                       for r in range(len(rows))])


def test_one_row_blocks_keep_inner_chunks_of_whole_rows_in_even_shards() -> None:
    """FSDP2 at a world size as large as the first axis gives each rank one row: the
    inner chunks stay whole rows (what every earlier shardstore reads). At 4 per shard,
    5 of them make one shard of 5 rows (1.25 shards: ``SHARD_SLACK``), 6 make two of 3
    (1.5 shards round to 2), 7 make 4 + 3, not 4 + 3 + 0 or 5 + 2 (even: an edge shard
    is stored padded to the full shape), 9 make 5 + 4 (2.25 round to 2, each within the
    slack)."""
    for rows, shard_rows in ((5, 5), (6, 3), (7, 4), (9, 5)):
        layout = _row_blocks("w", [1] * rows, 8192)  # a row: 32 KiB
        (record,) = plan_save(layout, 1 << 20, False, shard_bytes=4 * 32 << 10)[0].commit.arrays.values()
        assert record.codec.chunk_shape == (1, 8192), record.codec
        assert record.chunk_shape == (shard_rows, 8192), (rows, record.chunk_shape)


def test_an_array_is_sharded_only_where_that_saves_a_quarter_of_its_files() -> None:
    """Blocks of 134 rows of 1 MiB: an unsharded save stores them in 16 chunks (67 rows
    by half the columns, ``bound_chunk``); 3 MiB shards of inner chunks of contiguous
    rows would be 179 files and a gather. Not sharded (``SHARDED_FILES_SHARE``)."""
    layout = _row_blocks("w", [134] * 4, 1 << 18)
    (record,) = plan_save(layout, 64 << 20, False, shard_bytes=3 << 20)[0].commit.arrays.values()
    assert record.codec == BYTES_CRC32C and record.chunk_count == 16, record


def _stored_nbytes(record) -> int:
    """What the format's own encoder stores for one full shard of ``record``."""
    count = math.prod(record.chunk_shape) // math.prod(record.codec.chunk_shape)
    inner = memoryview(bytes(record.codec.inner_nbytes))
    return sum(len(piece) for piece in encode_shard([inner] * count).pieces)


def test_the_largest_shard_is_what_the_encoder_stores_at_its_bound() -> None:
    """Five blocks of one 16 KiB row (``MIN_INNER_BYTES``) at four per shard: one shard
    of five, 1.25 times ``shard_bytes`` (``SHARD_SLACK``), stored in exactly
    ``largest_shard_bytes``, the encoder's trailers, crc table and index included."""
    layout = _row_blocks("w", [1] * 5, MIN_INNER_BYTES // 4)
    (record,) = plan_save(layout, 1 << 20, False, shard_bytes=4 * MIN_INNER_BYTES)[0].commit.arrays.values()
    assert record.chunk_shape == (5, MIN_INNER_BYTES // 4) and record.codec.inner_nbytes == MIN_INNER_BYTES
    assert _stored_nbytes(record) == largest_shard_bytes(4 * MIN_INNER_BYTES)


def test_shard_counts_round_halves_down() -> None:
    """10 inner chunks of one row at 4 per shard (2.5 shards): two shards of 5 (1.25
    times ``shard_bytes``), not three of 4, 4 and 2."""
    layout = _row_blocks("w", [1] * 10, MIN_INNER_BYTES // 4)
    (record,) = plan_save(layout, 1 << 20, False, shard_bytes=4 * MIN_INNER_BYTES)[0].commit.arrays.values()
    assert record.chunk_shape[0] == 5 and record.chunk_count == 2, record


def test_planned_shards_stay_within_their_bounds() -> None:
    """Random FSDP2-like layouts (uneven rows, blocks from a few KiB to past a shard):
    every gathered array's shard holds at most ``SHARD_SLACK`` times ``shard_bytes`` of
    data, is stored in at most ``largest_shard_bytes`` where its inner chunks are of
    ``MIN_INNER_BYTES`` or more, and the array has at most ``SHARDED_FILES_SHARE`` of the
    files an unsharded save writes."""
    rng = random.Random(7)
    checked = 0
    for _ in range(150):
        world, columns = rng.randint(2, 40), rng.choice([1, 3, 64, 1024, 4096])
        rows = [rng.randint(1, 300) for _ in range(world)]
        shard_bytes = rng.choice([16 << 10, 100 << 10, 1 << 20, 3 << 20])
        layout = _row_blocks("w", rows, columns)
        (record,) = plan_save(layout, 4 << 20, False, shard_bytes=shard_bytes)[0].commit.arrays.values()
        (loose,) = plan_save(layout, 4 << 20, False, shard_bytes=None)[0].commit.arrays.values()
        if not isinstance(record.codec, ShardingIndexed):
            continue
        assert math.prod(record.chunk_shape) * record.itemsize <= shard_bytes * SHARD_SLACK, (rows, shard_bytes)
        if record.codec.inner_nbytes >= MIN_INNER_BYTES:
            assert _stored_nbytes(record) <= largest_shard_bytes(shard_bytes), record
            checked += 1
        assert record.chunk_count <= loose.chunk_count * SHARDED_FILES_SHARE, (record, loose)
    assert checked >= 10


def _flattened_blocks(full, cuts: list[tuple[int, int]], axis: int) -> dict:
    """The blocks ``[start, stop)`` of ``full`` along ``axis`` (in ``cuts``' order, the
    state dict's), each a flattened range of its whole self on a regular grid."""
    from shardstore import ShardedTensor

    state = {}
    for start, stop in cuts:
        block = full.narrow(axis, start, stop - start).contiguous()
        offset = tuple(start if a == axis else 0 for a in range(full.ndim))
        fragments = tuple(-(-n // block.shape[a]) if a == axis else 1 for a, n in enumerate(full.shape))
        state[f"{start}"] = ShardedTensor("w", block.flatten(), block.dtype, tuple(block.shape), tuple(full.shape),
                                          offset, fragments, flattened_range=slice(0, block.numel()))
    return state


def test_flattened_blocks_of_different_shapes_save_their_values(tmp_path) -> None:
    """Flattened ranges of blocks of different shapes (a shorter last block, which the
    regular-grid checks admit: each offset is a multiple of its block's extent). The
    chunk shape was cut from the first main block alone: where that was the shorter
    block, chunks crossed the other blocks' edges (a save failing with an internal
    error, columns [0, 3) + [3, 4) of ``(2, 4)`` saved silently as ``[[0, 1, 2, 3],
    [1, 2, 4, 7]]``: a chunk that is no contiguous range of its block)."""
    import torch

    from shardstore import ShardedTensor, load, save

    for shape, axis, cuts in (((2, 4), 1, [(3, 4), (0, 3)]), ((8, 4), 0, [(6, 8), (0, 3), (3, 6)])):
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        ckpt = tmp_path / f"c{axis}"
        save(_flattened_blocks(full, cuts, axis), ckpt)
        loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(shape))}, ckpt)["w"]
        assert torch.equal(loaded, full), (shape, loaded)
