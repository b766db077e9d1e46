"""Issue 16.3: the checkpoint manager saves on schedule, keeps the last K and every
M-th step, restarts from the latest committed step, and deletes only its own
checkpoints, only after a newer one committed (sync and async, 1 and 2 ranks; S3 in
test_s3.py).

Issue 23.2: it never loses a committed checkpoint: a damaged record is not a step,
retention keeps the newest and the just-saved step, a step older than the newest is
refused until an explicit ``rollback``, an interrupted deletion is finished, and
saving a committed step again writes nothing (histories drawn at random:
test_manager_history.py).

Issue 33.8: ``resume`` restores the newest committed step and returns the step after it,
so the guide's loop (docs/guide/manager.md) trains each step once across restarts (killed in the middle:
tests/test_doc_examples.py); saving a committed step this manager did not save, or one at or
before the restored step, warns."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardstore import CheckpointingException, StorageLayout
from shardstore.format.records import COMMIT_RECORD, SAVE_MARKER
from shardstore.stores.base import StorageError
from shardstore.stores.local import LocalStore
from shardstore.tools.manager import (
    DELETION_MARKER,
    MANAGER_STATE_KEY,
    CheckpointManager,
    CheckpointManagerOptions,
    steps_to_delete,
)
from tests.dist import run_distributed
from tests.scenarios import global_tensor, grid_shard

RETENTION = CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2, keep_period=4)

# a file put inside an array's directory, and chunks shared by reuse (packed arrays are never)
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


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


def test_saves_after_the_first_reuse_its_plan_until_the_structure_changes(tmp_path: Path, monkeypatch) -> None:
    """``cache_plan`` (on by default): the manager plans once while the state's
    structure stays the same, plans again when it changes, and every step is a whole
    checkpoint; off, every save plans; a strategy given to ``save`` is used as it is."""
    from shardstore.compat.megatron.strategies import zarr  # where the strategy looks it up

    plans = []
    planner = zarr.plan_save
    monkeypatch.setattr(zarr, "plan_save", lambda *args, **kwargs: plans.append(1) or planner(*args, **kwargs))
    manager = CheckpointManager(tmp_path / "cached")
    for step in range(3):
        assert manager.save(step, _state(step))
    assert len(plans) == 1
    grown = {**_state(3), "b": grid_shard("b", global_tensor("b", (4,), torch.float32), 0, 1, (0,))}
    assert manager.save(3, grown) and manager.save(4, {**_state(4), "b": grown["b"]})
    assert len(plans) == 2
    for step in range(5):
        loaded = manager.restore(_state(0, empty=True), step=step)
        assert torch.equal(loaded["w"], global_tensor("w", (8, 4), torch.float32) + step)
    plans.clear()
    uncached = CheckpointManager(tmp_path / "uncached", CheckpointManagerOptions(cache_plan=False))
    for step in range(3):
        assert uncached.save(step, _state(step))
    assert len(plans) == 3
    plans.clear()
    own = zarr.ZarrSaveShardedStrategy()
    assert manager.save(5, _state(5), sharded_strategy=own) and manager.save(6, _state(6), sharded_strategy=own)
    assert len(plans) == 2 and own.plan_cache is None


def test_the_manager_follows_the_default_strategy_when_it_changes(tmp_path: Path) -> None:
    """The plan-keeping copy of the default is made again when the default's settings
    change or another default is registered, as a plain ``save`` follows it."""
    from shardstore.format.records import read_commit_record
    from shardstore.serialization import get_default_save_sharded_strategy
    from shardstore.strategies.base import StrategyAction, register_default_strategy
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    def chunk_rows(step: int) -> int:
        return read_commit_record(manager.location(step)).arrays["w"].chunk_shape[0]

    default = get_default_save_sharded_strategy()
    layout = default.layout  # its sizes left to choose: put back as they were, not as chosen
    manager = CheckpointManager(tmp_path)
    try:
        assert manager.save(0, _state(0)) and chunk_rows(0) == 8
        default.max_chunk_bytes = 4 * 4 * 4  # 4 rows of 4 float32
        assert manager.save(1, _state(1)) and chunk_rows(1) == 4
        register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, ZarrSaveShardedStrategy(max_chunk_bytes=32))
        assert manager.save(2, _state(2)) and chunk_rows(2) == 2
    finally:
        default.layout = layout
        register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, default)
    for step in range(3):
        assert torch.equal(manager.restore(_state(0, empty=True), step=step)["w"],
                           global_tensor("w", (8, 4), torch.float32) + step)


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


def test_retention_never_deletes_what_it_cannot_prove_is_a_shardstore_checkpoint(tmp_path: Path, caplog) -> None:
    foreign = tmp_path / "iter_0000001"  # named like a step, but a zarr v3 group of another tool
    foreign.mkdir()
    (foreign / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    (foreign / "data.bin").write_bytes(b"keep me")
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    with caplog.at_level(logging.WARNING, logger="shardstore.tools.manager"):
        for step in (2, 3):
            manager.save(step, _state(step))
    assert (foreign / "data.bin").read_bytes() == b"keep me"
    assert not (tmp_path / "iter_0000002").exists()
    # not a step at all (issue 23.2): never a deletion candidate, named in a WARNING
    assert manager.all_steps() == [3] and manager.retention_errors == []
    assert any("iter_0000001 is not counted as a checkpoint step" in r.getMessage() for r in caplog.records)


def test_a_save_after_close_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """After close(), an async manager's save used to plan and begin the save (its
    staging directory made), then fail in AsyncCallsQueue with a message naming
    neither the root nor the step."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=True))
    assert manager.save(1, _state(1))
    manager.close()
    with pytest.raises(CheckpointingException, match=r"save step 2 under .*closed; create a new CheckpointManager") as info:
        manager.save(2, _state(2))
    assert str(tmp_path) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001"]
    manager.close()  # again: nothing to do


@pytest.mark.parametrize("which", ["latest", "named"])
def test_restore_commits_the_async_save_in_flight_first(tmp_path: Path, which: str) -> None:
    """``restore`` right after an async ``save`` did not wait for it, as ``resume``
    does: the latest step was the one before (here none: an error), and the step just
    saved was refused as an unfinished save. It now commits what is in flight first."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=True))
    assert manager.save(1, _state(1))
    restored = manager.restore(_state(0, empty=True), None if which == "latest" else 1)
    assert restored["step"] == 1 and torch.equal(restored["w"], _state(1)["w"].data)
    manager.close()


@pytest.mark.parametrize("call", ["restore", "resume", "rollback", "delete"])
def test_a_closed_manager_refuses_to_restore_or_delete(tmp_path: Path, call: str) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        manager.save(step, _state(step))
    manager.close()
    calls = {
        "restore": lambda: manager.restore(_state(0, empty=True), 1),
        "resume": lambda: manager.resume(_state(0, empty=True)),
        "rollback": lambda: manager.rollback(1),
        "delete": lambda: manager.delete(1),
    }
    with pytest.raises(CheckpointingException, match="CheckpointManager was closed"):
        calls[call]()
    assert CheckpointManager(tmp_path).all_steps() == [1, 2]


@pytest.mark.parametrize("step", [5.0, True, "5"])
def test_a_step_that_is_not_an_int_is_refused_naming_it(tmp_path: Path, step) -> None:
    """save(5.0) used to fail with a bare ValueError from formatting the step's name."""
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointingException, match=r"step .* under .*: a step is an int"):
        manager.save(step, _state(0), force=True)
    assert not any(tmp_path.iterdir())
    # delete and rollback too (they looked the step up by a name it never has)
    assert manager.save(1, _state(1), force=True)
    for call in (lambda: manager.delete(step, force=True), lambda: manager.rollback(step)):
        with pytest.raises(CheckpointingException, match=r"step .* under .*: a step is an int"):
            call()
    assert manager.all_steps() == [1]


@pytest.mark.parametrize("argument", ["async_sharded_save", "process_group"])
def test_save_arguments_the_manager_sets_itself_are_refused_naming_them(tmp_path: Path, argument: str) -> None:
    """These went on to shardstore.save beside the manager's own: a bare TypeError."""
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointingException, match=f"Not saving step 0 under .*passes {argument}= itself"):
        manager.save(0, _state(0), **{argument: None})
    assert not any(tmp_path.iterdir())


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


def _wait_for_background_writes(manager: CheckpointManager, timeout: float = 30) -> None:
    """Until this rank's background writes of the async saves in flight are done."""
    deadline = time.monotonic() + timeout
    while any(not future.done() for _, _, future in manager._saves._queue._pending):
        assert time.monotonic() < deadline, "the background writes did not finish"
        time.sleep(0.02)


def test_an_async_save_whose_writes_finished_is_committed_before_the_next_due_save(tmp_path: Path) -> None:
    """A save call that is not due commits an async save whose writes are done. Before,
    only the next due save (or close) committed it: with save_interval_steps=10, a
    crash at step 9 found nothing committed although step 0 was written long before."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval_steps=10, async_save=True))
    assert manager.save(0, _state(0))
    _wait_for_background_writes(manager)
    try:
        assert manager.save(1, _state(1)) is False
        assert CheckpointManager(tmp_path).latest_step() == 0  # what a restart after a crash here finds
    finally:
        manager.close()


def _run_not_due_saves_commit(rank: int, world: int, root: str) -> int | None:
    manager = CheckpointManager(root, CheckpointManagerOptions(save_interval_steps=10, async_save=True))
    manager.save(0, _state(0, rank, world))
    manager.save(1, _state(1, rank, world))  # writes maybe not done on some rank: no commit, no hang
    _wait_for_background_writes(manager)
    dist.barrier()  # step 0 is written on every rank
    manager.save(2, _state(2, rank, world))
    dist.barrier()
    latest = CheckpointManager(root).latest_step()
    manager.close()
    return latest


def test_two_ranks_commit_a_finished_async_save_at_a_save_that_is_not_due(tmp_path: Path) -> None:
    """The commit at a save that is not due is collective (the ranks agree on what
    finished): every rank calls save at the same steps, and both commit step 0 there."""
    assert run_distributed(_run_not_due_saves_commit, 2, str(tmp_path)) == [0, 0]


# ------------------------------------------------------------- issue 23.2


def _w(restored: dict) -> float:
    """The value every element of a restored ``_state`` had at save (its step)."""
    return float(restored["w"][0, 0] - global_tensor("w", (8, 4), torch.float32)[0, 0])


def _record(root: Path, step: int) -> bytes:
    return (root / f"iter_{step:07d}" / COMMIT_RECORD).read_bytes()


def test_a_newer_damaged_commit_record_is_not_a_step_and_costs_no_good_checkpoint(tmp_path: Path) -> None:
    damaged = {
        "iter_0000050": b"{not json",
        "iter_0000060": json.dumps({"attributes": []}).encode(),  # trips the record parser itself
        "iter_0000070": json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode(),
    }
    for name, record in damaged.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / COMMIT_RECORD).write_bytes(record)
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=2))
    for step in (1, 2, 3):
        assert manager.save(step, _state(step))
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
    assert _w(manager.restore(_state(0, empty=True))) == 3
    for name, record in damaged.items():  # never counted, never deleted
        assert (tmp_path / name / COMMIT_RECORD).read_bytes() == record


def test_an_unreadable_newer_record_makes_retention_keep_more_never_less(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=2))
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    unreadable = tmp_path / "iter_0000003" / COMMIT_RECORD
    real = LocalStore.get

    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        if self.root / rel == unreadable:
            raise StorageError(f"Cannot read {unreadable}: injected I/O error")
        return real(self, rel, max_bytes)

    with monkeypatch.context() as patch:
        patch.setattr(LocalStore, "get", read_bytes_or_none)
        manager.save(4, _state(4))  # 3 cannot be proven newer than 2: 2 stays as one of the newest two
        assert manager.all_steps() == [2, 4]
    assert manager.all_steps() == [2, 3, 4] and manager.retention_errors == []
    manager.save(5, _state(5))
    assert manager.all_steps() == [4, 5]


@pytest.mark.parametrize(
    ("committed", "protected", "expected"),
    [
        ([10, 20], [10], []),  # the step just saved, older than another manager's newer commit
        ([5, 10, 20], [10], [5]),
        ([10, 20], [], [10]),
    ],
)
def test_retention_never_deletes_the_step_just_saved(committed, protected, expected) -> None:
    assert steps_to_delete(committed, CheckpointManagerOptions(max_to_keep=1), protected=protected) == expected


def test_a_step_committed_after_a_newer_one_is_kept_by_its_own_retention(tmp_path: Path) -> None:
    options = CheckpointManagerOptions(max_to_keep=1)
    background = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1, async_save=True))
    foreground = CheckpointManager(tmp_path, options)
    assert background.save(10, _state(10))  # in flight
    assert foreground.save(20, _state(20))
    background.close()  # 10 commits now, after 20
    assert foreground.all_steps() == [10, 20] and foreground.latest_step() == 20
    assert _w(foreground.restore(_state(0, empty=True), 10)) == 10


def _steps_100_150_160(root: Path) -> CheckpointManager:
    manager = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=3))
    for step in (100, 150, 160):
        manager.save(step, _state(step))
    return manager


def test_saving_a_step_older_than_the_newest_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    manager = _steps_100_150_160(tmp_path)
    assert _w(manager.restore(_state(0, empty=True), 100)) == 100
    with pytest.raises(CheckpointingException, match=r"step 160 there is a newer committed.*rollback\(100\)"):
        manager.save(110, _state(110))
    assert manager.all_steps() == [100, 150, 160]
    assert not (tmp_path / "iter_0000110").exists()


def test_rollback_deletes_the_newer_steps_and_training_saves_onward(tmp_path: Path) -> None:
    manager = _steps_100_150_160(tmp_path)
    manager.restore(_state(0, empty=True), 100)
    assert manager.rollback(100) == [160, 150]
    assert manager.latest_step() == 100
    assert manager.save(110, _state(110)) and manager.save(150, _state(1500))
    assert manager.all_steps() == [100, 110, 150]
    assert _w(manager.restore(_state(0, empty=True))) == 1500  # the new history's 150
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100", "iter_0000110", "iter_0000150"]


def test_rollback_to_a_step_that_is_not_committed_deletes_nothing(tmp_path: Path) -> None:
    manager = _steps_100_150_160(tmp_path)
    with pytest.raises(CheckpointingException, match=r"Cannot roll back to step 120.*Nothing was deleted"):
        manager.rollback(120)
    assert manager.all_steps() == [100, 150, 160]


class _Crash(OSError):
    """A deletion that stops where a killed process would have stopped."""


def _crash_in_remove_tree(monkeypatch, after: int) -> None:
    """LocalStore.delete_prefix raises on its call number ``after`` + 1 and after; only
    the manager's deletions call it on local directories."""
    calls = []
    real = LocalStore.delete_prefix

    def remove_tree(self, rel: str = "", keep=()) -> None:
        calls.append(rel)
        if len(calls) > after:
            raise _Crash(f"injected crash while removing {rel}")
        real(self, rel, keep)

    monkeypatch.setattr(LocalStore, "delete_prefix", remove_tree)


def test_an_interrupted_rollback_is_finished_by_calling_it_again(tmp_path: Path, monkeypatch) -> None:
    manager = _steps_100_150_160(tmp_path)
    with monkeypatch.context() as patch:
        _crash_in_remove_tree(patch, after=0)
        with pytest.raises(CheckpointingException, match=r"incomplete.*Call rollback\(100\) again"):
            manager.rollback(100)
    assert (tmp_path / "iter_0000160" / DELETION_MARKER).exists()  # half deleted, provably ours
    assert manager.all_steps() == [100, 150]
    assert manager.rollback(100) == [150]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100"]


def test_a_deletion_cut_short_is_finished_by_the_next_retention(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _state(1))
    with monkeypatch.context() as patch:
        _crash_in_remove_tree(patch, after=1)  # step 1: one entry removed, then the crash
        assert manager.save(2, _state(2))  # the save succeeded; retention did not finish
    assert len(manager.retention_errors) == 1 and "iter_0000001" in manager.retention_errors[0]
    left = tmp_path / "iter_0000001"
    assert DELETION_MARKER in {p.name for p in left.iterdir()} and not (left / COMMIT_RECORD).exists()
    assert manager.all_steps() == [2]
    restarted = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    assert restarted.save(3, _state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003"]


def test_a_crash_before_the_commit_record_goes_leaves_the_step_whole(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _state(1))
    real = LocalStore.delete

    def remove(self, rel: str) -> None:
        if rel == COMMIT_RECORD:
            raise _Crash("injected crash before the commit record went")
        real(self, rel)

    with monkeypatch.context() as patch:
        patch.setattr(LocalStore, "delete", remove)
        manager.save(2, _state(2))
    assert (tmp_path / "iter_0000001" / DELETION_MARKER).exists()
    assert manager.all_steps() == [1, 2]  # still a step, and loads
    assert _w(manager.restore(_state(0, empty=True), 1)) == 1
    manager.save(3, _state(3))
    assert manager.all_steps() == [3] and sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003"]


def _cut_short_before_the_record_goes(manager: CheckpointManager, step: int, monkeypatch) -> None:
    """``manager.save(step)``, its retention killed between writing the deletion marker
    of an older step and removing that step's commit record."""
    real = LocalStore.delete

    def remove(self, rel: str) -> None:
        if rel == COMMIT_RECORD:
            raise KeyboardInterrupt("the job is killed before the commit record went")
        real(self, rel)

    with monkeypatch.context() as patch:
        patch.setattr(LocalStore, "delete", remove)
        with pytest.raises(KeyboardInterrupt):
            manager.save(step, _state(step))


def test_a_deletion_cut_short_before_the_record_went_leaves_no_damage_when_the_step_is_kept(
    tmp_path: Path, monkeypatch
) -> None:
    """The step stays committed with our marker in it. Before, when a restart with a
    larger max_to_keep kept it, nothing removed the marker: verify() reported the step
    damaged and save(step, overwrite=True) refused a file the manager wrote itself."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _state(1))
    _cut_short_before_the_record_goes(manager, 2, monkeypatch)
    assert (tmp_path / "iter_0000001" / DELETION_MARKER).exists()
    restarted = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=3))
    assert restarted.save(3, _state(3))
    assert restarted.all_steps() == [1, 2, 3] and not (tmp_path / "iter_0000001" / DELETION_MARKER).exists()
    report = restarted.verify()
    assert "damaged" not in str(report) and DELETION_MARKER not in str(report), str(report)


def test_rolling_back_to_a_step_whose_deletion_was_cut_short_lets_it_be_saved_again(
    tmp_path: Path, monkeypatch
) -> None:
    """rollback keeps the target step: our marker left in it by a deletion cut short
    goes, so that a save with overwrite=True replaces the step (it refused before)."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _state(1))
    _cut_short_before_the_record_goes(manager, 2, monkeypatch)
    assert manager.rollback(1) == [2]
    assert not (tmp_path / "iter_0000001" / DELETION_MARKER).exists()
    assert manager.save(1, _state(5), overwrite=True)
    assert _w(manager.restore(_state(0, empty=True), 1)) == 5


def test_retention_deletes_only_directories_it_can_prove_are_its_own(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    foreign = {
        "iter_0000000": {"notes.txt": b"a user's own folder"},
        "iter_0000001": {".metadata": b"DCP", "__0_0.distcp": b"DCP data"},  # another tool's checkpoint
        "iter_0000002": {"metadata.json": b"{}", "w/c.0": b"x"},  # no record, no marker of ours
        "iter_0000003": {DELETION_MARKER: json.dumps({"step": 9, "save_id": "ab"}).encode()},  # not its step
    }
    for name, files in foreign.items():
        for rel, data in files.items():
            (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / name / rel).write_bytes(data)
    elsewhere = tmp_path / "other-run"
    CheckpointManager(elsewhere).save(4, _state(4))
    (root / "iter_0000004").symlink_to(elsewhere / "iter_0000004")  # a step linked in from another run
    manager = CheckpointManager(root, CheckpointManagerOptions(max_to_keep=1))
    for step in (5, 6):
        manager.save(step, _state(step))
    for name, files in foreign.items():
        assert {str(p.relative_to(root / name)) for p in (root / name).rglob("*") if p.is_file()} == set(files)
    assert manager.retention_errors and "symbolic link" in manager.retention_errors[0]
    assert CheckpointManager(elsewhere).latest_step() == 4  # not deleted through the link
    assert manager.latest_step() == 6 and not (root / "iter_0000005").exists()


def test_retention_keeps_another_programs_files_saved_beside_a_step(tmp_path: Path, caplog) -> None:
    """A step saved into a shared directory (shared_directory=True) holds another
    program's files, which its record names as ``beside``. Retention used to delete
    every entry of the step: now only what the record vouches for goes."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    step0 = tmp_path / "iter_0000000"
    step0.mkdir()
    (step0 / "modelopt_state.pt").write_bytes(b"another program's file")
    assert manager.save(0, _state(0), shared_directory=True)
    with caplog.at_level(logging.WARNING, logger="shardstore.tools.manager"):
        assert manager.save(1, _state(1))
    assert [p.name for p in step0.iterdir()] == ["modelopt_state.pt"]
    assert (step0 / "modelopt_state.pt").read_bytes() == b"another program's file"
    assert manager.all_steps() == [1] and not manager.retention_errors
    assert any("modelopt_state.pt" in r.getMessage() and "iter_0000000" in r.getMessage() for r in caplog.records)


def test_retention_keeps_a_file_added_into_a_step_after_its_commit(tmp_path: Path) -> None:
    """A file a user put into a committed step later (evaluation results, beside the
    step and inside one of its arrays) is not the save's: retention used to delete it
    with the step."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1, layout=PER_ARRAY))
    assert manager.save(0, _state(0))
    step0 = tmp_path / "iter_0000000"
    (step0 / "eval_results.json").write_text('{"acc": 0.9}')
    (step0 / "w" / "notes.txt").write_text("the user's")
    assert manager.save(1, _state(1))
    left = sorted(str(p.relative_to(step0)) for p in step0.rglob("*"))
    assert left == ["eval_results.json", "w", "w/notes.txt"]
    assert manager.all_steps() == [1]


def test_an_interrupted_deletion_with_an_older_marker_is_still_finished(tmp_path: Path) -> None:
    """A marker written before the commit record was copied into it says only the step
    and save id: that deletion is finished as before, the whole directory removed."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _state(1))
    step1 = tmp_path / "iter_0000001"
    save_id = manager.step_state(1).save_id
    (step1 / DELETION_MARKER).write_text(json.dumps({"step": 1, "save_id": save_id}))
    (step1 / COMMIT_RECORD).unlink()
    assert manager.step_state(1).kind == "deleting"
    assert manager.save(2, _state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saving_a_step_committed_before_the_manager_started_writes_nothing_and_warns(
    tmp_path: Path, caplog, async_save: bool
) -> None:
    options = CheckpointManagerOptions(max_to_keep=2, async_save=async_save)
    with CheckpointManager(tmp_path, options) as manager:
        for step in (0, 1):
            manager.save(step, _state(step))
    record = _record(tmp_path, 1)
    with CheckpointManager(tmp_path, options) as restarted, caplog.at_level(logging.INFO, logger="shardstore.tools.manager"):
        start = restarted.latest_step()
        assert start == 1
        assert restarted.save(start, _state(99)) is False  # the loop before issue 33.8: resuming at the latest step
        warned = [r for r in caplog.records if "Not saving step 1" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING, caplog.records
        assert "manager.resume" in warned[0].getMessage()
        assert restarted.save(2, _state(2))
        caplog.clear()
        assert restarted.save(2, _state(2), force=True) is False  # its own save again (after the loop): expected
        assert [r.levelno for r in caplog.records if "Not saving step 2" in r.getMessage()] == [logging.INFO]
    assert _record(tmp_path, 1) == record and CheckpointManager(tmp_path).all_steps() == [1, 2]
    assert _w(CheckpointManager(tmp_path).restore(_state(0, empty=True), 1)) == 1


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_restores_the_newest_committed_step_and_continues_after_it(tmp_path: Path, async_save: bool) -> None:
    options = CheckpointManagerOptions(save_interval_steps=2, async_save=async_save)
    with CheckpointManager(tmp_path, options) as fresh:
        assert fresh.resume(_state(0, empty=True)) == (0, None)  # nothing committed: start at 0
        for step in range(5):
            fresh.save(step, _state(step))
    (tmp_path / "iter_0000006").mkdir()  # a save that died before its commit: not resumed from
    with CheckpointManager(tmp_path, options) as restarted:
        request = _state(0, empty=True)
        start, restored = restarted.resume(request)
        assert start == 5 and restored is not None  # 4 is the newest committed step: train 5 next
        assert _w(restored) == 4 and restored["step"] == 4
        assert restored["w"] is request["w"].data  # loaded in place


@pytest.mark.parametrize("strict", ["return_all", "return_unexpected"])
def test_restore_leaves_the_managers_key_out_also_when_load_returns_the_mismatched_keys(
    tmp_path: Path, strict: str
) -> None:
    """With a strict mode that makes load return (state, missing, unexpected), restore
    used to leave the manager's metrics in the trainer's state (it dropped them only
    from a plain dict)."""
    manager = CheckpointManager(tmp_path)
    assert manager.save(0, _state(0), metrics={"loss": 1.0})
    assert MANAGER_STATE_KEY not in manager.restore(_state(0, empty=True), 0)
    result = manager.restore(_state(0, empty=True), 0, strict=strict)
    assert isinstance(result, tuple) and MANAGER_STATE_KEY not in result[0] and _w(result[0]) == 0


def test_a_save_at_or_before_the_restored_step_warns_even_when_not_due(tmp_path: Path, caplog) -> None:
    """A preemption save commits a step off the interval; a loop that resumes at it saves
    it again when it is not due: the warning must not depend on the save being due."""
    options = CheckpointManagerOptions(save_interval_steps=100)
    CheckpointManager(tmp_path, options).save(7, _state(7), force=True)  # e.g. saved on SIGTERM
    manager = CheckpointManager(tmp_path, options)
    manager.restore(_state(0, empty=True))
    with caplog.at_level(logging.WARNING, logger="shardstore.tools.manager"):
        assert manager.save(7, _state(7)) is False  # trains 7 twice: not due, nothing written
        assert manager.save(8, _state(8)) is False
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "after restoring step 7" in warned[0] and "manager.resume" in warned[0], warned


MANAGER_PAGE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "manager.md"


def _guide_manager_block() -> str:
    text = MANAGER_PAGE.read_text()
    section = text[text.index("## The loop") :]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def test_the_guides_training_loop_restarts_where_it_stopped(tmp_path: Path) -> None:
    block = _guide_manager_block().replace("/tmp/ckpt/", f"{tmp_path}/")
    assert "total_steps = 2500" in block
    for total_steps in (2001, 3001):  # a run, then its restart after the latest step
        namespace: dict = {}
        run = block.replace("total_steps = 2500", f"total_steps = {total_steps}")
        exec(compile(run, str(MANAGER_PAGE), "exec"), namespace)
        assert namespace["manager"].latest_step() == total_steps - 1
        assert namespace["weight"].tolist() == [total_steps] * 4  # each step trained once
        assert namespace["state"]["steps_trained"] == total_steps
        scheduler = namespace["scheduler"]  # Stateful items, restored by resume: the optimizer's lr too
        assert scheduler.last_epoch == total_steps and scheduler.get_last_lr() == [0.1 * 0.5 ** (total_steps // 1000)]
    assert CheckpointManager(tmp_path / "run1").all_steps() == [0, 1000, 2000, 3000]


def _run_collective_decisions(rank: int, world: int, root: str) -> list:
    options = CheckpointManagerOptions(max_to_keep=3)
    outcomes = []
    with CheckpointManager(root, options) as manager:
        for step in (100, 150, 160):
            manager.save(step, _state(step, rank, world))
    with CheckpointManager(root, options) as restarted:  # a restart, on every rank
        outcomes.append(restarted.save(160, _state(160, rank, world)))  # resume: no-op everywhere
        try:
            restarted.save(110, _state(110, rank, world))
        except CheckpointingException as exc:
            outcomes.append(str(exc).split(":")[0])
        outcomes.append(restarted.rollback(100))
        outcomes.append(restarted.save(110, _state(110, rank, world)))
        dist.barrier()
        outcomes.append(restarted.all_steps())
    return outcomes


def test_two_ranks_take_the_same_branch_on_resume_refusal_and_rollback(tmp_path: Path) -> None:
    results = run_distributed(_run_collective_decisions, 2, str(tmp_path))
    assert results[0] == results[1] == [False, "Not saving step 110 under " + str(tmp_path), [160, 150], True, [100, 110]]


def _save_leaving_its_marker(manager: CheckpointManager, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves ``step``, the removal of its save's marker after the publishing failing."""
    real_delete = LocalStore.delete

    def delete(self: LocalStore, key: str) -> None:
        if key == SAVE_MARKER:
            raise OSError("EIO (injected)")
        real_delete(self, key)

    with monkeypatch.context() as patch:
        patch.setattr(LocalStore, "delete", delete)
        assert manager.save(step, _state(step))


def test_retention_removes_the_steps_own_save_marker_left_by_a_failed_marker_removal(
    tmp_path: Path, monkeypatch
) -> None:
    """A save whose marker removal failed after the publish (``_remove_own_marker``
    logs it: "harmless: the next save into it removes it") leaves ``.shardstore-save.json``
    naming the step's own save, proven ours by ``own_markers``. The manager never saves
    into that step again; its deletion removes only the record's vouched paths, so the
    step directory stays forever holding that marker, with a WARNING calling it a file
    "its save did not write"."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval_steps=1, max_to_keep=1))
    _save_leaving_its_marker(manager, 0, monkeypatch)
    assert (tmp_path / "iter_0000000" / SAVE_MARKER).exists()
    assert manager.save(1, _state(1))  # retention deletes step 0
    assert manager.all_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001"], (
        f"step 0 half-deleted: {sorted(p.name for p in (tmp_path / 'iter_0000000').iterdir())}"
    )


def test_a_step_rolled_back_over_can_be_saved_again_after_its_marker_was_left(tmp_path: Path, monkeypatch) -> None:
    """The same leftover as above blocks training on after a rollback: ``rollback(4)``
    deletes step 5 but leaves ``iter_0000005/.shardstore-save.json`` (its own save's
    marker), and the save of step 5 is then refused ("not empty and holds no committed
    shardstore checkpoint"), the manager also blaming step 4 as a failed reuse base."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3))
    assert manager.save(4, _state(4))
    _save_leaving_its_marker(manager, 5, monkeypatch)
    assert manager.rollback(4) == [5]
    assert manager.save(5, _state(50))
    assert manager.all_steps() == [4, 5]


def test_a_record_that_cannot_be_read_now_stops_a_resume_not_skips_the_step(tmp_path: Path, monkeypatch) -> None:
    """An I/O or network error reading step 2's record (after the store's retries) made
    the step "damaged": ``latest_step`` skipped it and a resume started from step 1,
    silently training again over step 2. Now it raises, naming the step; a record that
    does not parse is still damaged and skipped."""
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(save_interval_steps=1, max_to_keep=3))
    for step in (1, 2):
        assert manager.save(step, _state(step))
    real_get = LocalStore.get

    def get(self: LocalStore, key: str, max_bytes: int | None = None) -> bytes | None:
        if key == COMMIT_RECORD and self.root.name == "iter_0000002":
            try:
                raise OSError(5, "Input/output error (injected)")
            except OSError as exc:
                raise StorageError(f"Cannot read {self.root / key}: {exc}") from exc
        return real_get(self, key, max_bytes)

    with monkeypatch.context() as patch:
        patch.setattr(LocalStore, "get", get)
        with pytest.raises(CheckpointingException, match=r"Cannot read step 2's commit record .*retry"):
            manager.latest_step()
    (tmp_path / "iter_0000002" / COMMIT_RECORD).write_text("{not json")
    assert manager.latest_step() == 1


def _run_resume_with_an_unlistable_root(rank: int, world: int, root: str) -> str:
    def list_dir(self: LocalStore, prefix: str = "") -> list[str]:
        raise PermissionError(13, "Permission denied (injected)", str(self.root))

    LocalStore.list_dir = list_dir  # this rank's process only
    manager = CheckpointManager(root)
    try:
        manager.resume(_state(0, rank, world, empty=True))
    except Exception as exc:  # what each rank's caller would catch
        return type(exc).__name__ + ("" if isinstance(exc, CheckpointingException) else " (not a CheckpointingException)")
    finally:
        manager.close()
    return "no error"


def test_every_rank_gets_a_checkpointing_exception_when_the_coordinator_fails(tmp_path: Path) -> None:
    """A decision the coordinator makes (here: the root cannot be listed) fails on every
    rank with a CheckpointingException, as ``_on_coordinator`` promises. Before, the
    coordinator raised the bare PermissionError while the other ranks raised a
    CheckpointingException: a trainer catching CheckpointingException went on on some
    ranks and died on the coordinator, and the rest hung in the next collective."""
    results = run_distributed(_run_resume_with_an_unlistable_root, 2, str(tmp_path))
    assert results == ["CheckpointingException", "CheckpointingException"], results


def _state_with_a_frozen_tensor(step: int) -> dict:
    """``_state`` and a tensor that never changes: a base always serves its chunk."""
    frozen = grid_shard("frozen", global_tensor("frozen", (8, 4), torch.float32), 0, 1, (0,))
    return {**_state(step), "frozen": frozen}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_stops_its_base_being_chosen_sync_or_async(
    tmp_path: Path, monkeypatch, async_save: bool
) -> None:
    """A save that reused chunks from step 2 and failed makes the manager stop choosing
    step 2 as a base. Before, only a sync save (or the start of an async one) was
    noted: an async save whose background writes failed left step 2 the next save's
    base, as if nothing had happened."""
    import shardstore.format.chunks as chunk_io
    from shardstore.format.records import read_commit_record

    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=async_save, layout=PER_ARRAY))
    assert manager.save(1, _state_with_a_frozen_tensor(1))
    manager.wait_until_finished()
    assert manager.save(2, _state_with_a_frozen_tensor(2))  # shares the frozen chunk with step 1
    manager.wait_until_finished()
    assert read_commit_record(manager.location(2)).reused_from.chunks == 1

    def failing_write(self, *args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(chunk_io.ChunkFile, "write", failing_write)
        with pytest.raises(CheckpointingException, match="injected"):
            manager.save(3, _state_with_a_frozen_tensor(3))
            manager.wait_until_finished()
    assert manager.save(4, _state_with_a_frozen_tensor(4))
    manager.close()
    assert manager.all_steps() == [1, 2, 4]
    assert read_commit_record(manager.location(4)).reused_from is None  # nothing shared with step 2


def test_inspecting_a_step_whose_deletion_was_cut_short_says_so_and_how_it_ends(tmp_path: Path, monkeypatch) -> None:
    from shardstore.tools.inspection import describe_checkpoint

    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=1))
    manager.save(1, _state(1))
    with monkeypatch.context() as patch:
        _crash_in_remove_tree(patch, after=1)
        assert manager.save(2, _state(2))
    with pytest.raises(CheckpointingException) as refused:
        describe_checkpoint(tmp_path / "iter_0000001")
    message = str(refused.value)
    assert "did not finish" not in message and DELETION_MARKER in message, message
    assert re.search(r"deletion .*was interrupted", message), message
    assert "CheckpointManager" in message and "retention" in message, message
