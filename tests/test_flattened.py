"""Distributed-optimizer style flattened ranges (issue 3, point 3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, load_plain_tensors, save
from shardstore.planning.layout import ShardRecord, chunk_shape_for
from shardstore.planning.plans import plan_flat_writes
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

SHAPE = (10, 7)  # 70 elements: range boundaries below fall mid-row
KEY = "optimizer/exp_avg/dense"


def _flat_shards(rank: int, world: int, tp: int, boundaries: list[int], empty: bool) -> dict:
    """TP splits axis 0 into ``tp`` blocks; the DP ranks of a block hold contiguous
    ranges of the flattened block, cut at ``boundaries`` (fractions of the block)."""
    full = global_tensor(KEY, SHAPE, torch.float32)
    dp = world // tp
    tp_rank, dp_rank = rank // dp, rank % dp
    block = full.chunk(tp, 0)[tp_rank]
    volume = block.numel()
    cuts = [0, *[int(b * volume) for b in boundaries], volume]
    start, stop = cuts[dp_rank], cuts[dp_rank + 1]
    data = block.flatten()[start:stop]
    data = torch.empty_like(data) if empty else data.clone()
    offsets = [(0, tp_rank, tp)] if tp > 1 else []
    return {"exp_avg": ShardedTensor.from_rank_offsets_flat(KEY, data, tuple(block.shape), *offsets,
                                                            flattened_range=slice(start, stop))}


def save_flat(rank: int, world: int, ckpt: str, tp: int, boundaries: list[int], max_chunk_bytes: int) -> None:
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=max_chunk_bytes)
    save(_flat_shards(rank, world, tp, boundaries, empty=False), ckpt, sharded_strategy=strategy)


def load_flat(rank: int, world: int, ckpt: str, tp: int, boundaries: list[int]) -> None:
    request = _flat_shards(rank, world, tp, boundaries, empty=True)
    loaded = load(request, ckpt)
    expected = _flat_shards(rank, world, tp, boundaries, empty=False)["exp_avg"].data
    assert_bits_equal(loaded["exp_avg"], expected, f"rank {rank}")


def load_plain(rank: int, world: int, ckpt: str) -> None:
    assert_bits_equal(load_plain_tensors(ckpt)[KEY], global_tensor(KEY, SHAPE, torch.float32))


@pytest.mark.parametrize("max_chunk_bytes", [2**20, 3 * 7 * 4], ids=["one-chunk-per-block", "3-row-chunks"])
def test_flat_ranges_round_trip_and_reshard(ckpt_dir: Path, max_chunk_bytes: int) -> None:
    # Saved: TP=2 x DP=2 at 4 ranks, DP boundary at 48% of each block (mid-row).
    run_distributed(save_flat, 4, str(ckpt_dir), 2, [0.48], max_chunk_bytes)
    run_distributed(load_plain, 1, str(ckpt_dir))
    # Loaded as differently split flat ranges: no TP, 2 DP ranks cut at 61%.
    run_distributed(load_flat, 2, str(ckpt_dir), 1, [0.61])
    # Same TP, 2 DP ranks with another cut; and 4 DP ranks over the whole tensor.
    run_distributed(load_flat, 4, str(ckpt_dir), 2, [0.2])
    run_distributed(load_flat, 4, str(ckpt_dir), 1, [0.1, 0.5, 0.77])


def test_flat_save_at_3_cuts_with_empty_range(ckpt_dir: Path) -> None:
    # 4 DP ranks over one block, one of them holding nothing (an empty range).
    run_distributed(save_flat, 4, str(ckpt_dir), 1, [0.3, 0.3, 0.9], 5 * 4)
    run_distributed(load_plain, 1, str(ckpt_dir))


def _records(shape, cuts, tp_blocks=1):
    rows = shape[0] // tp_blocks
    block = (rows, *shape[1:])
    out, rank = [], 0
    for b in range(tp_blocks):
        for lo, hi in zip(cuts, cuts[1:]):
            out.append(ShardRecord("k", rank, 0, "float32", shape, (b * rows, 0), block, (lo, hi), True))
            rank += 1
    return out


@pytest.mark.parametrize("cuts, max_bytes", [([0, 17, 35], 28), ([0, 1, 2, 34, 35], 8), ([0, 35], 4), ([0, 10, 10, 35], 20)])
def test_every_flat_chunk_has_exactly_one_writer(cuts, max_bytes) -> None:
    shape = (10, 7)
    records = _records(shape, cuts, tp_blocks=2)
    chunk = chunk_shape_for(records, shape, 4, max_bytes)
    assert math.prod(chunk) * 4 <= max(max_bytes, 4)
    written: dict[tuple, int] = {}
    covered = torch.zeros(shape, dtype=torch.int32)
    direct, straddling = plan_flat_writes("k", records, chunk)
    for region, rank in [(w.region, w.rank) for w in direct] + [(c.region, c.writer) for c in straddling]:
        key = tuple((s.start, s.stop) for s in region)
        assert key not in written, f"chunk {key} written by ranks {written[key]} and {rank}"
        written[key] = rank
        covered[region] += 1
    assert torch.all(covered == 1)
