"""Save at one parallel layout, load at others: bit-exact (issue 3, point 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, save
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor, grid_shard

TENSORS = {
    "model/dense/weight": ((16, 12), torch.float32),
    "model/embedding": ((8, 20), torch.bfloat16),
    "model/bias": ((16,), torch.float16),
}


def _state_dict(rank: int, world: int, axes: dict[str, tuple[int, ...]], empty: bool) -> dict:
    return {
        name: grid_shard(name, global_tensor(name, shape, dtype), rank, world, axes.get(name, (0,)), empty=empty)
        for name, (shape, dtype) in TENSORS.items()
    }


def save_grid(rank: int, world: int, ckpt: str, axes: dict) -> None:
    save(_state_dict(rank, world, axes, empty=False), ckpt)


def load_grid(rank: int, world: int, ckpt: str, axes: dict) -> int:
    request = _state_dict(rank, world, axes, empty=True)
    loaded = load(request, ckpt)
    for name, (shape, dtype) in TENSORS.items():
        full = global_tensor(name, shape, dtype)
        assert_bits_equal(loaded[name], full[request[name].global_slice()], f"rank {rank} {name}")
    return len(loaded)


@pytest.mark.parametrize("load_world, load_axes", [(1, (0,)), (2, (1,)), (4, (0, 1))])
def test_tp_axis0_at_2_ranks_loads_at_other_layouts(ckpt_dir: Path, load_world: int, load_axes: tuple) -> None:
    run_distributed(save_grid, 2, str(ckpt_dir), {"model/embedding": (0,), "model/dense/weight": (0,)})
    axes = {"model/dense/weight": load_axes, "model/embedding": load_axes}
    assert run_distributed(load_grid, load_world, str(ckpt_dir), axes) == [3] * load_world


def test_tp_axis1_at_2_ranks_loads_split_along_axis0_at_4(ckpt_dir: Path) -> None:
    run_distributed(save_grid, 2, str(ckpt_dir), {"model/dense/weight": (1,), "model/embedding": (1,)})
    run_distributed(load_grid, 4, str(ckpt_dir), {"model/dense/weight": (0,), "model/embedding": (0,)})


def test_2d_grid_at_4_ranks_loads_at_1_2_and_4(ckpt_dir: Path) -> None:
    grid = {"model/dense/weight": (0, 1), "model/embedding": (1, 0)}
    run_distributed(save_grid, 4, str(ckpt_dir), grid)
    run_distributed(load_grid, 1, str(ckpt_dir), {})
    run_distributed(load_grid, 2, str(ckpt_dir), {"model/dense/weight": (1,), "model/embedding": (1,)})
    run_distributed(load_grid, 4, str(ckpt_dir), {"model/dense/weight": (1, 0), "model/embedding": (0, 1)})


def save_replicated(rank: int, world: int, ckpt: str) -> None:
    full = global_tensor("norm/weight", (33, 7), torch.float64)
    # Only the main replica writes: other replicas hold garbage that must not land.
    data = full.clone() if rank == 0 else torch.full_like(full, float(rank))
    sd = {"norm": ShardedTensor.from_rank_offsets("norm/weight", data, replica_id=rank)}
    save(sd, ckpt, ZarrSaveShardedStrategy(fully_parallel=False))


def load_replicated(rank: int, world: int, ckpt: str) -> None:
    request = {"norm": ShardedTensor.from_rank_offsets("norm/weight", torch.empty(33, 7, dtype=torch.float64), replica_id=rank)}
    assert_bits_equal(load(request, ckpt)["norm"], global_tensor("norm/weight", (33, 7), torch.float64))


def test_replicated_tensor_is_written_by_the_main_replica_only(ckpt_dir: Path) -> None:
    run_distributed(save_replicated, 2, str(ckpt_dir))
    run_distributed(load_replicated, 1, str(ckpt_dir))
    run_distributed(load_replicated, 4, str(ckpt_dir))


def save_rank_marked_replicas(rank: int, world: int, ckpt: str) -> None:
    """Four equal replicated tensors whose data says which rank holds it."""
    sd = {f"r{i}": ShardedTensor.from_rank_offsets(f"norm{i}", torch.full((64,), float(rank)), replica_id=rank)
          for i in range(4)}
    save(sd, ckpt)


def test_fully_parallel_save_spreads_replicated_writes_over_replicas(ckpt_dir: Path) -> None:
    run_distributed(save_rank_marked_replicas, 2, str(ckpt_dir))
    sd = {f"r{i}": ShardedTensor.from_rank_offsets(f"norm{i}", torch.empty(64)) for i in range(4)}
    loaded = run_distributed(_load_writers, 1, str(ckpt_dir), sd)[0]
    # balanced by bytes: two tensors written by each rank
    assert sorted(loaded) == [0.0, 0.0, 1.0, 1.0]


def _load_writers(rank: int, world: int, ckpt: str, sd: dict) -> list[float]:
    loaded = load(sd, ckpt)
    return [float(loaded[k][0]) for k in sorted(loaded) if bool((loaded[k] == loaded[k][0]).all())]


NUM_LAYERS, LAYER_SHAPE = 4, (6, 8)


def _stacked(rank: int, world: int, empty: bool, tp_axis: int | None) -> dict:
    """Layers split over ranks (pipeline style), each layer its own ShardedTensor with a
    prepended layer axis; with ``tp_axis``, each layer is also split over 2 TP ranks."""
    full = global_tensor("decoder/mlp", (NUM_LAYERS, *LAYER_SHAPE), torch.float32)
    tp = 2 if tp_axis is not None and world >= 2 else 1
    pp = world // tp
    pp_rank, tp_rank = rank // tp, rank % tp
    layers_per_rank = NUM_LAYERS // pp
    sd = {}
    for i in range(layers_per_rank):
        layer = pp_rank * layers_per_rank + i
        local = full[layer]
        offsets = [(0, layer, NUM_LAYERS)]
        if tp > 1:
            local = local.chunk(tp, tp_axis)[tp_rank]
            offsets.append((tp_axis + 1, tp_rank, tp))
        local = torch.empty_like(local) if empty else local.clone()
        sd[f"layer{layer}"] = ShardedTensor.from_rank_offsets("decoder/mlp", local, *offsets, prepend_axis_num=1)
    return sd


def save_stacked(rank: int, world: int, ckpt: str, tp_axis: int | None) -> None:
    save(_stacked(rank, world, False, tp_axis), ckpt)


def load_stacked(rank: int, world: int, ckpt: str, tp_axis: int | None) -> int:
    request = _stacked(rank, world, True, tp_axis)
    loaded = load(request, ckpt)
    full = global_tensor("decoder/mlp", (NUM_LAYERS, *LAYER_SHAPE), torch.float32)
    for name, sh in request.items():
        assert_bits_equal(loaded[name], full[sh.global_slice()], name)
    return len(loaded)


@pytest.mark.parametrize("load_world, load_tp_axis", [(1, None), (2, None), (4, 1)])
def test_stacked_layers_with_prepended_axis_reshard(ckpt_dir: Path, load_world: int, load_tp_axis) -> None:
    run_distributed(save_stacked, 4, str(ckpt_dir), 0)
    assert sum(run_distributed(load_stacked, load_world, str(ckpt_dir), load_tp_axis)) >= NUM_LAYERS


def test_saved_array_is_the_global_tensor_for_plain_zarr(ckpt_dir: Path) -> None:
    import zarr

    run_distributed(save_grid, 2, str(ckpt_dir), {"model/dense/weight": (1,)})
    arr = zarr.open_array(str(ckpt_dir / "model/dense/weight"), mode="r")
    assert arr.shape == (16, 12)
    expected = global_tensor("model/dense/weight", (16, 12), torch.float32)
    assert torch.equal(torch.from_numpy(arr[:]).view(torch.int32), expected.view(torch.int32))
    # chunk grid follows the sharding grid: two column blocks of 6
    assert arr.chunks == (16, 6)


def _layers(shape: tuple[int, int], data: torch.Tensor | None = None, mismatch: bool = False) -> dict:
    """One ShardedTensor per layer of a layer-stacked weight (the layer a prepended axis)."""
    return {"w": [ShardedTensor("w", data[i].clone() if data is not None else torch.empty(shape[1]), torch.float32,
                                (shape[1],), shape, (i, 0), (shape[0], 1), 0, 1, mismatch) for i in range(shape[0])]}


@pytest.mark.parametrize("wanted", [(4, 4), (4, 6), (3, 2)])
def test_allow_shape_mismatch_pads_layers_past_the_stored_ones_with_zeros(tmp_path: Path, wanted: tuple) -> None:
    """A layer-stacked weight (the layer a prepended axis) saved with 2 layers of 4,
    loaded with ``allow_shape_mismatch`` as more layers (or wider ones): the stored
    layers come back fitted to the requested width, the layers past them as zeros, as
    an offset past the stored extent of any other axis does. Before, such a layer failed
    the load with ``ValueError: cannot reshape array of size 4 into shape (0,4)`` (or
    ``RuntimeError: shape '[6]' is invalid for input of size 0``)."""
    stored = global_tensor("w", (2, 4), torch.float32)
    save(_layers((2, 4), stored), tmp_path / "ckpt")
    loaded = load(_layers(wanted, mismatch=True), tmp_path / "ckpt")["w"]
    expected = torch.zeros(wanted)
    common = (slice(0, min(2, wanted[0])), slice(0, min(4, wanted[1])))
    expected[common] = stored[common]
    for layer, tensor in enumerate(loaded):
        assert_bits_equal(tensor, expected[layer], f"layer {layer}")
