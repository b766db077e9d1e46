"""Issue 16.3: the checkpoint manager saves on schedule, keeps the last K and every
M-th step, restarts from the latest committed step, and deletes only its own
checkpoints, only after a newer one committed (sync and async, 1 and 2 ranks; S3 in
test_s3.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardstore import CheckpointingException
from shardstore.manager import CheckpointManager, CheckpointManagerOptions, steps_to_delete
from tests.dist import run_distributed
from tests.scenarios import global_tensor, grid_shard

RETENTION = CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2, keep_period=4)


def _state(step: int, rank: int = 0, world: int = 1, empty: bool = False) -> dict:
    full = global_tensor("w", (8, 4), torch.float32) + step
    return {"w": grid_shard("w", full, rank, world, (0,), empty=empty), "step": step}


@pytest.mark.parametrize(
    ("committed", "expected"),
    [
        ([0, 2, 4, 6, 8, 10], [2, 6]),  # newest 2 (8, 10) and multiples of 4 (0, 4, 8) stay
        ([10], []),
        ([], []),
        ([3, 5, 7], [3]),
    ],
)
def test_retention_keeps_the_newest_and_every_period(committed: list[int], expected: list[int]) -> None:
    assert steps_to_delete(committed, RETENTION) == expected


def test_retention_never_deletes_the_newest_step() -> None:
    options = CheckpointManagerOptions(max_to_keep=1, keep_period=1000)
    assert steps_to_delete([1, 2, 3], options) == [1, 2]


def test_saves_on_schedule_and_keeps_what_retention_says(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, RETENTION)
    saved = [step for step in range(11) if manager.save(step, _state(step))]
    assert saved == [0, 2, 4, 6, 8, 10]
    assert manager.all_steps() == [0, 4, 8, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000000", "iter_0000004", "iter_0000008", "iter_0000010"]
    assert manager.latest_step() == 10
    restored = manager.restore(_state(0, empty=True))
    assert torch.equal(restored["w"], global_tensor("w", (8, 4), torch.float32) + 10)
    assert restored["step"] == 10
    assert manager.save(11, _state(11), force=True)
    assert manager.all_steps() == [0, 4, 8, 10, 11]  # 10 is one of the two newest again


def test_restart_finds_the_latest_committed_step_skipping_incomplete_ones(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, RETENTION)
    for step in (0, 2):
        manager.save(step, _state(step))
    # a save of step 4 that died before its commit: its staging directory and a step
    # directory whose commit record was never written
    (tmp_path / ".iter_0000004.shardstore-save-0123abcd").mkdir()
    (tmp_path / "iter_0000006").mkdir()
    (tmp_path / "iter_0000006" / "metadata.json").write_text("{}")
    # a newer step whose commit record is damaged
    (tmp_path / "iter_0000008").mkdir()
    (tmp_path / "iter_0000008" / "zarr.json").write_text("{not json")

    restarted = CheckpointManager(tmp_path, RETENTION)
    assert restarted.latest_step() == 2
    assert restarted.restore(_state(0, empty=True))["step"] == 2


def test_retention_never_deletes_what_it_cannot_prove_is_a_shardstore_checkpoint(tmp_path: Path) -> None:
    foreign = tmp_path / "iter_0000001"  # named like a step, but a zarr v3 group of another tool
    foreign.mkdir()
    (foreign / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    (foreign / "data.bin").write_bytes(b"keep me")
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    for step in (2, 3):
        manager.save(step, _state(step))
    assert (foreign / "data.bin").read_bytes() == b"keep me"
    assert not (tmp_path / "iter_0000002").exists()
    assert len(manager.retention_errors) >= 1 and "iter_0000001" in manager.retention_errors[0]


def test_restore_without_any_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointingException, match="No committed checkpoint under"):
        CheckpointManager(tmp_path).restore(_state(0, empty=True))


def _run_async(rank: int, world: int, root: str) -> tuple[list[int], list[int]]:
    options = CheckpointManagerOptions(save_interval_steps=1, max_to_keep=2, async_save=True)
    with CheckpointManager(root, options) as manager:
        seen = []
        for step in range(5):
            state = _state(step, rank, world)
            manager.save(step, state)
            state["w"].data.fill_(-1)  # the trainer goes on: the checkpoint keeps the values at save()
            seen.append(len(manager.all_steps()))
    dist.barrier()  # the coordinator deletes old steps after the commit, on its own time
    assert manager.all_steps() == [3, 4]
    restored = CheckpointManager(root).restore(_state(0, rank, world, empty=True))
    expected = grid_shard("w", global_tensor("w", (8, 4), torch.float32) + 4, rank, world, (0,)).data
    assert torch.equal(restored["w"], expected) and restored["step"] == 4
    return seen, manager.all_steps()


def test_async_saves_at_two_ranks_commit_in_order_and_prune_after_commit(tmp_path: Path) -> None:
    results = run_distributed(_run_async, 2, str(tmp_path))
    for seen, final in results:
        # one save in flight at a time: each save first commits the previous one, and
        # never more than max_to_keep + the newest are on disk
        assert seen[0] == 0 and max(seen) <= 3
        assert final == [3, 4]
