"""Issue 27, item 2: a manager a long run can rely on (Orbax's ``CheckpointManager`` as
the reference): keep the best N by a metric *and* the newest K, metrics that persist
in the step so a restarted manager still ranks it, saves every T seconds by the
coordinator's clock (agreed across ranks), a save on SIGTERM (the handler only counts;
the next ``save`` acts, async saves committed before it returns), a public ``delete``,
``reload`` and a step-name format choice. S3: tests/test_s3.py."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, load_common_state_dict
from shardstore.format.records import COMMIT_RECORD
from shardstore.stores.local import LocalStore
from shardstore.tools.manager import (
    DELETION_MARKER,
    MANAGER_STATE_KEY,
    CheckpointManager,
    CheckpointManagerOptions,
    steps_to_delete,
)
from shardstore.tools.preemption import _Dispatcher
from tests.dist import run_distributed
from tests.scenarios import global_tensor, grid_shard

BEST_LOSS = dict(best_fn=lambda metrics: metrics["loss"], best_mode="min")


def _state(step: int, rank: int = 0, world: int = 1, empty: bool = False) -> dict:
    full = global_tensor("w", (8, 4), torch.float32) + step
    return {"w": grid_shard("w", full, rank, world, (0,), empty=empty), "step": step}


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


class FakeClock:
    """Seconds as the test sets them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ keep-best


def test_keep_best_keeps_the_best_n_and_the_newest_k_too(tmp_path: Path) -> None:
    options = CheckpointManagerOptions(max_to_keep=1, keep_best=2, **BEST_LOSS)
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 3.0}
    manager = CheckpointManager(tmp_path, options)
    for step, loss in losses.items():
        assert manager.save(step, _state(step), metrics={"loss": loss})
    # best two by loss (2, 4), and the newest (6, third best): Orbax's BestN alone would
    # have deleted 6, the step a restart resumes from
    assert manager.all_steps() == [2, 4, 6]
    assert manager.best_step() == 2 and manager.metrics(4) == {"loss": 2.0}
    assert steps_to_delete(losses, options, scores=losses) == [1, 3, 5]


def test_metrics_persist_in_the_step_so_a_restarted_manager_ranks_old_steps(tmp_path: Path) -> None:
    options = CheckpointManagerOptions(max_to_keep=1, keep_best=2, **BEST_LOSS)
    with CheckpointManager(tmp_path, options) as first:
        for step, loss in {1: 0.5, 2: 3.0, 3: 2.0}.items():
            first.save(step, _state(step), metrics={"loss": loss})
    assert first.all_steps() == [1, 3]
    restarted = CheckpointManager(tmp_path, options)
    assert restarted.metrics(1) == {"loss": 0.5} and restarted.best_step() == 1
    for step, loss in {4: 4.0, 5: 5.0}.items():
        restarted.save(step, _state(step), metrics={"loss": loss})
    assert restarted.all_steps() == [1, 3, 5]  # best two from the first run's metrics, and the newest
    # where they are: the step's common state, vouched for by its commit record
    common = load_common_state_dict(tmp_path / "iter_0000003")
    assert common[MANAGER_STATE_KEY] == {"metrics": {"loss": 2.0}}
    restored = restarted.restore(_state(0, empty=True), 3)
    assert MANAGER_STATE_KEY not in restored and restored["step"] == 3


def test_unreadable_metrics_keep_a_step_and_missing_ones_leave_it_to_its_age(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    options = CheckpointManagerOptions(max_to_keep=1, keep_best=1, **BEST_LOSS)
    manager = CheckpointManager(tmp_path, options)
    manager.save(1, _state(1))  # without metrics: ranked nowhere
    manager.save(2, _state(2), metrics={"loss": 1.0})
    manager.save(3, _state(3), metrics={"loss": 2.0})
    assert manager.all_steps() == [2, 3] and manager.metrics(3) == {"loss": 2.0}

    import shardstore.compat.megatron.serialization as serialization  # where the manager looks it up

    real = serialization.load_common_state_dict

    def unreadable_step_3(location, *args, **kwargs):
        if "iter_0000003" in location.describe():
            raise CheckpointingException(f"{location.describe()}: injected read error")
        return real(location, *args, **kwargs)

    monkeypatch.setattr(serialization, "load_common_state_dict", unreadable_step_3)
    restarted = CheckpointManager(tmp_path, options)
    with caplog.at_level(logging.WARNING, logger="shardstore.tools.manager"):
        restarted.save(4, _state(4), metrics={"loss": 0.5})
    # 4 is the best and the newest; 3 might be better than 2 for all retention knows: kept
    assert restarted.all_steps() == [3, 4] and restarted.retention_errors == []
    assert any("Cannot rank checkpoint step 3" in r.getMessage() for r in caplog.records)


class _TrainerOwnConfig:
    """A value a trainer keeps in its common state that the safe unpickler refuses."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_keep_best_ranks_the_steps_it_saved_though_their_common_state_is_refused(tmp_path: Path) -> None:
    """Metrics were read back from each step's common state, whose other values the
    safe unpickler may refuse (a trainer's own class): then no step could be ranked and
    keep_best kept every step, for good. The metrics a step was saved with now rank it."""
    options = CheckpointManagerOptions(max_to_keep=1, keep_best=1, **BEST_LOSS)
    manager = CheckpointManager(tmp_path, options)
    for step, loss in {1: 3.0, 2: 1.0, 3: 2.0, 4: 4.0}.items():
        manager.save(step, {**_state(step), "config": _TrainerOwnConfig(0.1)}, metrics={"loss": loss})
    assert manager.all_steps() == [2, 4] and manager.retention_errors == []


def test_a_save_whose_metrics_cannot_be_kept_or_scored_is_refused_before_writing(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(max_to_keep=2, keep_best=1, **BEST_LOSS))
    with pytest.raises(CheckpointingException, match=r"best_fn cannot score its metrics.*KeyError.*Nothing was"):
        manager.save(1, _state(1), metrics={"accuracy": 0.9})
    with pytest.raises(CheckpointingException, match=r"'loss' maps to str"):
        manager.save(1, _state(1), metrics={"loss": "low"})
    with pytest.raises(CheckpointingException, match=r"holds the key 'shardstore_manager'"):
        manager.save(1, {**_state(1), MANAGER_STATE_KEY: 1})
    assert list(tmp_path.iterdir()) == []
    assert manager.save(1, _state(1), metrics={"loss": torch.tensor(0.25)})  # a loss tensor is its value
    assert manager.metrics(1) == {"loss": 0.25}


@pytest.mark.parametrize(
    "options",
    [
        dict(keep_best=2),  # nothing to rank by
        dict(keep_best=2, **BEST_LOSS),  # no max_to_keep: every step is kept anyway
        dict(best_mode="lowest"),
        dict(step_digits=0),
        dict(save_interval_secs=0),
    ],
)
def test_options_that_cannot_do_what_they_say_are_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        CheckpointManagerOptions(**options)



@pytest.mark.parametrize(
    "options",
    [
        dict(max_to_keep=2.0),  # a number from a config file
        dict(keep_best=1.0, max_to_keep=1, **BEST_LOSS),
        dict(step_digits=7.0),
        dict(save_interval_steps=2.5),
        dict(keep_period=2.5),
        dict(max_to_keep=True),
    ],
)
def test_a_step_count_that_is_not_an_int_is_refused_naming_the_option(tmp_path: Path, options: dict) -> None:
    """Before, such options were taken: ``max_to_keep=2.0`` or ``keep_best=1.0``
    committed the first step and then failed its ``save`` with a bare TypeError from a
    slice in retention (at every save), ``step_digits=7.0`` failed every save with a
    format error, ``save_interval_steps=2.5`` saved steps 0, 5, 10, ..."""
    name = next(iter(options))
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        CheckpointManagerOptions(**options)


# ------------------------------------------------------------------ when to save


def test_save_interval_secs_saves_when_the_interval_has_passed(tmp_path: Path) -> None:
    clock = FakeClock()
    options = CheckpointManagerOptions(save_interval_steps=None, save_interval_secs=60)
    manager = CheckpointManager(tmp_path, options, clock=clock)
    saved = []
    for step, now in enumerate([10, 59, 61, 100, 120, 121, 150, 200]):
        clock.now = now
        assert manager.should_save(step) == (step in (2, 5, 7))
        if manager.save(step, _state(step)):
            saved.append(step)
    assert saved == [2, 5, 7]  # 61 s after the start, then 60 s after each save
    clock.now = 1000
    restarted = CheckpointManager(tmp_path, options, clock=clock)
    clock.now = 1061
    assert restarted.save(7, _state(7)) is False  # a due step that is committed: resuming, a no-op


def _run_agreed_decisions(rank: int, world: int, root: str) -> tuple[list[int], bool, list[int]]:
    clock = FakeClock()
    options = CheckpointManagerOptions(save_interval_steps=None, save_interval_secs=25, save_on_preemption=True)
    saved = []
    with CheckpointManager(root, options, clock=clock) as manager:
        if rank != 0:
            clock.now = 1e9  # this rank's clock says "due" at every step: the coordinator's decides
        for step in range(8):
            if rank == 0:
                clock.now = 10.0 * step  # due at step 3 (30 s), then 25 s after the last save
            if step == 4 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # preemption seen by rank 1 only
            if manager.save(step, _state(step, rank, world)):
                saved.append(step)
        return saved, manager.reached_preemption(), manager.all_steps()


def test_two_ranks_agree_on_time_and_on_a_signal_that_reached_one_of_them(tmp_path: Path) -> None:
    results = run_distributed(_run_agreed_decisions, 2, str(tmp_path))
    # 3: the coordinator's interval; 4: SIGTERM on rank 1; 7: the interval from step 4
    assert results[0] == results[1] == ([3, 4, 7], True, [3, 4, 7])


@pytest.fixture
def sigterm_restored():
    """The test's SIGTERM handler, put back whatever the test does."""
    previous = signal.getsignal(signal.SIGTERM)
    yield previous
    signal.signal(signal.SIGTERM, previous)


def _send_sigterm(manager: CheckpointManager) -> None:
    # never to a process whose SIGTERM would still end it (pytest itself)
    assert isinstance(signal.getsignal(signal.SIGTERM), _Dispatcher) and signal.getsignal(signal.SIGTERM).listeners
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_makes_the_next_save_save_and_close_puts_the_handler_back(
    tmp_path: Path, sigterm_restored, caplog
) -> None:
    options = CheckpointManagerOptions(save_interval_steps=100, save_on_preemption=True)
    manager = CheckpointManager(tmp_path, options)
    assert not manager.save(1, _state(1))
    with caplog.at_level(logging.DEBUG, logger="shardstore"):
        caplog.clear()
        _send_sigterm(manager)
        # the handler only counted: no file, no log line, no decision yet
        assert list(tmp_path.iterdir()) == [] and caplog.records == []
    assert not manager.reached_preemption()
    with caplog.at_level(logging.WARNING, logger="shardstore.tools.manager"):
        assert manager.save(2, _state(2))  # not a multiple of 100: saved for the signal
    assert manager.reached_preemption() and manager.all_steps() == [2]
    assert any("preemption signal" in r.getMessage() for r in caplog.records)
    assert not manager.save(3, _state(3))  # acted on once
    manager.close()
    assert signal.getsignal(signal.SIGTERM) == sigterm_restored


def test_sigterm_during_async_saves_commits_the_pending_save_and_its_own(tmp_path: Path, sigterm_restored) -> None:
    options = CheckpointManagerOptions(save_interval_steps=10, async_save=True, save_on_preemption=True)
    with CheckpointManager(tmp_path, options) as manager:
        assert manager.save(0, _state(0))
        assert manager.all_steps() == []  # in flight: commits at the next save
        assert manager.save(10, _state(10))
        assert manager.all_steps() == [0]
        _send_sigterm(manager)
        assert manager.save(11, _state(11))
        assert manager.all_steps() == [0, 10, 11]  # committed before save returned, not at close
        assert manager.reached_preemption()
    assert signal.getsignal(signal.SIGTERM) == sigterm_restored


# ------------------------------------------------------------------ delete, reload, names


def test_delete_refuses_the_newest_step_unless_forced(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    manager.delete(2)
    assert manager.all_steps() == [1, 3] and _names(tmp_path) == ["iter_0000001", "iter_0000003"]
    with pytest.raises(CheckpointingException, match=r"step 3 .*newest committed checkpoint, the one a restart"):
        manager.delete(3)
    with pytest.raises(CheckpointingException, match=r"Cannot delete step 5 .*not a committed.*Nothing was deleted"):
        manager.delete(5)
    manager.delete(3, force=True)
    assert manager.latest_step() == 1
    with pytest.raises(CheckpointingException, match=r"newest committed checkpoint and the only one"):
        manager.delete(1)
    assert manager.all_steps() == [1]


def test_delete_goes_marker_first_and_an_interrupted_one_is_finished_by_calling_it_again(
    tmp_path: Path, monkeypatch
) -> None:
    manager = CheckpointManager(tmp_path, CheckpointManagerOptions(async_save=True))
    for step in (1, 2):
        manager.save(step, _state(step))  # 2 is in flight: delete waits for its commit
    def crash(self, rel: str = "", keep=()) -> None:
        raise OSError(f"injected crash while removing {rel}")

    with monkeypatch.context() as patch:
        patch.setattr(LocalStore, "delete_prefix", crash)
        with pytest.raises(CheckpointingException, match=r"Call delete\(1\) again"):
            manager.delete(1)
    left = tmp_path / "iter_0000001"
    assert (left / DELETION_MARKER).exists() and not (left / COMMIT_RECORD).exists()
    assert manager.all_steps() == [2]
    manager.delete(1)
    assert _names(tmp_path) == ["iter_0000002"]
    manager.close()


def test_reload_forgets_the_metrics_read(tmp_path: Path, monkeypatch) -> None:
    import shardstore.compat.megatron.serialization as serialization  # where the manager looks it up

    CheckpointManager(tmp_path).save(1, _state(1), metrics={"loss": 1.0})
    manager = CheckpointManager(tmp_path)  # not the one that saved it, which knows its metrics
    reads = []
    real = serialization.load_common_state_dict
    monkeypatch.setattr(
        serialization, "load_common_state_dict", lambda *a, **k: reads.append(a) or real(*a, **k)
    )
    assert manager.metrics(1) == manager.metrics(1) == {"loss": 1.0}
    assert len(reads) == 1  # cached by save id
    manager.reload()
    assert manager.metrics(1) == {"loss": 1.0} and len(reads) == 2


@pytest.mark.parametrize(
    ("prefix", "digits", "names", "not_steps"),
    [
        ("iter_", 7, ["iter_0000005", "iter_0000010"], ["iter_005", "iter_00000005"]),  # Megatron-LM's
        ("", None, ["10", "5"], ["05", "x5"]),  # Orbax's default: the bare number
        ("step_", 4, ["step_0005", "step_0010"], ["step_5", "step_00005"]),  # Orbax's step_prefix="step", 4
    ],
)
def test_steps_are_named_by_the_chosen_format(tmp_path: Path, prefix, digits, names, not_steps) -> None:
    options = CheckpointManagerOptions(step_prefix=prefix, step_digits=digits)
    manager = CheckpointManager(tmp_path, options)
    for step in (5, 10):
        manager.save(step, _state(step))
    assert _names(tmp_path) == names
    assert [options.parse_step(n) for n in not_steps] == [None, None]
    assert CheckpointManager(tmp_path, options).all_steps() == [5, 10]
