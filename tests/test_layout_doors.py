"""Every door takes the storage layout whole, and its older keywords are spellings of
one (``StorageLayout.of``): the same layout either way, and a keyword that contradicts
the layout it is given with is refused where the door is built, naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from shardstore import CheckpointingException, SaveOptions, ShardstoreWriter, StorageLayout
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from shardstore.tools.array_writer import CheckpointWriter

MiB = 1 << 20


def _megatron_install(**keywords: Any) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing.strategies.fully_parallel", reason="megatron-core not installed")
    import shardstore.megatron as shardstore_megatron

    shardstore_megatron.install(**keywords)


# door -> (build it with keywords, a layout and the keyword contradicting it)
DOORS: dict[str, tuple[Callable[..., Any], StorageLayout, dict[str, Any]]] = {
    "SaveOptions": (SaveOptions, StorageLayout(pack_arrays_up_to=4096), {"pack_arrays_up_to": 8192}),
    "ZarrSaveShardedStrategy": (ZarrSaveShardedStrategy, StorageLayout(shard_bytes=MiB), {"shard_bytes": 2 * MiB}),
    "ShardstoreWriter": (lambda **kw: ShardstoreWriter("unused", **kw), StorageLayout(shard_bytes=MiB),
                         {"shard_bytes": 2 * MiB}),
    "install": (_megatron_install, StorageLayout(zarr_metadata="per_node"), {"zarr_metadata": "consolidated_only"}),
    "CheckpointWriter": (lambda **kw: CheckpointWriter(kw.pop("tmp") / "ckpt", **kw),
                         StorageLayout(max_chunk_bytes=MiB), {"max_chunk_bytes": 2 * MiB}),
}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_keyword_contradicting_the_layout_is_refused_at_construction_naming_the_field(
    door: str, tmp_path: Path,
) -> None:
    build, layout, keyword = DOORS[door]
    extra = {"tmp": tmp_path} if door == "CheckpointWriter" else {}
    (field,) = keyword
    with pytest.raises(ValueError, match=f"{field}=.* and {field}=.*pass one of them"):
        build(layout=layout, **keyword, **extra)
    assert not (tmp_path / "ckpt").exists()


def test_the_writer_given_a_layout_equals_the_writer_given_its_keywords() -> None:
    by_keywords = ShardstoreWriter("unused", shard_bytes=MiB, pack_arrays_up_to=4096, zarr_metadata="per_node")
    by_layout = ShardstoreWriter("unused", layout=StorageLayout(shard_bytes=MiB, pack_arrays_up_to=4096,
                                                                zarr_metadata="per_node"))
    assert by_keywords.layout == by_layout.layout
    assert ShardstoreWriter("unused").layout == StorageLayout()  # every field left to choose
    # a keyword the layout agrees with is no contradiction
    assert ShardstoreWriter("unused", layout=by_layout.layout, shard_bytes=MiB).layout == by_layout.layout


def test_the_array_writer_takes_its_chunk_bound_from_the_layout(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "ckpt", layout=StorageLayout(max_chunk_bytes=1024))
    record = writer.write_array("w", torch.arange(1024, dtype=torch.float32))
    writer.commit()
    assert writer.max_chunk_bytes == 1024 and record.chunk_shape == (256,)
    assert torch.equal(shardstore.load_plain_tensors(tmp_path / "ckpt")["w"], torch.arange(1024, dtype=torch.float32))


def test_install_given_a_layout_equals_install_given_its_keywords() -> None:
    pytest.importorskip("megatron.core.dist_checkpointing.strategies.fully_parallel", reason="megatron-core not installed")
    import shardstore.megatron as shardstore_megatron
    from shardstore.compat.megatron import entry_points

    try:
        shardstore_megatron.install(shard_bytes=MiB, pack_arrays_up_to=4096)
        by_keywords = entry_points._installation.layout
        shardstore_megatron.install(layout=StorageLayout(shard_bytes=MiB, pack_arrays_up_to=4096))
        assert entry_points._installation.layout == by_keywords == StorageLayout(shard_bytes=MiB, pack_arrays_up_to=4096)
        assert entry_points.strategy_for_save(None).layout == StorageLayout()  # the options carry it all
        assert entry_points._save_layout(None) == StorageLayout(shard_bytes=MiB, pack_arrays_up_to=4096)
        ours = ZarrSaveShardedStrategy(shard_bytes=2 * MiB)  # a caller's own carries its sizes
        assert entry_points._save_layout(ours) == StorageLayout(pack_arrays_up_to=4096)
    finally:
        shardstore_megatron.uninstall()


def test_the_manager_hands_its_layout_to_each_save_and_refuses_a_contradicting_one(tmp_path: Path) -> None:
    from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions

    options = CheckpointManagerOptions(layout=StorageLayout(max_chunk_bytes=1024), reuse_unchanged=False)
    manager = CheckpointManager(tmp_path, options)
    try:
        state = {"w": shardstore.ShardedTensor.from_rank_offsets("w", torch.arange(1024, dtype=torch.float32))}
        assert manager.save(1, state)
        with pytest.raises(CheckpointingException, match="max_chunk_bytes=2 KiB and max_chunk_bytes=1 KiB"):
            manager.save(2, state, options=SaveOptions(layout=StorageLayout(max_chunk_bytes=2048)))
    finally:
        manager.close()
    record = shardstore.format.read_commit_record(manager.location(1))
    assert record.arrays["w"].chunk_shape == (256,)
    with pytest.raises(ValueError, match="layout must be a StorageLayout"):
        CheckpointManagerOptions(layout={"shard_bytes": MiB})  # type: ignore[arg-type]


def _plans(members: list[tuple[int, int] | None]) -> list:
    from torch.distributed.checkpoint.planner import SavePlan

    from shardstore.compat.dcp.parts import HeldPlainTensors

    return [SavePlan(items=[], storage_data=HeldPlainTensors((), (), member)) for member in members]


def test_the_dcp_writer_shards_by_default_from_32_ranks_where_they_can_exchange(tmp_path: Path) -> None:
    from shardstore.format.storage_layout import AUTO_SHARD_MIN_RANKS, DEFAULT_SHARD_BYTES

    writer = ShardstoreWriter(tmp_path / "ckpt")
    many = AUTO_SHARD_MIN_RANKS
    layout, exchange = writer._chosen(_plans([(rank, many) for rank in range(many)]))
    assert layout.chosen and layout.shard_bytes == DEFAULT_SHARD_BYTES and exchange
    # a group whose ranks are not DCP's: "auto" chooses no shards, an explicit size is refused
    layout, exchange = writer._chosen(_plans([None] * many))
    assert layout.shard_bytes is None and not exchange
    with pytest.raises(CheckpointingException, match="not DCP's"):
        ShardstoreWriter(tmp_path / "ckpt", shard_bytes=MiB)._chosen(_plans([None] * 2))
    layout, exchange = writer._chosen(_plans([(0, 2), (1, 2)]))
    assert layout.shard_bytes is None and exchange  # below 32 ranks: no shards, small split arrays gathered to packs
    unpacked = ShardstoreWriter(tmp_path / "ckpt", layout=StorageLayout(pack_arrays_up_to=0))
    layout, exchange = unpacked._chosen(_plans([(0, 2), (1, 2)]))
    assert layout.shard_bytes is None and not exchange  # nothing to gather: each rank writes its own blocks
