"""Issue 31.4: what Megatron-Core's own unit tests ask of the names and messages (they
run against shardstore with megatron-core's modules swapped for ours)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedTensor,
    load,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from shardstore.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy


def test_an_empty_directory_is_not_a_distributed_checkpoint(tmp_path: Path) -> None:
    """Megatron's test_load_error_msg: its words for a missing and an empty directory."""
    request = {"some_key": ShardedTensor.from_rank_offsets("keyA", torch.rand(10))}
    with pytest.raises(CheckpointingException, match=f"directory {tmp_path / 'missing'} does not exist"):
        load(request, tmp_path / "missing")
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint") as error:
        load(request, tmp_path)
    assert str(tmp_path) in str(error.value) and "empty" in str(error.value)


def test_torch_dist_strategy_names_are_shardstores_strategies(tmp_path: Path, caplog) -> None:
    """Megatron's test_remove_sharded_tensors builds ``TorchDistSaveShardedStrategy("torch_dist",
    1, separation_hint=...)``: the name saves shardstore's format (the option, which
    shapes torch_dist's files, is logged as not applied) and its load twin reads it."""
    state = {
        "a": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 4)),
        "p": ShardedTensor.from_rank_offsets("prefix_key_to_remove", torch.ones(3, 5, 7)),
    }
    with caplog.at_level(logging.INFO, logger="shardstore.compat.megatron.strategies.torch"):
        save(state, tmp_path / "ckpt", TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="prefix"))
    assert "separation_hint" in caplog.text
    remove_sharded_tensors(tmp_path / "ckpt", key_prefix="prefix")
    assert sorted(load_tensors_metadata(tmp_path / "ckpt")) == ["keyA"]
    request = {"a": ShardedTensor.from_rank_offsets("keyA", torch.zeros(2, 4))}
    loaded = load(request, tmp_path / "ckpt", TorchDistLoadShardedStrategy())
    assert torch.equal(loaded["a"], torch.ones(2, 4))


def test_strategies_named_by_backend_and_version_save_and_load(tmp_path: Path) -> None:
    """Megatron-Core's ``save``, ``load`` and the queries take a strategy as an object or
    as a ``(backend, version)`` tuple naming a registered default. Before, every tuple
    raised a bare ``AttributeError: 'tuple' object has no attribute 'backend'`` (or
    ``'check_backend_compatibility'``)."""
    ckpt = tmp_path / "ckpt"
    save({"a": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 4))}, ckpt, ("zarr", 1), ("torch", 1))
    request = {"a": ShardedTensor.from_rank_offsets("keyA", torch.zeros(2, 4))}
    loaded = load(request, ckpt, ("shardstore", 1), ("torch", 1))
    assert torch.equal(loaded["a"], torch.ones(2, 4))
    assert load_tensors_metadata(ckpt, ("zarr", 1))["keyA"].global_shape == (2, 4)
    with pytest.raises(CheckpointingException, match=r"known \(backend, version\) pairs"):
        save({"a": ShardedTensor.from_rank_offsets("keyA", torch.ones(2))}, tmp_path / "other", ("torch_dist", 7))
    with pytest.raises(TypeError, match=r"\('zarr', 1\)"):
        load(request, ckpt, "zarr")


def save_and_load_on_the_strategies_group(rank: int, world: int, root: str) -> list[float]:
    """Each rank alone saves and loads its own checkpoint, on a group of one named only
    by the strategies (``process_group=``, as the seed's strategies take it)."""
    import torch.distributed as dist

    from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy

    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    ckpt = f"{root}/ckpt{rank}"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(rank)))}, ckpt,
         ZarrSaveShardedStrategy(process_group=alone))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    return load(request, ckpt, ZarrLoadShardedStrategy(process_group=alone))["w"].tolist()


def test_save_and_load_run_on_the_process_group_their_strategy_names(tmp_path: Path) -> None:
    """``ZarrSaveShardedStrategy(process_group=...)`` and its load twin name the ranks that
    save or load together. ``save`` and ``load`` ignored it and ran on the whole world:
    two groups saving their own checkpoints failed ("The ranks name different
    checkpoint directories"), and one group saving alone would wait for the others."""
    from tests.dist import run_distributed

    assert run_distributed(save_and_load_on_the_strategies_group, 2, str(tmp_path), timeout=90) == [
        [0.0] * 4, [1.0] * 4]


def test_megatrons_default_save_backend_names_shardstores_strategy(tmp_path: Path) -> None:
    """Megatron-Core's default save backend is ``("torch_dist", 1)``: Megatron-LM asks
    ``get_default_save_sharded_strategy(args.ckpt_format)`` and code passes the tuple to
    ``save``. ``strategies.torch`` names shardstore's strategy ``TorchDistSaveShardedStrategy``,
    but before, only the load side was registered under that name: both calls raised
    "No default strategy for save_sharded with backend 'torch_dist' version 1"."""
    from shardstore.serialization import get_default_save_sharded_strategy

    assert isinstance(get_default_save_sharded_strategy("torch_dist"), TorchDistSaveShardedStrategy)
    ckpt = tmp_path / "ckpt"
    save({"a": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 4))}, ckpt, ("torch_dist", 1))
    loaded = load({"a": ShardedTensor.from_rank_offsets("keyA", torch.zeros(2, 4))}, ckpt)
    assert torch.equal(loaded["a"], torch.ones(2, 4))
