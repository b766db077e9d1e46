"""``dcp.load`` through ``ShardstoreReader`` with ``read_shards_once`` (from 32 ranks by
default) plans the ranks' reads together, as ``shardstore.load`` does
(``ZarrLoadShardedStrategy.plan_load``): a tensor every rank loads whole (DDP), and a
chunk that several ranks need rows of (FSDP2 over a whole-tensor checkpoint), is read by
one rank and sent to the others. Otherwise, as before, each rank reads every chunk its
request touches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardstore import ShardstoreReader, ShardstoreWriter, StorageLayout
from tests.dist import run_distributed
from tests.test_sharded_arrays import _count_chunk_reads

ARRAYS = 3
ROWS, COLS = 48, 8
# the tests count chunk reads: each tensor in a chunk file of its own, not a pack
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _whole(i: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (i + 1)


@pytest.fixture(scope="module")
def whole_tensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of whole tensors, one chunk each, saved by one process."""
    ckpt = tmp_path_factory.mktemp("dcp-read-once") / "ckpt"
    dcp.save({f"w{i}": _whole(i) for i in range(ARRAYS)}, storage_writer=ShardstoreWriter(ckpt, layout=PER_ARRAY))
    assert sorted(p.name for p in (ckpt / "w0").iterdir()) == ["c.0.0", "zarr.json"]
    return ckpt


def loaded_whole_counting_bytes(rank: int, world: int, ckpt: str, once: bool | str) -> int:
    """Every rank loads every tensor whole (as DDP); returns the bytes its chunk reads
    returned."""
    read = _count_chunk_reads()
    state = {f"w{i}": torch.zeros(ROWS, COLS) for i in range(ARRAYS)}
    dcp.load(state, storage_reader=ShardstoreReader(ckpt, read_shards_once=once))
    for i in range(ARRAYS):
        assert torch.equal(state[f"w{i}"], _whole(i)), (rank, i)
    return read[0]


def test_a_tensor_every_rank_loads_whole_is_read_once(whole_tensors: Path) -> None:
    read = run_distributed(loaded_whole_counting_bytes, 3, str(whole_tensors), True)
    chunk = (whole_tensors / "w0" / "c.0.0").stat().st_size
    assert sum(read) == ARRAYS * chunk, (read, chunk)
    each = run_distributed(loaded_whole_counting_bytes, 3, str(whole_tensors), "auto")  # below 32 ranks: off
    assert sum(each) == 3 * ARRAYS * chunk, (each, chunk)


def loaded_rows_counting_bytes(rank: int, world: int, ckpt: str, once: bool | str) -> int:
    """This rank's rows of each tensor as an FSDP2 DTensor (``Shard(0)``); returns the
    bytes its chunk reads returned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    read = _count_chunk_reads()
    mesh = init_device_mesh("cpu", (world,))
    state = {f"w{i}": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]) for i in range(ARRAYS)}
    dcp.load(state, storage_reader=ShardstoreReader(ckpt, read_shards_once=once))
    for i in range(ARRAYS):
        assert torch.equal(state[f"w{i}"].to_local(), _whole(i).chunk(world)[rank]), (rank, i)
    return read[0]


def test_with_read_shards_once_fsdp_ranks_read_each_chunk_once(whole_tensors: Path) -> None:
    chunk = (whole_tensors / "w0" / "c.0.0").stat().st_size
    once = run_distributed(loaded_rows_counting_bytes, 4, str(whole_tensors), True)
    assert sum(once) == ARRAYS * chunk, (once, chunk)
    each = run_distributed(loaded_rows_counting_bytes, 4, str(whole_tensors), "auto")  # below 32 ranks: off
    assert sum(each) == 4 * ARRAYS * chunk, (each, chunk)


def loaded_alone(rank: int, world: int, ckpt: str) -> bool:
    """Rank 0 loads by itself (``no_dist``) while the group is up; the others wait."""
    if rank == 0:
        state = {"w1": torch.zeros(ROWS, COLS)}
        dcp.load(state, storage_reader=ShardstoreReader(ckpt, read_shards_once=True), no_dist=True)
        assert torch.equal(state["w1"], _whole(1))
    dist.barrier()
    return True


def test_a_load_of_one_rank_alone_needs_no_other_rank(whole_tensors: Path) -> None:
    assert run_distributed(loaded_alone, 2, str(whole_tensors), timeout=60) == [True, True]


def loaded_on_a_subgroup_without_telling_the_reader(rank: int, world: int, ckpt: str) -> str:
    group = dist.new_group([0, 1])
    if rank >= 2:
        return ""
    state = {"w1": torch.zeros(ROWS, COLS)}
    with pytest.raises(CheckpointException) as caught:  # DCP's, holding the coordinator's
        dcp.load(state, storage_reader=ShardstoreReader(ckpt, read_shards_once=True), process_group=group)
    return str(caught.value)


def test_a_reader_on_another_group_than_the_load_is_refused_by_name(whole_tensors: Path) -> None:
    messages = run_distributed(loaded_on_a_subgroup_without_telling_the_reader, 3, str(whole_tensors), timeout=90)
    for message in messages[:2]:
        assert "ShardstoreReader(process_group=...)" in message and "2 ranks" in message, message


def loaded_with_each_ranks_own_setting(rank: int, world: int, ckpt: str) -> bool:
    """Rank 0 (DCP's coordinator) asks to plan together, rank 1 not: the coordinator's
    decision holds for both, so neither waits for the other."""
    state = {f"w{i}": torch.zeros(ROWS, COLS) for i in range(ARRAYS)}
    dcp.load(state, storage_reader=ShardstoreReader(ckpt, read_shards_once=rank == 0))
    return all(torch.equal(state[f"w{i}"], _whole(i)) for i in range(ARRAYS))


def test_the_coordinator_decides_for_every_rank_whether_they_plan_together(whole_tensors: Path) -> None:
    assert run_distributed(loaded_with_each_ranks_own_setting, 2, str(whole_tensors), timeout=60) == [True, True]


class _FailingOnRankOne(dcp.DefaultLoadPlanner):
    def resolve_tensor(self, read_item):  # noqa: ANN001, ANN201 - DCP's signature
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot place its tensor")
        return super().resolve_tensor(read_item)


def loaded_with_a_failure_on_rank_one(rank: int, world: int, ckpt: str) -> str:
    state = {"w0": torch.zeros(ROWS, COLS)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=ShardstoreReader(ckpt, read_shards_once=True), planner=_FailingOnRankOne())
    return str(caught.value)


def test_a_ranks_failure_in_making_its_request_fails_every_rank_at_once(whole_tensors: Path) -> None:
    messages = run_distributed(loaded_with_a_failure_on_rank_one, 2, str(whole_tensors), timeout=60, pg_timeout=30)
    for message in messages:
        assert "rank 1 cannot place its tensor" in message and "'w0'" in message, message


def loaded_on_a_subgroup_under_auto(rank: int, world: int, ckpt: str) -> tuple[bool, list[str]]:
    """As ``loaded_on_a_subgroup_without_telling_the_reader`` under ``"auto"``, its
    threshold lowered to 2 ranks: the ranks read alone, and the coordinator warns."""
    import logging

    import shardstore.compat.dcp.reader as dcp_reader
    import shardstore.engine.zarr_strategies as zarr_strategy

    zarr_strategy.AUTO_SHARD_MIN_RANKS = 2  # where reads_shards_once looks it up; this spawned rank's copy only
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    dcp_reader.logger.addHandler(handler)
    group = dist.new_group([0, 1])
    if rank >= 2:
        return True, []
    state = {"w1": torch.zeros(ROWS, COLS)}
    dcp.load(state, storage_reader=ShardstoreReader(ckpt), process_group=group)
    return torch.equal(state["w1"], _whole(1)), warnings


def test_under_auto_a_reader_on_another_group_reads_alone_with_a_warning(whole_tensors: Path) -> None:
    results = run_distributed(loaded_on_a_subgroup_under_auto, 3, str(whole_tensors), timeout=90)
    assert all(ok for ok, _ in results), results
    coordinator = results[0][1]
    assert any("ShardstoreReader(process_group=...)" in w and "reads what it needs" in w for w in coordinator), results
