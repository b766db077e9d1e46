"""Chunks assembled by exchange (gathered shards, flattened tensors' straddling chunks)
under a host memory bound: a rank that assembles more than half of it exchanges them in
waves (``planning.plans.exchange_waves``), each written before the next is exchanged, so
its buffers hold at most about half the bound at once; ranks that pass different bounds
fail the save alike, before any transfer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardstore
from shardstore import ShardedTensor, load, save
from shardstore.planning.layout import GlobalLayout, ShardRecord
from shardstore.planning.plans import exchange_waves, plan_save
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed

ROWS, COLS, ARRAYS = 96, 64, 8  # fp32: 24 KiB per array, a block of 8 KiB per rank at 3 ranks
ARRAY_BYTES = ROWS * COLS * 4
BOUND = 2 * ARRAY_BYTES  # waves of one array's shard each (half the bound)


def _global(i: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (i + 1) % 1009


def _state(rank: int, world: int, empty: bool = False) -> dict:
    out = {}
    for i in range(ARRAYS):
        block = _global(i).chunk(world)[rank].clone()
        out[f"w{i}"] = ShardedTensor.from_rank_offsets(
            f"w{i}", torch.zeros_like(block) if empty else block, (0, rank, world))
    return out


def _assembled_per_wave() -> list[int]:
    """Wraps ``straddling_transfers`` (called once per exchange wave) to record the bytes
    of the buffers each wave assembles."""
    import shardstore.execution.save as save_module

    seen: list[int] = []
    original = save_module.straddling_transfers

    def recording(*args, **kwargs):
        transfers, chunks = original(*args, **kwargs)
        seen.append(sum(buffer.nbytes for _, buffer in chunks))
        return transfers, chunks

    save_module.straddling_transfers = recording
    return seen


def saved_in_waves(rank: int, world: int, ckpt: str, bound: int, asynchronous: bool) -> list[int]:
    seen = _assembled_per_wave()
    kwargs = {"max_staging_bytes": bound} if asynchronous else {"sync_staging_bytes": bound}
    strategy = ZarrSaveShardedStrategy(shard_bytes=ARRAY_BYTES, **kwargs)
    request = save(_state(rank, world), ckpt, strategy, async_sharded_save=asynchronous)
    if asynchronous:
        request.execute_sync()
    loaded = load(_state(rank, world, empty=True), ckpt)
    for i in range(ARRAYS):
        assert torch.equal(loaded[f"w{i}"], _global(i).chunk(world)[rank]), (rank, i)
    return seen


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_writer_assembles_at_most_half_the_bound_at_once(tmp_path: Path, asynchronous: bool) -> None:
    ckpt = tmp_path / "ckpt"
    per_rank = run_distributed(saved_in_waves, 3, str(ckpt), BOUND, asynchronous)
    waves = {len(seen) for seen in per_rank}
    assert waves == {3}, per_rank  # 8 shards of 24 KiB over 3 writers: 3 each at most
    assert max(max(seen) for seen in per_rank) <= BOUND // 2, per_rank  # one shard per wave
    assert sum(sum(seen) for seen in per_rank) == ARRAYS * ARRAY_BYTES  # every shard assembled once
    assert shardstore.verify(ckpt).ok


def test_without_a_bound_everything_is_assembled_at_once(tmp_path: Path) -> None:
    per_rank = run_distributed(saved_in_waves, 3, str(tmp_path / "ckpt"), 1 << 30, False)
    assert all(len(seen) == 1 for seen in per_rank), per_rank
    assert max(seen[0] for seen in per_rank) >= 2 * ARRAY_BYTES  # what the waves above cut


def saved_with_bounds(rank: int, world: int, ckpt: str, bounds: list[int]) -> str:
    strategy = ZarrSaveShardedStrategy(shard_bytes=ARRAY_BYTES, sync_staging_bytes=bounds[rank])
    with pytest.raises(shardstore.CheckpointingException) as raised:
        save(_state(rank, world), ckpt, strategy)
    return str(raised.value)


def test_ranks_that_pass_different_bounds_fail_alike_and_commit_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    messages = run_distributed(saved_with_bounds, 3, str(ckpt), [BOUND, BOUND, 1 << 30])
    assert len(set(messages)) == 1, messages
    assert "sync_staging_bytes" in messages[0] and "pass every rank the same value" in messages[0]
    assert f"rank 0: {BOUND // 2}" in messages[0] and "rank 2: None" in messages[0]
    assert not (ckpt / "zarr.json").exists()


def test_ranks_with_different_bounds_save_where_one_wave_holds_everything(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"  # 3 shards per writer at most: 72 KiB under either half bound
    run_distributed(saved_in_waves_or_not, 3, str(ckpt))
    assert shardstore.verify(ckpt).ok


def saved_in_waves_or_not(rank: int, world: int, ckpt: str) -> None:
    bound = [8 * ARRAY_BYTES, 1 << 30, 1 << 30][rank]
    save(_state(rank, world), ckpt, ZarrSaveShardedStrategy(shard_bytes=ARRAY_BYTES, sync_staging_bytes=bound))


def _layout(world: int, arrays: int, rows: int) -> GlobalLayout:
    tensors = {}
    for i in range(arrays):
        key, block = f"a{i:02d}", rows // world
        tensors[key] = [
            ShardRecord(key, r, 0, "float32", (rows, COLS), (r * block, 0), (block, COLS), None, True)
            for r in range(world)]
    return GlobalLayout(tensors, {}, world)


@pytest.mark.parametrize("wave_bytes", [None, 1, 10_000, 24 * 1024, 100_000])
def test_every_chunk_is_in_one_wave_and_its_contributors_agree(wave_bytes: int | None) -> None:
    plans = plan_save(_layout(4, 30, 128), 1 << 30, True, shard_bytes=64 * COLS * 4)
    counts = {len(exchange_waves(p, wave_bytes)) for p in plans}
    assert len(counts) == 1  # every rank runs as many waves
    busiest = max(sum(c.writer == p.rank for _, c in p.straddling) for p in plans)
    assert counts == {1} if not wave_bytes else counts.copy().pop() <= busiest  # never more than its chunks
    window = max(wave_bytes or 0, plans[0].largest_assembled)
    waves_of: dict[int, set[int]] = {}
    for p in plans:
        waves = exchange_waves(p, wave_bytes)
        assert sorted(t for w in waves for t, _ in w) == sorted(t for t, _ in p.straddling)
        for number, wave in enumerate(waves):
            assembled = [c for _, c in wave if c.writer == p.rank]
            if wave_bytes:
                size = max((c.volume * 4 for c in assembled), default=0)
                assert sum(c.volume * 4 for c in assembled) <= window + size
            for tag, _ in wave:
                waves_of.setdefault(tag, set()).add(number)
    assert all(len(w) == 1 for w in waves_of.values())  # a writer and its contributors: one wave
    if wave_bytes and wave_bytes < plans[0].assembled_bytes:
        assert counts.pop() > 1
