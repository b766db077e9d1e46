"""Issue 25.1: DTensors as input to ``shardstore.save`` / ``load`` (``shardstore.inputs.dtensors``).

Real ``fully_shard`` models with AdamW on gloo ranks (``tests.fsdp_models``): a 2-D FSDP x
TP mesh at 4 ranks, resharded to 1-D FSDP at 2 ranks, to 1 rank and back to 4, each
load bit-exact against the same state saved by DCP's own ``FileSystemWriter``, and the
next training step from our checkpoint the same as from DCP's. The 4-rank state also goes
through DCP's API onto our format (``shardstore.ShardstoreWriter``) and loads resharded. The block arithmetic
(uneven, empty and strided shards) is checked without ranks.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardstore
from shardstore import CheckpointingException, ShardedTensor, ShardstoreReader, ShardstoreWriter
from shardstore.inputs.dtensors import blocks_at
from tests import fsdp_models as fm
from tests.dist import run_distributed

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

# ------------------------------------------------------------ block arithmetic, no ranks

PLACEMENTS = [
    ((7, 5), (4,), (Shard(0),)),  # uneven: 2+2+2+1
    ((5, 3), (4,), (Shard(0),)),  # uneven with an empty shard: 2+2+1+0
    ((6, 9), (4,), (Shard(1),)),  # uneven along an inner axis
    ((6, 4), (2, 2), (Shard(0), Shard(1))),
    ((10, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 over ColwiseParallel
    ((10, 6), (2,), (_StridedShard(0, split_factor=2),)),  # rows not consecutive: 2 blocks a rank
    ((9, 4), (3, 2), (_StridedShard(0, split_factor=2), Replicate())),
    ((5, 10), (2, 2), (Shard(0), Shard(1))),
    ((5,), (2, 2), (Shard(0), Replicate())),
    ((), (3,), (Replicate(),)),
]


@pytest.mark.parametrize("global_shape, mesh_shape, placements", PLACEMENTS, ids=str)
def test_main_replica_blocks_tile_the_global_tensor_once(global_shape, mesh_shape, placements) -> None:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    covered = torch.zeros(global_shape, dtype=torch.int32)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        blocks = blocks_at(global_shape, mesh_shape, coordinate, placements)
        local_shape, _ = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), placements)
        local = torch.zeros(local_shape, dtype=torch.int32)
        for block in blocks:  # the blocks partition the local shard...
            local[block.local_index] += 1
        assert bool((local == 1).all()), (coordinate, blocks)
        main = all(c == 0 for c, p in zip(coordinate, placements) if p.is_replicate())
        for block in blocks if main else ():  # ...and the main replicas the global tensor
            index = tuple(slice(o, o + n) for o, n in zip(block.global_offset, block.shape))
            covered[index] += 1
    assert bool((covered == 1).all()), covered


def test_strided_rows_that_are_not_consecutive_become_one_block_per_run() -> None:
    blocks = blocks_at((10, 6), (2,), (1,), (_StridedShard(0, split_factor=2),))
    assert [(b.global_offset, b.local_index[0]) for b in blocks] == [((3, 0), slice(0, 2)), ((8, 0), slice(2, 4))]


# --------------------------------------------------------------- real FSDP2 / FSDP x TP


def _fresh(world: int, mesh_shape: tuple[int, ...] | None) -> tuple:
    """A model with other weights and optimizer state than the saved one (so a load
    that missed anything shows)."""
    model, optimizer = fm.build(world, mesh_shape, seed=world + 7)
    fm.train_step(model, optimizer, 99)
    return model, optimizer


def _load_ours_and_dcps(world: int, mesh_shape: tuple[int, ...] | None, ours: str, dcps: str) -> tuple:
    """Two fresh models at this layout, one loaded from our checkpoint through
    ``shardstore.load``, the other from DCP's through ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _fresh(world, mesh_shape)
    request = fm.state_dict(model, optimizer)
    before = {k: v.to_local().data_ptr() for k, v in request["model"].items()}
    loaded = shardstore.load(request, ours)
    assert all(loaded["model"][k] is request["model"][k] for k in before), "load returns the request's DTensors"
    assert {k: v.to_local().data_ptr() for k, v in loaded["model"].items()} == before, "filled in place"
    fm.apply(model, optimizer, loaded)
    reference, ref_optimizer = _fresh(world, mesh_shape)
    ref_state = fm.state_dict(reference, ref_optimizer)
    dcp.load(ref_state, storage_reader=dcp.FileSystemReader(dcps))
    fm.apply(reference, ref_optimizer, ref_state)
    return (model, optimizer), (reference, ref_optimizer)


def _same_state_and_next_step(ours: tuple, dcps: tuple, saved: bytes) -> None:
    """Bit-exact: the state loaded from ours is DCP's (and the saved one), and the next
    step from each is the same."""
    state, ref_state = fm.full_values(fm.state_dict(*ours)), fm.full_values(fm.state_dict(*dcps))
    fm.assert_same(state, ref_state)
    fm.assert_same(state, fm.from_bytes(saved))
    fm.train_step(*ours, 1)
    fm.train_step(*dcps, 1)
    fm.assert_same(fm.full_values(fm.state_dict(*ours)), fm.full_values(fm.state_dict(*dcps)))


def save_2d_at_4(rank: int, world: int, root: str) -> bytes:
    """FSDP x TP (2 x 2), one AdamW step, saved by shardstore and by DCP."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = fm.build(world, (2, 2))
    fm.train_step(model, optimizer, 0)
    state = fm.state_dict(model, optimizer)
    placements = {str(v.placements) for v in state["model"].values()}
    assert any("_StridedShard" in p for p in placements) and any("Replicate" in p for p in placements), placements
    shardstore.save(state, f"{root}/ours-4")
    assert all(type(v).__name__ == "DTensor" for v in state["model"].values()), "save leaves the caller's dict"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp-4"))
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/dcp-api-4"))  # our format through DCP's API
    return fm.to_bytes(fm.full_values(state))


def reshard_to_2(rank: int, world: int, root: str, saved: bytes) -> None:
    """1-D FSDP at 2 ranks loads the 4-rank checkpoints; saves ours again."""
    import torch.distributed.checkpoint as dcp

    ours, dcps = _load_ours_and_dcps(world, None, f"{root}/ours-4", f"{root}/dcp-4")
    through_dcp, optimizer = _fresh(world, None)  # DCP's planner reshards our format too
    dcp.load(state := fm.state_dict(through_dcp, optimizer), storage_reader=ShardstoreReader(f"{root}/dcp-api-4"))
    fm.apply(through_dcp, optimizer, state)
    fm.assert_same(fm.full_values(fm.state_dict(through_dcp, optimizer)), fm.from_bytes(saved))
    shardstore.save(fm.state_dict(*ours), f"{root}/ours-2")
    dcp.save(fm.state_dict(*dcps), storage_writer=dcp.FileSystemWriter(f"{root}/dcp-2"))
    _same_state_and_next_step(ours, dcps, saved)


def reshard_to_1(rank: int, world: int, root: str, saved: bytes) -> None:
    """One rank loads the 2-rank checkpoints; saves ours again."""
    import torch.distributed.checkpoint as dcp

    ours, dcps = _load_ours_and_dcps(world, None, f"{root}/ours-2", f"{root}/dcp-2")
    fm.assert_same(fm.full_values(fm.state_dict(*ours)), fm.from_bytes(saved))
    fm.assert_same(fm.full_values(fm.state_dict(*dcps)), fm.from_bytes(saved))
    shardstore.save(fm.state_dict(*ours), f"{root}/ours-1")
    dcp.save(fm.state_dict(*dcps), storage_writer=dcp.FileSystemWriter(f"{root}/dcp-1"))


def back_to_4(rank: int, world: int, root: str, saved: bytes) -> None:
    """1-D FSDP at 4 ranks (uneven and empty shards) loads the 1-rank checkpoints."""
    ours, dcps = _load_ours_and_dcps(world, None, f"{root}/ours-1", f"{root}/dcp-1")
    _same_state_and_next_step(ours, dcps, saved)


def _check_ours(ckpt: Path) -> None:
    """Our checkpoint verifies and names its arrays by fully qualified name; ``step`` and
    the param groups are in its common state."""
    report = shardstore.verify(ckpt)
    assert report.ok, report
    arrays = shardstore.load_tensors_metadata(ckpt)
    assert "model.0.weight" in arrays and "optim.state.2.bias.exp_avg_sq" in arrays, sorted(arrays)
    assert arrays["model.0.weight"].global_shape == (fm.HIDDEN, fm.IN)
    common = shardstore.load_common_state_dict(ckpt)
    assert common["optim"]["param_groups"][0]["lr"] == 0.05 and common["optim"]["state"]["0.weight"]["step"] == 1


def test_fsdp_tp_at_4_ranks_loads_as_fsdp_at_2_bit_exact_with_dcp(tmp_path: Path) -> None:
    saved = run_distributed(save_2d_at_4, 4, str(tmp_path))[0]
    run_distributed(reshard_to_2, 2, str(tmp_path), saved)
    _check_ours(tmp_path / "ours-4")
    _check_ours(tmp_path / "dcp-api-4")


@pytest.mark.slow
def test_fsdp_tp_reshards_4_2_1_and_back_bit_exact_with_dcp(tmp_path: Path) -> None:
    saved = run_distributed(save_2d_at_4, 4, str(tmp_path))[0]
    run_distributed(reshard_to_2, 2, str(tmp_path), saved)
    run_distributed(reshard_to_1, 1, str(tmp_path), saved)
    run_distributed(back_to_4, 4, str(tmp_path), saved)
    for ckpt in ("ours-4", "ours-2", "ours-1"):
        _check_ours(tmp_path / ckpt)


# ------------------------------------------------- mixed state dicts, placements, Partial


def mixed(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weight, norm = torch.arange(35.0).reshape(5, 7), torch.arange(7, dtype=torch.bfloat16)
    state = {
        "model": {
            "w": distribute_tensor(weight, mesh, [Shard(1)]),  # uneven along axis 1: 4 + 3
            "norm": distribute_tensor(norm, mesh, [Replicate()]),
        },
        "sharded": ShardedTensor.from_rank_offsets("tp/fc", torch.full((2, 3), float(rank)), (0, rank, world)),
        "iteration": 7,
    }
    shardstore.save(state, f"{root}/mixed")
    names = set(shardstore.load_tensors_metadata(f"{root}/mixed"))
    assert names == {"model.w", "model.norm", "tp/fc"}, names

    request = {  # other placements: w by rows, norm sharded
        "model": {
            "w": distribute_tensor(torch.zeros(5, 7), mesh, [Shard(0)]),
            "norm": distribute_tensor(torch.zeros(7, dtype=torch.bfloat16), mesh, [Shard(0)]),
        },
        "sharded": ShardedTensor.from_rank_offsets("tp/fc", torch.empty(4, 3), replica_id=rank),
    }
    local_w = request["model"]["w"].to_local()
    loaded = shardstore.load(request, f"{root}/mixed")
    assert loaded["model"]["w"] is request["model"]["w"] and isinstance(loaded["model"]["w"], DTensor)
    assert torch.equal(local_w, weight.tensor_split(world)[rank])
    assert torch.equal(loaded["model"]["w"].full_tensor(), weight)
    assert torch.equal(loaded["model"]["norm"].full_tensor(), norm)
    assert torch.equal(loaded["sharded"], torch.arange(world).repeat_interleave(2)[:, None].float().expand(4, 3))
    assert loaded["iteration"] == 7

    partial = {"grad": DTensor.from_local(torch.ones(3), mesh, [Partial()])}
    with pytest.raises(CheckpointingException, match=r"'grad' has a Partial placement"):
        shardstore.save(partial, f"{root}/partial")
    with pytest.raises(CheckpointingException, match=r"'grad' has a Partial placement.*to load into it, request"):
        shardstore.load({"grad": DTensor.from_local(torch.ones(3), mesh, [Partial()])}, f"{root}/mixed")
    dist.barrier()


def test_dtensors_beside_sharded_tensors_and_plain_values_reshard_between_placements(tmp_path: Path) -> None:
    run_distributed(mixed, 2, str(tmp_path))


# ------------------------------------------------------------------- non-strict loads


def load_with_a_dtensor_the_checkpoint_lacks(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weight = torch.arange(35.0).reshape(5, 7)
    shardstore.save({"model": {"w": distribute_tensor(weight, mesh, [Shard(0)])}}, f"{root}/ckpt")
    request = {"model": {
        "w": distribute_tensor(torch.zeros(5, 7), mesh, [Shard(1)]),
        "head": distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]),  # a new layer: not in the checkpoint
    }}
    loaded, missing, unexpected = shardstore.load(request, f"{root}/ckpt", strict="return_all")
    assert unexpected == {"model.head"} and missing == set(), (missing, unexpected)
    assert torch.equal(loaded["model"]["w"].full_tensor(), weight)
    assert "head" not in loaded["model"], "a key the checkpoint lacks is left out, as for a ShardedTensor"
    assert torch.equal(request["model"]["head"].full_tensor(), torch.ones(4, 3)), "its DTensor is left as it was"


def test_a_non_strict_load_leaves_out_a_dtensor_the_checkpoint_lacks(tmp_path: Path) -> None:
    """A non-strict load (``strict="return_all"``, ``"log_all"``...) of a request holding
    a DTensor the checkpoint lacks (fine-tuning with a new head) failed on the ranks that
    asked for it before 667c292: the DTensor's factory merge found its key gone ("the
    state dict's containers do not match the checkpoint's common state"). The key is
    left out of the result, as any other key the checkpoint lacks, and reported."""
    run_distributed(load_with_a_dtensor_the_checkpoint_lacks, 2, str(tmp_path))


# --------------------------------------------- a DTensor on a mesh repeated over other ranks


def tp_submesh_replicated_over_dp(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    tp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))["tp"]  # TP + DDP
    weight = torch.arange(35.0).reshape(5, 7)
    shardstore.save({"w": distribute_tensor(weight, tp, [Shard(0)])}, f"{root}/ckpt")
    request = {"w": distribute_tensor(torch.zeros(5, 7), tp, [Shard(1)])}
    shardstore.load(request, f"{root}/ckpt")
    assert torch.equal(request["w"].full_tensor(), weight)


def test_a_dtensor_on_a_tp_mesh_repeated_over_dp_ranks_saves_and_loads(tmp_path: Path) -> None:
    """TP + DDP: each DP group holds the same DTensor on its own TP submesh
    (``mesh["tp"]``). DCP deduplicates the equal blocks (``dcp.save`` through
    ``ShardstoreWriter`` saved this), but ``shardstore.save`` and ``shardstore.load``
    refused it: every DP group's blocks were main replicas ("covered by more than one
    main replica (overlap)"), and the error told a DTensor user to set replica ids
    they cannot set."""
    run_distributed(tp_submesh_replicated_over_dp, 4, str(tmp_path))


def tp_copies_that_differ(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    tp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))["tp"]
    stage = rank // (world // 2)
    copies = [torch.arange(48.0).reshape(8, 6) + 100 * s for s in range(2)]  # each stage's own values
    state = {name: distribute_tensor(copies[stage] + i, tp, [Shard(0)]) for i, name in enumerate(("a", "b"))}
    shardstore.save(state, f"{root}/ckpt")  # accepted: the values are not compared, as DCP does not
    request = {name: distribute_tensor(torch.zeros(8, 6), tp, [Shard(0)]) for name in state}
    shardstore.load(request, f"{root}/ckpt")
    for i, name in enumerate(("a", "b")):
        rows = request[name].to_local()
        held = [c[rows.shape[0] * (rank % 2) :][: rows.shape[0]] + i for c in copies]
        assert any(torch.equal(rows, h) for h in held), (name, rows)  # each block: one stage's copy, whole
    dist.barrier()


def test_dtensor_copies_whose_values_differ_save_one_copy_of_each_block(tmp_path: Path) -> None:
    """Equal blocks of a DTensor on several ranks are replicas whatever their values
    (``docs/guide/dcp-fsdp2.md``): pipeline stages that name their DTensors alike, each
    on its own ``mesh["tp"]``, or DP groups out of step, save without an error, each
    block from one of its copies. The docs said only "saved once"; they now say that
    the values are not compared (as DCP's deduplication does not compare them)."""
    run_distributed(tp_copies_that_differ, 4, str(tmp_path))


# ------------------------------------------------------- names that clash once flattened


def names_that_clash_once_flattened(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weight = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    clashing = {
        "plain": {"model": {"w": weight}, "model.w": 5},
        "dtensors": {"model.w": weight, "model": {"w": weight}},
        "in a list": {"layers": [weight], "layers.0": "x"},
    }
    for name, state in clashing.items():
        with pytest.raises(CheckpointingException) as refused:
            shardstore.save(state, f"{root}/{name}")
        message = str(refused.value)
        assert "['model']['w']" in message or "['layers'][0]" in message, message
        assert "['model.w']" in message or "['layers.0']" in message, message
        assert "rename" in message, message
        assert not Path(f"{root}/{name}").exists() or not any(Path(f"{root}/{name}").iterdir()), name
    # a list of plain values is one value to DCP, as a dotted key beside it is not its element
    shardstore.save({"model": {"w": weight}, "steps": [1, 2], "steps.0": 3}, f"{root}/fine")
    dist.barrier()


def test_names_that_clash_once_flattened_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A DTensor at ``{"model": {"w": ...}}`` beside a plain value at the key ``"model.w"``
    was committed by ``shardstore.save``, though both have the fully qualified name
    ``model.w``: ``dcp.save`` refuses such a state ("duplicated flatten key") and
    ``dcp.load`` through ``ShardstoreReader`` could not read the checkpoint."""
    run_distributed(names_that_clash_once_flattened, 2, str(tmp_path))
