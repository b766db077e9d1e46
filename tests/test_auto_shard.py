"""Sharding by default where ranks are many (issue 44.1): ``shard_bytes="auto"``, the
default of ``ZarrSaveShardedStrategy``, stores arrays of small blocks in shards of
``DEFAULT_SHARD_BYTES`` when a save comes from ``AUTO_SHARD_MIN_RANKS`` ranks or more,
and never below; None never shards, a number of bytes always does. Megatron-LM users
reach it through ``shardstore.megatron.install(shard_bytes=...)``.

The world-size cases are planned, not run: a ``GatheredShards`` of 31 or 32 ranks' FSDP2
records goes through the strategy's own planning function (``plan_save``), so the
resolution is tested where the coordinator makes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.format.records import read_commit_record
from shardstore.format.sharding import ShardingIndexed
from shardstore.format.storage_layout import LayoutSite
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import largest_shard_bytes, object_bounds
from shardstore.serialization import get_default_save_sharded_strategy
from shardstore.stores.locations import open_location
from shardstore.strategies.zarr import (
    AUTO_SHARD_MIN_RANKS,
    DEFAULT_SHARD_BYTES,
    ZarrSaveShardedStrategy,
)
from tests.dist import run_distributed

COLS = 1024  # a row of float32: 4 KiB; a rank's block of ROWS_PER_RANK rows: 64 KiB
ROWS_PER_RANK = 16


def _fsdp_layout(world: int, arrays: int = 3) -> GatheredShards:
    """FSDP2's ``Shard(0)``: every array split along its rows over all ``world`` ranks."""
    shape = (world * ROWS_PER_RANK, COLS)
    return GatheredShards.from_gathered([
        ([ShardRecord(f"w{i}", rank, i, "float32", shape, (rank * ROWS_PER_RANK, 0), (ROWS_PER_RANK, COLS), None, True)
          for i in range(arrays)], [])
        for rank in range(world)
    ])


def _sharded_keys(strategy: ZarrSaveShardedStrategy, world: int) -> list[str]:
    """The arrays the strategy's plan of a ``world``-rank FSDP2 save stores in shards."""
    commit = strategy.plan_save(_fsdp_layout(world))[0].commit
    return sorted(key for key, record in commit.arrays.items() if isinstance(record.codec, ShardingIndexed))


def test_the_default_save_strategy_shards_automatically() -> None:
    assert ZarrSaveShardedStrategy().shard_bytes == "auto"
    assert get_default_save_sharded_strategy().shard_bytes == "auto"


def test_auto_shards_a_save_from_32_ranks() -> None:
    assert AUTO_SHARD_MIN_RANKS == 32
    strategy = ZarrSaveShardedStrategy()
    assert _sharded_keys(strategy, 32) == ["w0", "w1", "w2"]
    commit = strategy.plan_save(_fsdp_layout(32))[0].commit
    assert commit.requires == ("sharding_indexed",)
    # 32 blocks of 64 KiB: one shard per array (at most DEFAULT_SHARD_BYTES), not 32 files
    assert all(record.chunk_count == 1 for record in commit.arrays.values()), commit.arrays


def test_auto_leaves_a_save_from_31_ranks_unsharded() -> None:
    strategy = ZarrSaveShardedStrategy()
    assert _sharded_keys(strategy, 31) == []
    commit = strategy.plan_save(_fsdp_layout(31))[0].commit
    assert commit.requires == ()
    assert all(record.chunk_count == 31 for record in commit.arrays.values())


@pytest.mark.parametrize("world", [2, 32, 512])
def test_none_never_shards(world: int) -> None:
    assert _sharded_keys(ZarrSaveShardedStrategy(shard_bytes=None), world) == []


@pytest.mark.parametrize("world", [2, 31, 32])
def test_a_number_of_bytes_shards_at_any_world_size(world: int) -> None:
    assert _sharded_keys(ZarrSaveShardedStrategy(shard_bytes=1 << 20), world) == ["w0", "w1", "w2"]


def _shards_chosen(shard_bytes: object, world_size: int) -> int | None:
    return StorageLayout(shard_bytes=shard_bytes).chosen_for(LayoutSite(world_size)).shard_bytes  # type: ignore[arg-type, return-value]


def test_the_choice_and_the_object_bounds_follow_the_world_size() -> None:
    assert _shards_chosen("auto", AUTO_SHARD_MIN_RANKS - 1) is None
    assert _shards_chosen("auto", AUTO_SHARD_MIN_RANKS) == DEFAULT_SHARD_BYTES == 64 << 20
    assert _shards_chosen(None, 4096) is None
    assert _shards_chosen(4096, 1) == 4096
    layouts = [StorageLayout().chosen_for(LayoutSite(world)) for world in (31, 32)]
    assert object_bounds(layouts[0])["shard_bytes"] == (None, None)
    assert object_bounds(layouts[1])["shard_bytes"] == (DEFAULT_SHARD_BYTES, largest_shard_bytes(DEFAULT_SHARD_BYTES))
    assert 80 << 20 < largest_shard_bytes(DEFAULT_SHARD_BYTES) < 81 << 20  # 1.25x of data, and the index


@pytest.mark.parametrize("bad", ["64MiB", "AUTO", 0, -1, 1.5, True, [1 << 20]])
def test_a_shard_size_that_is_neither_auto_none_nor_bytes_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"shard_bytes must be 'auto' .* None .* positive number of bytes"):
        ZarrSaveShardedStrategy(shard_bytes=bad)
    strategy = ZarrSaveShardedStrategy()
    with pytest.raises(ValueError, match="shard_bytes must be"):
        strategy.shard_bytes = bad
    assert strategy.shard_bytes == "auto"


def test_the_dcp_writer_leaves_its_shard_size_auto_unless_told(tmp_path: Path) -> None:
    """It exchanges blocks on a group of its own (``tools.dcp_exchange``): ``"auto"``
    by default, chosen per save; an explicit size or None is kept."""
    from shardstore import ShardstoreWriter

    assert ShardstoreWriter(tmp_path / "ckpt").layout.shard_bytes == "auto"
    assert ShardstoreWriter(tmp_path / "ckpt", shard_bytes=None).layout.shard_bytes is None
    assert ShardstoreWriter(tmp_path / "ckpt", shard_bytes=4096).layout.shard_bytes == 4096
    with pytest.raises(ValueError, match="shard_bytes must be"):
        ShardstoreWriter(tmp_path / "ckpt", shard_bytes=0)


# ----------------------------------------------------------------- the plan cache


def _state(empty: bool = False) -> dict:
    return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.zeros(8, 64) if empty else
                                                     torch.arange(512, dtype=torch.float32).reshape(8, 64) + i)
            for i in range(2)}


def test_the_plan_cache_key_distinguishes_the_shard_size(tmp_path: Path) -> None:
    """A cached plan is reused only under the setting it was planned with: a change of
    ``shard_bytes`` plans anew (and shards), changing it back plans anew again."""
    # 4 chunks of 2 rows per array; arrays of 2 KiB, packed by default: kept as arrays to shard
    strategy = ZarrSaveShardedStrategy(max_chunk_bytes=512, cache_plan=True, layout=StorageLayout(pack_arrays_up_to=0))
    keys = set()
    for i, shard_bytes in enumerate(["auto", "auto", 1 << 20, None, "auto"]):
        strategy.shard_bytes = shard_bytes
        keys.add(strategy.plan_settings)
        save(_state(), tmp_path / f"c{i}", strategy)
        expected = ("sharding_indexed",) if shard_bytes == 1 << 20 else ()  # "auto" at one rank: unsharded
        assert read_commit_record(open_location(tmp_path / f"c{i}")).requires == expected, shard_bytes
    assert len(keys) == 3
    assert (strategy.plan_cache.planned, strategy.plan_cache.reused) == (4, 1)
    loaded = load(_state(empty=True), tmp_path / "c2")
    assert all(torch.equal(loaded[k], v.data) for k, v in _state().items())


# ----------------------------------------------------------------- Megatron's door


class _MegatronsStrategy:
    """Stands in for Megatron's ``TorchDistSaveShardedStrategy`` (any object not ours)."""


def test_without_install_megatrons_strategies_become_the_auto_default() -> None:
    from shardstore import megatron as shardstore_megatron
    from shardstore.compat.megatron import entry_points

    assert shardstore_megatron.strategy_for_save(None).shard_bytes == "auto"
    assert shardstore_megatron.strategy_for_save(_MegatronsStrategy()).shard_bytes == "auto"
    assert entry_points._save_layout(None) == entry_points._save_layout(_MegatronsStrategy()) == StorageLayout()


def test_install_shard_bytes_reaches_the_strategies_megatrons_saves_use() -> None:
    pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core not installed")
    from shardstore import megatron as shardstore_megatron
    from shardstore.compat.megatron.entry_points import _save_layout

    theirs, ours = _MegatronsStrategy(), ZarrSaveShardedStrategy(shard_bytes=None)
    shardstore_megatron.install(shard_bytes=1 << 20)
    try:
        built = shardstore_megatron.strategy_for_save(theirs)
        assert built.shard_bytes == "auto"  # the save's options carry install's sizes
        assert _save_layout(theirs).shard_bytes == _save_layout(None).shard_bytes == 1 << 20
        assert _save_layout(("torch_dist", 1)).shard_bytes == 1 << 20
        assert _save_layout(ours).shard_bytes == "auto" and ours.shard_bytes is None  # the caller's own keeps its own
        shardstore_megatron.install(shard_bytes=None)  # idempotent: changes the setting only
        assert shardstore_megatron.strategy_for_save(theirs) is built  # the same object: its cached plan stays
        assert _save_layout(theirs).shard_bytes is None
        with pytest.raises(ValueError, match="shard_bytes must be"):
            shardstore_megatron.install(shard_bytes="64 MiB")
        assert _save_layout(theirs).shard_bytes is None  # a refused call changes nothing
    finally:
        shardstore_megatron.uninstall()
    assert _save_layout(theirs).shard_bytes == "auto"


def megatron_save_with_shards(rank: int, world: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from shardstore import megatron as shardstore_megatron
    from tests.test_megatron_objects import megatron_state_dict

    shardstore_megatron.install(shard_bytes=4096, pack_arrays_up_to=0)  # arrays of < 64 KiB: not packed
    try:
        if rank == 0:
            Path(ckpt).mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save(megatron_state_dict(rank, world, empty=False), ckpt,
                                TorchDistSaveShardedStrategy("torch_dist", 1))
    finally:
        shardstore_megatron.uninstall()


def test_a_megatron_save_at_two_ranks_shards_when_install_asks(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch", reason="megatron-core not installed")
    from shardstore import load_plain_tensors, verify
    from tests.scenarios import assert_bits_equal
    from tests.test_megatron_objects import FC1

    ckpt = tmp_path / "iter_0000100"
    run_distributed(megatron_save_with_shards, 2, str(ckpt))
    record = read_commit_record(open_location(ckpt))
    assert "sharding_indexed" in record.requires
    assert isinstance(record.arrays["decoder/layers/fc1"].codec, ShardingIndexed)
    assert verify(ckpt).ok
    assert_bits_equal(load_plain_tensors(ckpt)["decoder/layers/fc1"], FC1)
