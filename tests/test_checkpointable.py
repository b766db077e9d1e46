"""DCP interop: a Megatron-style sharded state dict saved by DCP, loaded by DCP at
another world size."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from shardstore import ShardedTensor
from shardstore.strategies.checkpointable import LocalShardsContainer, to_dcp_state_dict
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

FULL = global_tensor("dcp/w", (8, 6), torch.float32)
LAYERS = global_tensor("dcp/layers", (4, 3), torch.bfloat16)


def save_with_dcp(rank: int, world: int, ckpt: str) -> bool:
    sd = {"w": ShardedTensor.from_rank_offsets("dcp/w", FULL.chunk(world, 0)[rank].clone(), (0, rank, world))}
    for layer in (2 * rank, 2 * rank + 1):  # two stacked layers per rank -> LocalShardsContainer
        sd[f"layer{layer}"] = ShardedTensor.from_rank_offsets(
            "dcp/layers", LAYERS[layer].clone(), (0, layer, 4), prepend_axis_num=1
        )
    state = to_dcp_state_dict(sd)
    dcp.save(state, checkpoint_id=ckpt)
    return isinstance(state["dcp/layers"], LocalShardsContainer)


def load_with_dcp(rank: int, world: int, ckpt: str) -> None:
    local = torch.zeros(8 // world, 6)
    dcp.load(to_dcp_state_dict({"w": ShardedTensor.from_rank_offsets("dcp/w", local, (0, rank, world))}),
             checkpoint_id=ckpt)
    assert_bits_equal(local, FULL.chunk(world, 0)[rank], "w")
    plain = {"dcp/layers": torch.zeros(4, 3, dtype=torch.bfloat16)}
    dcp.load(plain, checkpoint_id=ckpt)
    assert_bits_equal(plain["dcp/layers"], LAYERS, "layers")


def test_dcp_saves_sharded_state_dict_and_loads_at_other_world_sizes(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "dcp")
    assert run_distributed(save_with_dcp, 2, ckpt) == [True, True]
    run_distributed(load_with_dcp, 4, ckpt)
    run_distributed(load_with_dcp, 1, ckpt)
