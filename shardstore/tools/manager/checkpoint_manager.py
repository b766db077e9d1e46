"""``CheckpointManager``: saves, finds and prunes the checkpoints of one training run.

The manager holds one object per idea and decides, on the coordinator, what every rank
does: ``StepDirectories`` (what a step is, ``steps.py``), ``SaveSchedule`` (when a save
is due, preemption included, ``schedule.py``), ``Retention`` (what is kept,
``retention.py``), ``StepDeletion`` (crash-safe deletion, rollback, ``deletion.py``),
``SaveRunner`` (sync and async saves, chunk reuse, ``saving.py``) and the resume of
a state (``resume.py``). Its contract, operation by operation, is in
docs/guide/manager.md.
"""

from __future__ import annotations

__all__ = ["CheckpointManager"]

import functools
import logging
import numbers
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch.distributed as dist

from shardstore.errors import CheckpointingException
from shardstore.format import SaveOptions, is_committed
from shardstore.mapping import ShardedStateDict, StateDict
from shardstore.opened import bare_location
from shardstore.protocol import Group
from shardstore.stores import Location
from shardstore.tools.manager.deletion import StepDeletion
from shardstore.tools.manager.options import MANAGER_STATE_KEY, CheckpointManagerOptions, Metrics
from shardstore.tools.manager.resume import (
    AnotherWorldSize,
    Resumed,
    put_back,
    saved_item,
    saved_item_ranks,
    with_items,
)
from shardstore.tools.manager.retention import Retention, checked_metrics, score
from shardstore.tools.manager.saving import SaveRunner
from shardstore.tools.manager.schedule import SaveSchedule
from shardstore.tools.manager.steps import StepDirectories, StepState
from shardstore.tools.root_verify import RootVerifyReport, leftovers_under, verify_checkpoints

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one training run under ``root``
    (Orbax's ``CheckpointManager`` is the model); it never loses the last good one.

    A step is the directory ``options.step_name(step)`` (``iter_0001000``) whose commit
    record reads and checks; ``save(step)`` stores the state *after* training step
    ``step``, and ``resume`` restores the newest committed step and returns the step to
    train next. Retention runs on the coordinator after each commit and deletes in an
    order that a crash at any point leaves recoverable. ``save`` of a step older than the
    newest committed one is refused: ``rollback`` first. Every rank calls every method
    with the same steps; the coordinator decides. The full contract: docs/guide/manager.md.

    Args:
        root: directory (local path, ``s3://bucket/prefix`` or a Location) holding one
            checkpoint per step.
        options: when to save and what to keep.
        process_group: the ranks that save together (default: the world).
        clock: seconds, for ``save_interval_secs`` (default ``time.monotonic``: a
            wall clock set back or forward must not skip or force a save).

    Example (the guide's loop runs in the tests)::

        manager = CheckpointManager("/ckpt/run1", CheckpointManagerOptions(save_interval_steps=1000))
        start, _ = manager.resume(state)  # fills state in place; start: the step after the newest
        for step in range(start, steps):
            manager.save(step, state)     # after training step `step`; writes when due
        manager.close()
    """

    def __init__(
        self,
        root: str | os.PathLike | Location,
        options: CheckpointManagerOptions | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = bare_location(root)
        self.options = options or CheckpointManagerOptions()
        self.process_group = process_group
        self.retention_errors: list[str] = []
        self._steps = StepDirectories(self.root, self.options)
        self._deletion = StepDeletion(self._steps, self.retention_errors)
        self._retention = Retention(self._steps, self._deletion, self.options)
        self._restored_step: int | None = None  # the step restore or resume loaded last
        self._warned_resaving_restored = False
        self._saved_steps: set[int] = set()  # the steps this manager saved (committed or in flight)
        self._closed = False
        # main thread only where it listens for preemption: raises before anything else starts
        self._schedule = SaveSchedule(self.root, self.options, lambda: Group(self.process_group), clock,
                                      self.options.async_save)
        self._saves = SaveRunner(self._steps, self.options, process_group)
        world = os.environ.get("WORLD_SIZE", "1")
        if process_group is None and not dist.is_initialized() and world.isdigit() and int(world) > 1:
            logger.warning(
                "CheckpointManager(%s) made with WORLD_SIZE=%s and no process group: each of the %s "
                "processes runs a manager of its own over this root. Call dist.init_process_group() first.",
                self.root.describe(), world, world,
            )

    # ------------------------------------------------------------------ finding steps

    def location(self, step: int) -> Location:
        """Where ``step`` is (or would be) saved."""
        return self._steps.location(step)

    def all_steps(self) -> list[int]:
        """The committed steps (commit record reads and checks), ascending. Incomplete
        saves, damaged records (WARNING) and other directories are left out. Reads every
        step's commit record."""
        return sorted(self._steps.committed())

    def latest_step(self) -> int | None:
        """The newest committed step, or None: newer directories whose record is
        damaged (WARNING) or missing are skipped. Reads the newest records until one
        checks."""
        return self._steps.newest_committed(self._steps.named())

    def step_state(self, step: int) -> StepState:
        """What the directory of ``step`` holds (``StepState``; ``StepDirectories.step_state``
        says what raises)."""
        return self._steps.step_state(step)

    def verify(self, progress: bool = False) -> RootVerifyReport:
        """``shardstore.verify`` of every step that has a commit record, a damaged one
        included (``all_steps`` leaves those out), with each damaged file listed once
        with every step that shares it (incremental saves hard-link unchanged chunks:
        ``tools.root_verify``). Never raises for damage. Not collective: call it on one
        rank."""
        steps = {self.options.step_name(step): self.location(step) for step in self._steps.named()}
        return verify_checkpoints(
            self.root.describe(), {name: loc for name, loc in steps.items() if is_committed(loc)}, progress,
            leftovers_under(self.root),
        )

    def metrics(self, step: int) -> dict[str, float] | None:
        """The metrics saved with the committed ``step`` (``save(metrics=...)``), or None
        if it was saved without. Read from the step's common state (cached by save id).

        Raises:
            CheckpointingException: ``step`` is not committed, or its common state
                cannot be read.
        """
        state = self.step_state(step)
        if state.kind != "committed":
            raise CheckpointingException(
                f"No metrics for step {step} under {self.root.describe()}: it is not a committed checkpoint "
                f"({state.reason or state.kind}). Committed steps: {self.all_steps()}."
            )
        return self._retention.read_metrics(state)

    def best_step(self) -> int | None:
        """The committed step whose metrics ``best_fn`` scores best (ties: the newer), or
        None when no step has metrics it can score; without ``best_fn``, the latest step.
        Reads every step's record and (once per manager) its metrics."""
        return self.latest_step() if self.options.best_fn is None else self._retention.best_step()

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now: ``step`` is a multiple of
        ``save_interval_steps``, or ``save_interval_secs`` have passed, or a preemption
        signal arrived. Collective when time or signals decide (docs/guide/manager.md): every
        rank calls it, and every rank gets the same answer. Says nothing about whether
        the step is already committed (then ``save`` is a no-op)."""
        due, _, _ = self._schedule.decide(step, force=False)
        return due

    def reached_preemption(self) -> bool:
        """True once a ``save`` or ``should_save`` found that a preemption signal reached
        a rank (``save_on_preemption``); the same on every rank, since it comes from
        their agreement. No collective of its own: the trainer checks it after ``save``
        and stops."""
        return self._schedule.reached_preemption()

    def reload(self) -> None:
        """Forgets what this manager remembers of the root: the metrics it read and the
        damaged records and unreadable metrics it warned about (they are warned about
        again). The steps are read from storage at every call anyway."""
        self._retention.forget()
        self._deletion.forget()
        self._steps.forget()

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        sharded_state_dict: ShardedStateDict,
        *,
        metrics: Metrics | None = None,
        force: bool = False,
        **save_kwargs: Any,
    ) -> bool:
        """Saves ``step`` (the state after training step ``step``) when it is due
        (``should_save``) or ``force``; returns whether it saved. Collective: call it at
        the same steps on every rank. A committed step is not saved again (False) unless
        ``overwrite=True``; an older step than the newest committed one is refused
        (``rollback`` first). Async: the previous save commits first, and a call that is
        not due commits one whose writes finished. Stateful items are saved through
        their ``state_dict()``. Extra keyword arguments go to ``shardstore.save``,
        except ``async_sharded_save`` and ``process_group`` (the manager's).

        Args:
            step: an int from 0 on (another type is refused).
            metrics: numbers to keep with the step (``{"loss": 1.7}``), for ``best_fn``
                and ``metrics(step)``; the coordinator's are saved, and must be scorable.
        """
        self._refuse_if_closed(f"save step {step}")
        step = self._checked_step(step, "Not saving")
        self._refuse_managers_arguments(save_kwargs, f"Not saving step {step}")
        if MANAGER_STATE_KEY in sharded_state_dict:
            raise CheckpointingException(
                f"Not saving step {step} under {self.root.describe()}: the state dict holds the key "
                f"{MANAGER_STATE_KEY!r}, which the manager keeps for its metrics; rename that entry"
            )
        if step < 0:
            raise CheckpointingException(
                f"Not saving step {step} under {self.root.describe()}: steps are numbers from 0 on"
            )
        caller_chose_base = "reuse_from" in save_kwargs  # reuse_from=None too: no base
        options = SaveOptions.resolve(save_kwargs.pop("options", None), SaveOptions(
            **{name: save_kwargs.pop(name) for name in ("overwrite", "reuse_from", "shared_directory") if name in save_kwargs},
            layout=self.options.layout,
        ))
        overwrite = bool(options.overwrite)
        if not overwrite and self._restored_step is not None and step <= self._restored_step:
            self._warn_resaving_restored(step)
        decision = self._schedule.decide(step, force)
        if not decision.due:
            self._saves.commit_finished()
            return False
        self._saves.wait()  # the check below sees the save in flight
        committed, checked, reuse_step = self._on_coordinator(lambda: self._prepare_save(step, overwrite, metrics))
        self._schedule.saved(decision)
        if committed:
            self._log_not_saving_committed(step)
            return False
        self._saved_steps.add(step)
        group = Group(self.process_group)
        sharded_state_dict = with_items(sharded_state_dict, saved_item(group.rank, group.world_size))
        if checked is not None:
            sharded_state_dict = {**sharded_state_dict, MANAGER_STATE_KEY: {"metrics": checked}}
        base = None if caller_chose_base else reuse_step
        retention = functools.partial(self._apply_retention, step, checked)
        self._saves.run(sharded_state_dict, step, base, options, save_kwargs, retention, decision.preempted)
        return True

    def _prepare_save(
        self, step: int, overwrite: bool, metrics: Metrics | None
    ) -> tuple[bool, dict | None, int | None]:
        """Coordinator, before a save: (whether ``step`` is committed already, the
        metrics to store, checked, the newest committed step up to ``step`` to reuse
        unchanged chunks from). Raises what refuses the save."""
        checked = None
        if metrics is not None:
            checked = checked_metrics(metrics, f"the metrics given to save({step})")
            if self.options.best_fn is not None:
                try:
                    score(self.options.best_fn, checked)
                except Exception as exc:
                    raise CheckpointingException(
                        f"Not saving step {step} under {self.root.describe()}: best_fn cannot score its metrics "
                        f"{checked} ({type(exc).__name__}: {exc}); pass the metrics best_fn reads. Nothing was "
                        "written."
                    ) from exc
        elif self.options.best_fn is not None:
            logger.info("Saving step %d without metrics: best_fn does not rank it", step)
        committed = self._is_committed_or_refused(step, overwrite)
        return committed, checked, None if committed else self._saves.base_for(step)

    def _is_committed_or_refused(self, step: int, overwrite: bool) -> bool:
        """Coordinator, before a save: True if ``step`` is committed (nothing to save);
        raises if a newer step is committed; finishes an interrupted deletion of ours in
        the step's directory so that the save can go there."""
        named = self._steps.named()
        if step in named:
            state = self.step_state(step)
            if state.kind == "committed" and not overwrite:
                return True
            if state.kind == "committed":
                self._deletion.keep_with_its_marker_removed(state)  # shardstore.save refuses to replace a step holding it
            if state.kind == "deleting":
                try:
                    self._deletion.finish(step)
                except (CheckpointingException, OSError) as exc:
                    raise CheckpointingException(
                        f"Cannot save step {step} into {self.location(step).describe()}: it holds a deletion of "
                        f"an old checkpoint that was cut short, and finishing it failed ({exc}). Save again, or "
                        "delete that directory yourself. Nothing was written."
                    ) from exc
            # damaged or foreign: the save refuses it, saying what is there
        newer = self._steps.newest_committed(named, above=step)
        if newer is not None:
            below = self._steps.newest_committed([s for s in named if s <= step])
            how = (
                f"call manager.rollback({below}) first (it deletes the committed steps after {below}), "
                if below is not None
                else "delete the newer steps first, "
            )
            raise CheckpointingException(
                f"Not saving step {step} under {self.root.describe()}: step {newer} there is a newer committed "
                f"checkpoint, and a restart resumes from the newest committed step, so this save would mix two "
                f"training histories. To continue training from an older step, {how}or save this run under "
                "another root. Nothing was written or deleted."
            )
        return False

    def _warn_resaving_restored(self, step: int) -> None:
        """WARNING (once per manager) for a save of a step at or before the one restored:
        the state in memory has been trained past it (docs/guide/manager.md: Resuming)."""
        if self._warned_resaving_restored:
            return
        self._warned_resaving_restored = True
        logger.warning(
            "Saving step %d after restoring step %d from %s: the restored state is the state after step %d, so "
            "training step %d again trains it twice. Start the loop at the step after the restored one: "
            "`start, restored = manager.resume(state)`; `for step in range(start, ...)`",
            step,
            self._restored_step,
            self.root.describe(),
            self._restored_step,
            step,
        )

    def _log_not_saving_committed(self, step: int) -> None:
        """``save`` of a committed step writes nothing: expected when this manager saved it
        (INFO), a sign of a loop that trains a restored step again otherwise (WARNING,
        unless ``_warn_resaving_restored`` said so already)."""
        where = self.location(step).describe()
        if step in self._saved_steps:
            logger.info("Not saving step %d again: this manager committed it to %s", step, where)
            return
        already_warned = self._restored_step is not None and step <= self._restored_step
        logger.log(
            logging.DEBUG if already_warned else logging.WARNING,
            "Not saving step %d: %s already holds it committed, saved before this manager started or by another "
            "manager; nothing was written. If this run restored that step and trained it again, start the loop "
            "at the step after it (`start, restored = manager.resume(state)`). Pass overwrite=True to replace it.",
            step,
            where,
        )

    def wait_until_finished(self) -> None:
        """Blocks until every async save has committed (collective)."""
        self._saves.wait()

    def close(self) -> None:
        """Commits the async saves still in flight, stops the background worker and puts
        back the signal handlers that ``save_on_preemption`` replaced. A preemption
        signal that no ``save`` acted on (one that arrived during ``close`` or after the
        last ``save``) then takes its default, which was held back for that save, once
        no manager listens (SIGTERM ends the process). The manager then refuses
        ``save``, ``resume``, ``restore``, ``rollback`` and ``delete``; calling ``close``
        again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._saves.close()
        except BaseException as exc:
            self._schedule.close(exc)
            raise
        self._schedule.close(None)

    def _checked_step(self, step: Any, refusal: str) -> int:
        """``step`` as an int; a float, a bool or anything else not an integer is
        refused (its directory name would not be a step's)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise CheckpointingException(
                f"{refusal} step {step!r} under {self.root.describe()}: a step is an int, got "
                f"{type(step).__name__}; pass the training step's number (int(step))"
            )
        return int(step)

    def _refuse_managers_arguments(self, kwargs: Mapping[str, Any], refusal: str) -> None:
        """Refuses keyword arguments for ``shardstore.save``/``load`` that the manager
        sets itself, naming the option that chooses them."""
        chosen = {
            "async_sharded_save": "CheckpointManagerOptions(async_save=...)",
            "process_group": "CheckpointManager(..., process_group=...)",
        }
        for name, where in chosen.items():
            if name in kwargs:
                raise CheckpointingException(
                    f"{refusal} under {self.root.describe()}: the manager passes {name}= itself; set it with "
                    f"{where} instead"
                )

    def _refuse_if_closed(self, action: str) -> None:
        """Raises before ``action`` does anything once ``close`` was called."""
        if self._closed:
            raise CheckpointingException(
                f"Cannot {action} under {self.root.describe()}: this CheckpointManager was closed; create a new "
                "CheckpointManager for the root. Nothing was written or deleted."
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ rollback and delete

    def rollback(self, step: int) -> list[int]:
        """Makes the committed ``step`` the newest step by deleting every committed step
        after it, newest first; returns those steps, descending. Collective: every rank
        calls it (after async saves in flight commit); the coordinator deletes.

        Use it to continue training from an older step (restore ``step``, ``rollback``,
        save onward): ``save`` refuses a step older than the newest committed one. Not
        atomic: if it is interrupted, call it again. Directories after ``step`` that are
        not committed shardstore steps are left alone (WARNING), except interrupted
        deletions of ours, which it finishes. docs/guide/manager.md says why Orbax's
        way does not fit.

        Raises:
            CheckpointingException: ``step`` is not a committed step (nothing deleted),
                or a deletion failed (call it again).
        """
        self._refuse_if_closed(f"roll back to step {step}")
        step = self._checked_step(step, "Not rolling back to")
        self.wait_until_finished()
        deleted = self._on_coordinator(lambda: self._deletion.rollback_to(step))
        self._saved_steps.difference_update(deleted)
        return deleted

    def delete(self, step: int, *, force: bool = False) -> None:
        """Deletes the committed ``step`` (marker first, as retention does). Collective:
        every rank calls it (after async saves in flight commit); the coordinator deletes.

        The newest committed step (the one a restart resumes from, and the only one when
        there is one) is refused unless ``force=True``; ``rollback`` makes an older step
        the newest. An interrupted deletion of ``step`` (ours) is finished. If the
        deletion fails midway, the step is no longer committed; call ``delete`` again.

        Raises:
            CheckpointingException: ``step`` is not committed or is the newest (nothing
                deleted), or the deletion failed.
        """
        self._refuse_if_closed(f"delete step {step}")
        step = self._checked_step(step, "Not deleting")
        self.wait_until_finished()
        self._on_coordinator(lambda: self._deletion.delete_step(step, force))
        self._saved_steps.discard(step)

    def _apply_retention(self, just_saved: int, metrics: dict[str, float] | None = None) -> None:
        """Coordinator, after the commit of ``just_saved``: ``Retention.apply``."""
        if Group(self.process_group).is_coordinator:
            self._retention.apply(just_saved, metrics)

    # ------------------------------------------------------------------ restoring

    def resume(self, sharded_state_dict: ShardedStateDict, **load_kwargs: Any) -> Resumed:
        """Restores the newest committed step into ``sharded_state_dict`` (``restore``: it
        then holds the saved state, plain values and Stateful items included) and returns
        the step to train next with what was loaded (``Resumed``): ``(latest + 1, state)``, or
        ``(0, None)`` when nothing is committed. Collective: every rank calls it; the
        coordinator picks the step, so every rank loads the same one (async saves in
        flight commit first). Extra keyword arguments go to ``shardstore.load``.

        ``save(step)`` stores the state after training step ``step``, so::

            start, _ = manager.resume(state)
            for step in range(start, total_steps):
                ...  # train step `step`
                manager.save(step, state)

        trains every step once, however often the run restarts.
        """
        self._refuse_if_closed("resume")
        self.wait_until_finished()
        step = self._on_coordinator(self.latest_step)
        if step is None:
            if Group(self.process_group).is_coordinator:
                logger.warning("%s", self._nothing_to_resume())
            return Resumed(0, None)
        state = self.restore(sharded_state_dict, step, **load_kwargs)
        logger.info(
            "Resumed from step %d under %s: training continues at step %d", step, self.root.describe(), step + 1
        )
        return Resumed(step + 1, state)

    def _nothing_to_resume(self) -> str:
        """What ``resume`` found under a root without a committed step, and what to check:
        a root with a typo starts training from step 0."""
        named = [self.options.step_name(step) for step in self._steps.named()]
        entries = self.root.list_top(limit=None)
        if named:
            found = (f"its step directory {named[0]} is not committed" if len(named) == 1 else
                     f"{len(named)} step directories, {named[0]} to {named[-1]}, none committed")
        elif entries:
            found = (f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}, none a step directory "
                     f"named like {self.options.step_name(0)} (step_prefix={self.options.step_prefix!r}, "
                     f"step_digits={self.options.step_digits})")
        else:
            found = "nothing: it is empty or does not exist"
        return (f"No committed checkpoint under {self.root.describe()} ({found}): training starts at "
                "step 0. To resume a run, give the manager the root its steps are in.")

    def restore(
        self, sharded_state_dict: ShardedStateDict, step: int | None = None, **load_kwargs: Any
    ) -> StateDict | tuple[StateDict, set[str], set[str]]:
        """Loads ``step`` (default: ``latest_step()``, picked on the coordinator so that
        every rank loads the same step) into ``sharded_state_dict``, which then holds
        the saved state (``resume.py``: tensors in place, plain values put back where
        they were saved, Stateful items through ``load_state_dict``). Collective. Extra
        keyword arguments go to ``shardstore.load``, and what it returns is returned
        (with a ``strict`` mode that returns the mismatched keys, the tuple), less the
        manager's own ``shardstore_manager`` entry. Async saves in flight commit first.
        To continue training, ``resume`` says which step comes next."""
        from shardstore.engine.load import load
        from shardstore.format import read_commit_record

        self._refuse_if_closed("restore " + ("the latest step" if step is None else f"step {step}"))
        self._refuse_managers_arguments(load_kwargs, "Not restoring")
        if step is not None:
            step = self._checked_step(step, "Not restoring")
        self.wait_until_finished()
        if step is None:
            step = self._on_coordinator(self.latest_step)
            if step is None:
                raise CheckpointingException(f"No committed checkpoint under {self.root.describe()} to restore")
        group = Group(self.process_group)
        location = self.location(step)
        saved = self._on_coordinator(lambda: saved_item_ranks(read_commit_record(location).object_shard_files))
        items = AnotherWorldSize(saved, group.rank, group.world_size, self.options.items_at_another_world_size)
        request = with_items(sharded_state_dict, items.requested)
        result = load(request, location, process_group=self.process_group, **load_kwargs)
        state = result[0] if isinstance(result, tuple) else result  # strict="return_...": (state, keys...)
        items.resolve(state)
        if isinstance(state, dict):
            state.pop(MANAGER_STATE_KEY, None)  # the manager's own, not the trainer's
        put_back(sharded_state_dict, state)
        self._restored_step = step
        self._warned_resaving_restored = False
        return result

    # ------------------------------------------------------------------ collectives

    def _on_coordinator(self, work: Callable[[], T]) -> T:
        """Collective: runs ``work`` on the coordinator and gives every rank its result,
        or the same CheckpointingException, so that all ranks take the same branch."""
        group = Group(self.process_group)
        result: Any = None
        error: BaseException | None = None
        if group.is_coordinator:
            try:
                result = work()
            except Exception as exc:  # sent to the other ranks, then raised here
                error = exc
        outcome = group.broadcast_object((result, None if error is None else f"{error}"))
        if isinstance(error, CheckpointingException):
            raise error
        if error is not None:  # the other ranks raise a CheckpointingException: so does this one
            raise CheckpointingException(f"{error}") from error
        if outcome[1] is not None:
            raise CheckpointingException(outcome[1])
        return outcome[0]
