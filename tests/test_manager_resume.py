"""Issue 66.2: ``resume`` gives back the whole state. Plain values are put back into the
caller's dicts where they were saved, nested as saved (no
``state["steps_trained"] = restored["steps_trained"]`` by hand), while tensors are
loaded in place as before; and an object with ``state_dict()``/``load_state_dict()``
(DCP's ``Stateful``: an LR scheduler, a data loader) is saved as an item, each rank's
own, and restored through its ``load_state_dict``. What ``resume`` returns is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardstore import ShardedObject, ShardedTensor
from shardstore.tools.manager import CheckpointManager, CheckpointManagerOptions
from tests.dist import run_distributed


class _Loader:
    """A data loader's resumable part: where it is in its data, on this rank."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _scheduler(lr: float = 0.1) -> torch.optim.lr_scheduler.StepLR:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _plain_state(rank: int = 0, weight: float = 0.0) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(weight)), replica_id=rank),
        "steps_trained": 0,
        "train": {"epoch": 0, "rng": torch.zeros(3), "seen": [], "config": {"name": "fresh"}},
    }


def test_resume_puts_plain_values_back_where_they_were_saved(tmp_path: Path) -> None:
    state = _plain_state(weight=5.0)
    state["steps_trained"] = 7
    state["train"].update(epoch=2, rng=torch.arange(3.0), seen=[3, 4], config={"name": "run1", "added": True})
    with CheckpointManager(tmp_path) as manager:
        manager.save(6, state)

    fresh = _plain_state()
    train = fresh["train"]
    with CheckpointManager(tmp_path) as manager:
        start, restored = manager.resume(fresh)

    assert start == 7
    assert fresh["steps_trained"] == 7
    assert fresh["train"] is train and train["epoch"] == 2 and train["seen"] == [3, 4]  # nested as saved
    assert torch.equal(train["rng"], torch.arange(3.0)) and train["config"] == {"name": "run1", "added": True}
    assert isinstance(fresh["w"], ShardedTensor) and fresh["w"].data.tolist() == [5.0] * 4  # in place, as before
    assert restored["steps_trained"] == 7 and restored["train"]["epoch"] == 2  # the return value as before
    assert "shardstore_manager" not in fresh


def test_restore_of_an_older_step_puts_its_values_back_too(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            state = _plain_state(weight=float(step))
            state["steps_trained"] = step
            manager.save(step, state)
        fresh = _plain_state()
        manager.restore(fresh, 1)
    assert fresh["steps_trained"] == 1 and fresh["w"].data.tolist() == [1.0] * 4


def test_a_sharded_objects_loaded_value_is_what_the_next_save_saves(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"rng": ShardedObject("rng", {"seed": 11}, (1,), (0,))})
        request = {"rng": ShardedObject("rng", {"seed": 0}, (1,), (0,))}
        manager.resume(request)
    assert request["rng"].data == {"seed": 11}


def test_a_stateful_item_is_saved_and_restored_through_load_state_dict(tmp_path: Path) -> None:
    scheduler, loader = _scheduler(), _Loader(position=96)
    for _ in range(5):
        scheduler.optimizer.step()
        scheduler.step()
    state = {**_plain_state(weight=1.0), "scheduler": scheduler, "data": {"loader": loader}}
    with CheckpointManager(tmp_path) as manager:
        manager.save(4, state)
        saved_lr = scheduler.get_last_lr()
        scheduler.step()  # what is saved is the state at the save
        loader.position = 200

    resumed_scheduler, resumed_loader = _scheduler(), _Loader()
    fresh = {**_plain_state(), "scheduler": resumed_scheduler, "data": {"loader": resumed_loader}}
    with CheckpointManager(tmp_path) as manager:
        start, restored = manager.resume(fresh)

    assert start == 5
    assert fresh["scheduler"] is resumed_scheduler and fresh["data"]["loader"] is resumed_loader
    assert resumed_scheduler.last_epoch == 5 and resumed_scheduler.get_last_lr() == saved_lr
    assert resumed_loader.position == 96
    assert restored["scheduler"] is resumed_scheduler and restored["data"]["loader"] is resumed_loader


def _run_items_at_two_ranks(rank: int, world: int, root: str) -> tuple[int, int, list[float], int]:
    scheduler, loader = _scheduler(), _Loader(position=1000 + rank)  # each rank reads its own data
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
    state = {**_plain_state(rank, weight=2.0), "scheduler": scheduler, "loader": loader}
    state["steps_trained"] = 3
    with CheckpointManager(root, CheckpointManagerOptions(async_save=True)) as manager:
        manager.save(2, state)
    resumed_scheduler, resumed_loader = _scheduler(), _Loader()
    fresh = {**_plain_state(rank), "scheduler": resumed_scheduler, "loader": resumed_loader}
    with CheckpointManager(root) as manager:
        start, _ = manager.resume(fresh)
    return start, resumed_loader.position, resumed_scheduler.get_last_lr(), fresh["steps_trained"]


def test_stateful_items_restore_each_ranks_own_state_at_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(_run_items_at_two_ranks, 2, str(tmp_path))
    expected_lr = [0.1 * 0.5]  # StepLR(step_size=2, gamma=0.5) after 3 steps
    assert [(start, position, steps) for start, position, _, steps in results] == [(3, 1000, 3), (3, 1001, 3)]
    assert all(lr == expected_lr for _, _, lr, _ in results)


def _resume_warnings(root: Path, caplog, **options) -> list[str]:
    caplog.clear()
    with caplog.at_level("INFO", logger="shardstore"), CheckpointManager(
        root, CheckpointManagerOptions(**options)
    ) as manager:
        manager.resume(_plain_state())
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_resume_that_finds_nothing_warns_naming_the_root_and_what_it_holds(tmp_path: Path, caplog) -> None:
    """Issue 77.3: a root with a typo restarted training at step 0 and said so at INFO
    only. The warning names the root and says what is there instead."""
    with CheckpointManager(tmp_path / "run1") as manager:
        manager.save(5, _plain_state())

    (typo,) = _resume_warnings(tmp_path / "run_1", caplog)
    assert str(tmp_path / "run_1") in typo and "starts at step 0" in typo and "empty or does not exist" in typo
    (parent,) = _resume_warnings(tmp_path, caplog)  # the run's parent: an entry, not a step
    assert "1 entry, none a step directory named like iter_0000000" in parent, parent
    (prefix,) = _resume_warnings(tmp_path / "run1", caplog, step_prefix="step_")
    assert "step_prefix='step_'" in prefix, prefix
    (tmp_path / "run2" / "iter_0000003").mkdir(parents=True)  # a save that died before its commit
    (uncommitted,) = _resume_warnings(tmp_path / "run2", caplog)
    assert "its step directory iter_0000003 is not committed" in uncommitted, uncommitted
    assert _resume_warnings(tmp_path / "run1", caplog) == []  # found: no warning


def test_a_manager_under_torchrun_without_a_process_group_says_so(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    """Issue 77.4: torchrun's workers that never start a process group each ran a 1-rank
    manager over one root, silently."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="shardstore"), CheckpointManager(tmp_path):
        pass
    (warning,) = [r.getMessage() for r in caplog.records if "WORLD_SIZE" in r.getMessage()]
    assert "WORLD_SIZE=2 and no process group" in warning and "dist.init_process_group()" in warning
    monkeypatch.setenv("WORLD_SIZE", "1")
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardstore"), CheckpointManager(tmp_path):
        pass
    assert not caplog.records


def _save_items_at_two_ranks(rank: int, world: int, root: str) -> None:
    scheduler, loader = _scheduler(), _Loader(position=1000 + rank)  # the same schedule; each rank's data
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
    with CheckpointManager(root) as manager:
        manager.save(2, {**_plain_state(rank), "scheduler": scheduler, "data": {"loader": loader}})


def _resume_at_one_rank(root: str, **options) -> tuple[torch.optim.lr_scheduler.StepLR, _Loader]:
    scheduler, loader = _scheduler(), _Loader(position=-1)
    with CheckpointManager(root, CheckpointManagerOptions(**options)) as manager:
        assert manager.resume({**_plain_state(), "scheduler": scheduler, "data": {"loader": loader}})[0] == 3
    return scheduler, loader


def test_items_saved_at_two_ranks_resume_at_one_as_the_user_says(tmp_path: Path) -> None:
    """Issue 77.2: an LR scheduler and a data loader saved at 2 ranks, resumed at 1, failed
    with "ShardedObject 'shardstore_manager.items.scheduler' shard ... is missing", about
    an object the user never made. An item every rank saved alike (the scheduler)
    restores at any world size; one that differs (the loader) as the user says, and
    without a word from the user the error names the item and the choices."""
    import pytest

    from shardstore import CheckpointingException

    run_distributed(_save_items_at_two_ranks, 2, str(tmp_path))
    with pytest.raises(CheckpointingException) as refused:
        _resume_at_one_rank(str(tmp_path))
    message = str(refused.value)
    assert "'data.loader' was saved by 2 ranks" in message and "this job has 1" in message, message
    assert "items_at_another_world_size={'data.loader': ...}" in message and "'rank_0'" in message
    assert "'fresh'" in message and "missing" not in message, message

    scheduler, loader = _resume_at_one_rank(str(tmp_path), items_at_another_world_size={"data.loader": "rank_0"})
    assert scheduler.last_epoch == 3 and scheduler.get_last_lr() == [0.1 * 0.5] and loader.position == 1000
    scheduler, loader = _resume_at_one_rank(str(tmp_path), items_at_another_world_size={"data.loader": "fresh"})
    assert scheduler.last_epoch == 3 and loader.position == -1  # not restored: as it was


def _resume_at_two_ranks(rank: int, world: int, root: str) -> tuple[int, int]:
    scheduler, loader = _scheduler(), _Loader(position=-1)
    options = CheckpointManagerOptions(items_at_another_world_size={"data.loader": "rank_0"})
    with CheckpointManager(root, options) as manager:
        manager.resume({**_plain_state(rank), "scheduler": scheduler, "data": {"loader": loader}})
    return scheduler.last_epoch, loader.position


def test_items_saved_at_one_rank_resume_at_two(tmp_path: Path) -> None:
    scheduler, loader = _scheduler(), _Loader(position=7)
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, {**_plain_state(), "scheduler": scheduler, "data": {"loader": loader}})
    assert run_distributed(_resume_at_two_ranks, 2, str(tmp_path)) == [(3, 7), (3, 7)]


def test_an_unknown_choice_for_an_item_is_refused_where_the_options_are_made() -> None:
    import pytest

    with pytest.raises(ValueError, match="items_at_another_world_size\\['data.loader'\\] must be one of"):
        CheckpointManagerOptions(items_at_another_world_size={"data.loader": "first"})
