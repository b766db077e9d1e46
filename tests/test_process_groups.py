"""Saves and loads on a subgroup of the world, and fully-parallel loads (replicas share
the reads and exchange them)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardstore import CheckpointingException, ShardedTensor, load, save
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

SHAPE = (8, 6)


def _tp(key: str, rank: int, world: int, empty: bool) -> ShardedTensor:
    part = global_tensor(key, SHAPE, torch.float32).chunk(world)[rank]
    return ShardedTensor.from_rank_offsets(key, torch.empty_like(part) if empty else part.clone(), (0, rank, world))


def subgroups(rank: int, world: int, root: str) -> None:
    pair, solo = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group
    if rank < 2:  # ranks 0 and 1 save one checkpoint on their own group...
        save({"w": _tp("w", rank, 2, False)}, f"{root}/pair", process_group=pair)
    else:  # ...while rank 2 saves another alone
        save({"v": _tp("v", 0, 1, False)}, f"{root}/solo", process_group=solo)
    dist.barrier()
    if rank < 2:
        loaded = load({"v": _tp("v", rank, 2, True)}, f"{root}/solo", process_group=pair)
        assert_bits_equal(loaded["v"], global_tensor("v", SHAPE, torch.float32).chunk(2)[rank])
    else:
        loaded = load({"w": _tp("w", 0, 1, True)}, f"{root}/pair", process_group=solo)
        assert_bits_equal(loaded["w"], global_tensor("w", SHAPE, torch.float32))


def test_save_and_load_on_subgroups(tmp_path: Path) -> None:
    run_distributed(subgroups, 3, str(tmp_path))


def _replicated(rank: int, empty: bool) -> dict:
    sd = {}
    for i in range(6):
        full = global_tensor(f"norm{i}", (5 + i,), torch.bfloat16)
        sd[f"n{i}"] = ShardedTensor.from_rank_offsets(f"norm{i}", torch.empty_like(full) if empty else full.clone(),
                                                      replica_id=rank)
    return sd


def load_counting_reads(rank: int, world: int, ckpt: str) -> int:
    import shardstore.execution.load as load_execution

    read = []
    original = load_execution.load_tensors

    def counting(tensors, *args, **kwargs):
        read.extend(t.key for t in tensors)
        return original(tensors, *args, **kwargs)

    load_execution.load_tensors = counting
    if rank == 0:
        save(_replicated(0, False), ckpt, process_group=dist.new_group([0]))
    else:
        dist.new_group([0])
    dist.barrier()
    loaded = load(_replicated(rank, True), ckpt)
    for i in range(6):
        assert_bits_equal(loaded[f"n{i}"], global_tensor(f"norm{i}", (5 + i,), torch.bfloat16), f"n{i}")
    return len(read)


def test_fully_parallel_load_shares_the_reads(tmp_path: Path) -> None:
    counts = run_distributed(load_counting_reads, 2, str(tmp_path / "ckpt"))
    assert sorted(counts) == [3, 3], counts  # 6 replicated tensors: each rank read 3, got 3


def saved_by_every_rank_on_a_pair(rank: int, world: int, root: str) -> str:
    """Every rank calls ``save`` with the group of ranks 0 and 1, rank 2 too, which is
    not in it (``new_group`` gave it ``GroupMember.NON_GROUP_MEMBER``); returns what
    the save raised on this rank."""
    pair = dist.new_group([0, 1])
    part = min(rank, 1)
    try:
        save({"w": _tp("w", part, 2, False)}, f"{root}/ckpt{rank // 2}", process_group=pair)
    except CheckpointingException as exc:
        return str(exc)
    return "saved"


def test_a_rank_outside_the_process_group_is_told_so(tmp_path: Path) -> None:
    """Before: a rank outside the group failed with torch's bare "ValueError: Invalid
    process group specified", which names neither the group nor what to change."""
    results = run_distributed(saved_by_every_rank_on_a_pair, 3, str(tmp_path))
    assert results[:2] == ["saved", "saved"], results
    assert "Global rank 2 is not in the process group" in results[2], results[2]
    assert not (tmp_path / "ckpt1").exists()
